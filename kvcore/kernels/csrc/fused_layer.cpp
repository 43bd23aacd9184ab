// kvcore::fused_qkv and kvcore::fused_mlp: a bfloat16 decoder layer on int4a8 weights as two operators around the
// attention call (kvcore/model/fused_layer.py), instead of the ~25 eager ops whose dispatch costs more than their
// arithmetic at a decode step's few rows. Each step rounds to bfloat16 where the eager ops do, with the same
// functions (rms_norm.h, int4a8.h) or the same ATen vector code, so the results are the eager path's bit for bit:
//
// fused_qkv(h, delta, norm_weight, eps, packed, dm, cos, sin, rotated_heads) -> qkv [T, N]
//   h += delta (when given, in place); x = rms_norm(h) * norm_weight; qkv = x @ W_qkv.T (int4a8);
//   then RoPE ("rotate half") on the first rotated_heads heads of width D of each row:
//   out = bf16(bf16(x * cos) + bf16(swapped * sin)), swapped = [x2, x1], sin sign-folded ([-sin, sin]) as
//   RotaryEmbedding.tables builds it: the bfloat16 products and sum of RotaryEmbedding.rotate.
//   cos, sin [T, 1, D] bfloat16 (contiguous).
//
// fused_mlp(h, attn, o_packed, o_dm, norm_weight, eps, gate_up_packed, gate_up_dm, down_packed, down_dm) -> [T, d]
//   h += attn @ W_o.T (in place); x = rms_norm(h) * norm_weight; [gate, up] = x @ W_gate_up.T;
//   returns (bf16(silu(gate)) * up) @ W_down.T, silu computed as ATen's vectorised kernel computes it.
//
// All tensors bfloat16 except the int4a8 weights (packed uint8, dm float16 or float32: int4a8.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "fused_layer.h"
#include "int4a8.h"
#include "rms_norm.h"

namespace {

using BF16 = c10::BFloat16;
using BVec = at::vec::Vectorized<BF16>;
using FVec = at::vec::Vectorized<float>;

// x [T, ld]: the first heads * D columns of each row rotated in place by that row's cos / sin [T, D].
void rotate_half(BF16* x, int64_t T, int64_t ld, int64_t heads, int64_t D, const BF16* cos, const BF16* sin) {
  const int64_t half = D / 2, vec_end = half - half % BVec::size();
  at::parallel_for(0, T, T >= 16 ? 1 : T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const BF16 *c = cos + t * D, *s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        BF16* x1 = x + t * ld + h * D;
        BF16* x2 = x1 + half;
        int64_t i = 0;
        // bfloat16 vectors multiply and add in float32 and round each result, as the eager ops do
        for (; i < vec_end; i += BVec::size()) {
          const BVec a = BVec::loadu(x1 + i), b = BVec::loadu(x2 + i);
          (a * BVec::loadu(c + i) + b * BVec::loadu(s + i)).store(x1 + i);
          (b * BVec::loadu(c + half + i) + a * BVec::loadu(s + half + i)).store(x2 + i);
        }
        for (; i < half; ++i) {
          const BF16 a = x1[i], b = x2[i];
          x1[i] = a * c[i] + b * s[i];
          x2[i] = b * c[half + i] + a * s[half + i];
        }
      }
    }
  });
}

