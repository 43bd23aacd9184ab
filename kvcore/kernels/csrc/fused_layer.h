// The two halves of a fused bfloat16 int4a8 decoder layer (fused_layer.cpp documents each step's rounding) as
// functions on raw rows: what kvcore::fused_qkv and kvcore::fused_mlp run once per call, and what
// kvcore::decode_stack (decode_stack.cpp) runs for every layer, so all three agree bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>

namespace kvcore_fused {

using BF16 = c10::BFloat16;

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
void qkv(BF16* h, const BF16* delta, const BF16* norm_weight, int64_t T, int64_t d, float eps,
         const at::Tensor& packed, const at::Tensor& dm, const BF16* cos, const BF16* sin, int64_t D,
         int64_t rotated_heads, BF16* x, BF16* qkv);

// Scratch of mlp for T rows: o, x [T, d], gu [T, 2 I], act [T, I].
struct MlpScratch {
  BF16 *o, *x, *gu, *act;
};

// h [T, d] += attn [T, A] @ W_o.T; x = rms_norm(h) * norm_weight; out [T, d] = (bf16(silu(gate)) * up) @ W_down.T
// with [gate, up] = x @ W_gate_up.T ([T, 2 I]).
void mlp(BF16* h, const BF16* attn, int64_t T, int64_t d, int64_t A, int64_t I, const at::Tensor& o_packed,
         const at::Tensor& o_dm, const BF16* norm_weight, float eps, const at::Tensor& gate_up_packed,
         const at::Tensor& gate_up_dm, const at::Tensor& down_packed, const at::Tensor& down_dm,
         const MlpScratch& scratch, BF16* out);

}  // namespace kvcore_fused
