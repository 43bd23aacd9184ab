// The two halves of a fused int4a8 decoder layer (fused_layer.cpp documents each step's rounding) as functions on
// raw rows of E (bfloat16 or float32; instantiated for both): what kvcore::fused_qkv and kvcore::fused_mlp run once
// per call, and what kvcore::decode_stack (decode_stack.cpp) runs for every layer, so all three agree bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>

namespace kvcore_fused {

// fused_qkv's arguments, as its message names them (h [T, d]; the tables [T, 1, D]); returns N, qkv's width.
int64_t check_qkv(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight,
                  const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotated_heads, const char* op);
// fused_mlp's weights for h [T, d] and an attention output of A columns; returns I, the gate's width.
int64_t check_mlp(const at::Tensor& h, int64_t A, const at::Tensor& o_packed, const at::Tensor& o_dm,
                  const at::Tensor& norm_weight, const at::Tensor& gate_up_packed, const at::Tensor& gate_up_dm,
                  const at::Tensor& down_packed, const at::Tensor& down_dm, const char* op);

// h [T, d] += delta (none when null); x [T, d] = rms_norm(h) * norm_weight; qkv [T, N] = x @ W.T, then the
// first rotated_heads heads of width D of each row rotated by cos, sin [T, D]. x is scratch.
template <typename E>
void qkv(E* h, const E* delta, const E* norm_weight, int64_t T, int64_t d, float eps, const at::Tensor& packed,
         const at::Tensor& dm, const E* cos, const E* sin, int64_t D, int64_t rotated_heads, E* x, E* qkv);

// Scratch of mlp for T rows: o, x [T, d], gu [T, 2 I], act [T, I].
template <typename E>
struct MlpScratch {
  E *o, *x, *gu, *act;
};

// h [T, d] += attn [T, A] @ W_o.T; x = rms_norm(h) * norm_weight; out [T, d] = (E(silu(gate)) * up) @ W_down.T
// with [gate, up] = x @ W_gate_up.T ([T, 2 I]).
template <typename E>
void mlp(E* h, const E* attn, int64_t T, int64_t d, int64_t A, int64_t I, const at::Tensor& o_packed,
         const at::Tensor& o_dm, const E* norm_weight, float eps, const at::Tensor& gate_up_packed,
         const at::Tensor& gate_up_dm, const at::Tensor& down_packed, const at::Tensor& down_dm,
         const MlpScratch<E>& scratch, E* out);

}  // namespace kvcore_fused