// out [T, I] = bf16(silu(gate)) * up, gate and up the two halves of each row of gu [T, 2 I]. The same code as
// ATen's silu kernel: per row, pairs of vectors computed as x / (1 + exp(-x)) in float32 (Sleef's exp), the
// remainder by its scalar loop (std::exp).
void silu_and_mul(const BF16* gu, int64_t T, int64_t I, BF16* out) {
  const int64_t vec_end = I - I % (2 * BVec::size());
  at::parallel_for(0, T, T >= 16 ? 1 : T, [&](int64_t t0, int64_t t1) {
    const FVec one(1.f);
    for (int64_t t = t0; t < t1; ++t) {
      const BF16 *gate = gu + t * 2 * I, *up = gate + I;
      BF16* o = out + t * I;
      int64_t i = 0;
      for (; i < vec_end; i += BVec::size()) {
        auto [g0, g1] = at::vec::convert_to_float<BF16>(BVec::loadu(gate + i));
        const BVec act = at::vec::convert_from_float<BF16>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp()));
        (act * BVec::loadu(up + i)).store(o + i);
      }
      for (; i < I; ++i) {
        const float g = static_cast<float>(gate[i]);
        o[i] = BF16(g / (1.0f + std::exp(-g))) * up[i];
      }
    }
  });
}

void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
              t.size(1) == cols, what, " must be a contiguous bfloat16 [", rows, ", ", cols, "] matrix");
}

void check_norm(const at::Tensor& h, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.is_contiguous() && h.size(0) >= 1, op,
              ": h must be a contiguous bfloat16 [T, d] matrix with rows");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 && weight.is_contiguous() &&
              weight.size(0) == h.size(1), op, ": the norm weight must be a contiguous bfloat16 [d] vector");
}

}  // namespace

namespace kvcore_fused {

int64_t check_qkv(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight,
                  const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotated_heads, const char* op) {
  check_norm(h, norm_weight, op);
  const int64_t T = h.size(0), d = h.size(1), N = packed.size(0) * kvcore_int4a8::kRows, D = cos.size(-1);
  if (delta.has_value()) check_rows(*delta, T, d, "fused_qkv: delta");
  kvcore_int4a8::check_weight(packed, dm, d, op);
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->is_contiguous() && table->numel() == T * D &&
                table->size(-1) == D, op, ": cos and sin must be contiguous bfloat16 [T, 1, D] tables");
  TORCH_CHECK(D % 2 == 0 && rotated_heads >= 0 && rotated_heads * D <= N, op,
              ": rotated_heads heads of an even width D must fit in the output");
  return N;
}

int64_t check_mlp(const at::Tensor& h, int64_t A, const at::Tensor& o_packed, const at::Tensor& o_dm,
                  const at::Tensor& norm_weight, const at::Tensor& gate_up_packed, const at::Tensor& gate_up_dm,
                  const at::Tensor& down_packed, const at::Tensor& down_dm, const char* op) {
  check_norm(h, norm_weight, op);
  const int64_t d = h.size(1), two_i = gate_up_packed.size(0) * kvcore_int4a8::kRows, I = two_i / 2;
  kvcore_int4a8::check_weight(o_packed, o_dm, A, "fused_mlp (o)");
  kvcore_int4a8::check_weight(gate_up_packed, gate_up_dm, d, "fused_mlp (gate_up)");
  kvcore_int4a8::check_weight(down_packed, down_dm, I, "fused_mlp (down)");
  TORCH_CHECK(o_packed.size(0) * kvcore_int4a8::kRows == d && down_packed.size(0) * kvcore_int4a8::kRows == d &&
              two_i % 2 == 0, op, ": o and down must output d columns, gate_up an even number");
  return I;
}

void qkv(BF16* h, const BF16* delta, const BF16* norm_weight, int64_t T, int64_t d, float eps,
         const at::Tensor& packed, const at::Tensor& dm, const BF16* cos, const BF16* sin, int64_t D,
         int64_t rotated_heads, BF16* x, BF16* qkv) {
  const int64_t N = packed.size(0) * kvcore_int4a8::kRows;
  kvcore_norm::add_rms_norm(h, delta, norm_weight, T, d, eps, x);
  kvcore_int4a8::linear(x, T, d, packed, dm, qkv);
  rotate_half(qkv, T, N, rotated_heads, D, cos, sin);
}

void mlp(BF16* h, const BF16* attn, int64_t T, int64_t d, int64_t A, int64_t I, const at::Tensor& o_packed,
         const at::Tensor& o_dm, const BF16* norm_weight, float eps, const at::Tensor& gate_up_packed,
         const at::Tensor& gate_up_dm, const at::Tensor& down_packed, const at::Tensor& down_dm,
         const MlpScratch& s, BF16* out) {
  kvcore_int4a8::linear(attn, T, A, o_packed, o_dm, s.o);
  kvcore_norm::add_rms_norm(h, s.o, norm_weight, T, d, eps, s.x);
  kvcore_int4a8::linear(s.x, T, d, gate_up_packed, gate_up_dm, s.gu);
  silu_and_mul(s.gu, T, I, s.act);
  kvcore_int4a8::linear(s.act, T, I, down_packed, down_dm, out);
}

}  // namespace kvcore_fused

namespace {

at::Tensor fused_qkv(at::Tensor h, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight, double eps,
                     const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t rotated_heads) {
  const int64_t N = kvcore_fused::check_qkv(h, delta, norm_weight, packed, dm, cos, sin, rotated_heads, "fused_qkv");
  const int64_t T = h.size(0), d = h.size(1);
  std::unique_ptr<BF16[]> x(new BF16[T * d]);
  at::Tensor out = at::empty({T, N}, h.options());
  kvcore_fused::qkv(h.data_ptr<BF16>(), delta.has_value() ? delta->data_ptr<BF16>() : nullptr,
                    norm_weight.data_ptr<BF16>(), T, d, static_cast<float>(eps), packed, dm, cos.data_ptr<BF16>(),
                    sin.data_ptr<BF16>(), cos.size(-1), rotated_heads, x.get(), out.data_ptr<BF16>());
  return out;
}

at::Tensor fused_mlp(at::Tensor h, const at::Tensor& attn, const at::Tensor& o_packed, const at::Tensor& o_dm,
                     const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_packed,
                     const at::Tensor& gate_up_dm, const at::Tensor& down_packed, const at::Tensor& down_dm) {
  check_norm(h, norm_weight, "fused_mlp");
  const int64_t T = h.size(0);
  // [T, H, D] as the attention returns it is taken too: the reshape here costs no Python call per layer
  TORCH_CHECK(attn.dim() >= 2 && attn.size(0) == T, "fused_mlp: attn must be a [T, H D] matrix or [T, H, D]");
  const at::Tensor a = attn.reshape({T, -1}).contiguous();
  check_rows(a, T, a.size(1), "fused_mlp: attn");
  const int64_t I = kvcore_fused::check_mlp(h, a.size(1), o_packed, o_dm, norm_weight, gate_up_packed, gate_up_dm,
                                            down_packed, down_dm, "fused_mlp");
  const int64_t d = h.size(1);
  std::unique_ptr<BF16[]> o(new BF16[T * d]), x(new BF16[T * d]), gu(new BF16[T * 2 * I]), act(new BF16[T * I]);
  at::Tensor out = at::empty({T, d}, h.options());
  kvcore_fused::mlp(h.data_ptr<BF16>(), a.data_ptr<BF16>(), T, d, a.size(1), I, o_packed, o_dm,
                    norm_weight.data_ptr<BF16>(), static_cast<float>(eps), gate_up_packed, gate_up_dm, down_packed,
                    down_dm, {o.get(), x.get(), gu.get(), act.get()}, out.data_ptr<BF16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("fused_qkv(Tensor(a!) h, Tensor? delta, Tensor norm_weight, float eps, Tensor packed, Tensor dm, "
        "Tensor cos, Tensor sin, int rotated_heads) -> Tensor");
  m.def("fused_mlp(Tensor(a!) h, Tensor attn, Tensor o_packed, Tensor o_dm, Tensor norm_weight, float eps, "
        "Tensor gate_up_packed, Tensor gate_up_dm, Tensor down_packed, Tensor down_dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("fused_qkv", &fused_qkv);
  m.impl("fused_mlp", &fused_mlp);
}
