// kvcore::fused_qkv and kvcore::fused_mlp: a decoder layer on int4a8 weights as two operators around the attention
// call (kvcore/model/fused_layer.py), instead of the ~25 eager ops whose dispatch costs more than their arithmetic at
// a decode step's few rows. Each step rounds where the eager ops do (in float32: each product and sum once), with the
// same functions (rms_norm.h, int4a8.h) or the same ATen vector code, so the results are the eager path's bit for bit
// in bfloat16 and in float32:
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
// All tensors of h's dtype, bfloat16 or float32, except the int4a8 weights (packed uint8, dm float16 or float32:
// int4a8.h).

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
#include <type_traits>

#include "fused_layer.h"
#include "int4a8.h"
#include "rms_norm.h"

namespace {

using BF16 = c10::BFloat16;
using BVec = at::vec::Vectorized<BF16>;
using FVec = at::vec::Vectorized<float>;

// x [T, ld]: the first heads * D columns of each row rotated in place by that row's cos / sin [T, D]. Each product is
// rounded before the sum, as the eager ops' separate multiplies and add round them: no fused multiply-add, which
// the compiler would otherwise form in float32 (GCC contracts across statements by default, clang within one).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename E>
void rotate_half(E* x, int64_t T, int64_t ld, int64_t heads, int64_t D, const E* cos, const E* sin) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  using EVec = at::vec::Vectorized<E>;
  const int64_t half = D / 2, vec_end = half - half % EVec::size();
  at::parallel_for(0, T, T >= 16 ? 1 : T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const E *c = cos + t * D, *s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        E* x1 = x + t * ld + h * D;
        E* x2 = x1 + half;
        int64_t i = 0;
        // bfloat16 vectors multiply and add in float32 and round each result, as the eager ops do
        for (; i < vec_end; i += EVec::size()) {
          const EVec a = EVec::loadu(x1 + i), b = EVec::loadu(x2 + i);
          (a * EVec::loadu(c + i) + b * EVec::loadu(s + i)).store(x1 + i);
          (b * EVec::loadu(c + half + i) + a * EVec::loadu(s + half + i)).store(x2 + i);
        }
        for (; i < half; ++i) {
          const E a = x1[i], b = x2[i];
          x1[i] = a * c[i] + b * s[i];
          x2[i] = b * c[half + i] + a * s[half + i];
        }
      }
    }
  });
}
#pragma GCC pop_options

// out [T, I] = E(silu(gate)) * up, gate and up the two halves of each row of gu [T, 2 I]. The same code as
// ATen's silu kernel: per row, (in bfloat16 pairs of) vectors computed as x / (1 + exp(-x)) in float32 (Sleef's
// exp), the remainder by its scalar loop (std::exp).
template <typename E>
void silu_and_mul(const E* gu, int64_t T, int64_t I, E* out) {
  using EVec = at::vec::Vectorized<E>;
  const int64_t step = std::is_same_v<E, float> ? FVec::size() : BVec::size();
  const int64_t vec_end = I - I % (std::is_same_v<E, float> ? step : 2 * step);
  at::parallel_for(0, T, T >= 16 ? 1 : T, [&](int64_t t0, int64_t t1) {
    const FVec one(1.f);
    for (int64_t t = t0; t < t1; ++t) {
      const E *gate = gu + t * 2 * I, *up = gate + I;
      E* o = out + t * I;
      int64_t i = 0;
      for (; i < vec_end; i += step) {
        if constexpr (std::is_same_v<E, float>) {
          const FVec g = FVec::loadu(gate + i);
          (g / (one + g.neg().exp()) * FVec::loadu(up + i)).store(o + i);
        } else {
          auto [g0, g1] = at::vec::convert_to_float<BF16>(BVec::loadu(gate + i));
          const BVec act = at::vec::convert_from_float<BF16>(g0 / (one + g0.neg().exp()),
                                                             g1 / (one + g1.neg().exp()));
          (act * EVec::loadu(up + i)).store(o + i);
        }
      }
      for (; i < I; ++i) {
        const float g = static_cast<float>(gate[i]);
        o[i] = E(g / (1.0f + std::exp(-g))) * up[i];
      }
    }
  });
}

void check_rows(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
              t.size(1) == cols, what, " must be a contiguous [", rows, ", ", cols, "] matrix of h's dtype");
}

void check_norm(const at::Tensor& h, const at::Tensor& weight, const char* op) {
  TORCH_CHECK((h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat) && h.dim() == 2 &&
              h.is_contiguous() && h.size(0) >= 1, op,
              ": h must be a contiguous bfloat16 or float32 [T, d] matrix with rows");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type() && weight.dim() == 1 && weight.is_contiguous() &&
              weight.size(0) == h.size(1), op, ": the norm weight must be a contiguous [d] vector of h's dtype");
}

}  // namespace

namespace kvcore_fused {

int64_t check_qkv(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight,
                  const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t rotated_heads, const char* op) {
  check_norm(h, norm_weight, op);
  const int64_t T = h.size(0), d = h.size(1), N = packed.size(0) * kvcore_int4a8::kRows, D = cos.size(-1);
  if (delta.has_value()) check_rows(*delta, h.scalar_type(), T, d, "fused_qkv: delta");
  kvcore_int4a8::check_weight(packed, dm, d, op);
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == h.scalar_type() && table->is_contiguous() && table->numel() == T * D &&
                table->size(-1) == D, op, ": cos and sin must be contiguous [T, 1, D] tables of h's dtype");
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

template <typename E>
void qkv(E* h, const E* delta, const E* norm_weight, int64_t T, int64_t d, float eps, const at::Tensor& packed,
         const at::Tensor& dm, const E* cos, const E* sin, int64_t D, int64_t rotated_heads, E* x, E* qkv) {
  const int64_t N = packed.size(0) * kvcore_int4a8::kRows;
  kvcore_norm::add_rms_norm(h, delta, norm_weight, T, d, eps, x);
  kvcore_int4a8::linear(x, T, d, packed, dm, qkv);
  rotate_half(qkv, T, N, rotated_heads, D, cos, sin);
}

template <typename E>
void mlp(E* h, const E* attn, int64_t T, int64_t d, int64_t A, int64_t I, const at::Tensor& o_packed,
         const at::Tensor& o_dm, const E* norm_weight, float eps, const at::Tensor& gate_up_packed,
         const at::Tensor& gate_up_dm, const at::Tensor& down_packed, const at::Tensor& down_dm,
         const MlpScratch<E>& s, E* out) {
  kvcore_int4a8::linear(attn, T, A, o_packed, o_dm, s.o);
  kvcore_norm::add_rms_norm(h, s.o, norm_weight, T, d, eps, s.x);
  kvcore_int4a8::linear(s.x, T, d, gate_up_packed, gate_up_dm, s.gu);
  silu_and_mul(s.gu, T, I, s.act);
  kvcore_int4a8::linear(s.act, T, I, down_packed, down_dm, out);
}

#define KVCORE_FUSED_LAYER(E)                                                                                        \
  template void qkv<E>(E*, const E*, const E*, int64_t, int64_t, float, const at::Tensor&, const at::Tensor&,       \
                       const E*, const E*, int64_t, int64_t, E*, E*);                                               \
  template void mlp<E>(E*, const E*, int64_t, int64_t, int64_t, int64_t, const at::Tensor&, const at::Tensor&,      \
                       const E*, float, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, \
                       const MlpScratch<E>&, E*);
KVCORE_FUSED_LAYER(BF16)
KVCORE_FUSED_LAYER(float)
#undef KVCORE_FUSED_LAYER

}  // namespace kvcore_fused

namespace {

template <typename E>
void run_qkv(at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight, double eps,
             const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& cos, const at::Tensor& sin,
             int64_t rotated_heads, at::Tensor& out) {
  const int64_t T = h.size(0), d = h.size(1);
  std::unique_ptr<E[]> x(new E[T * d]);
  kvcore_fused::qkv(h.data_ptr<E>(), delta.has_value() ? delta->data_ptr<E>() : nullptr, norm_weight.data_ptr<E>(),
                    T, d, static_cast<float>(eps), packed, dm, cos.data_ptr<E>(), sin.data_ptr<E>(), cos.size(-1),
                    rotated_heads, x.get(), out.data_ptr<E>());
}

at::Tensor fused_qkv(at::Tensor h, const std::optional<at::Tensor>& delta, const at::Tensor& norm_weight, double eps,
                     const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t rotated_heads) {
  const int64_t N = kvcore_fused::check_qkv(h, delta, norm_weight, packed, dm, cos, sin, rotated_heads, "fused_qkv");
  at::Tensor out = at::empty({h.size(0), N}, h.options());
  if (h.scalar_type() == at::kFloat)
    run_qkv<float>(h, delta, norm_weight, eps, packed, dm, cos, sin, rotated_heads, out);
  else
    run_qkv<BF16>(h, delta, norm_weight, eps, packed, dm, cos, sin, rotated_heads, out);
  return out;
}

template <typename E>
void run_mlp(at::Tensor& h, const at::Tensor& a, const at::Tensor& o_packed, const at::Tensor& o_dm,
             const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_packed, const at::Tensor& gate_up_dm,
             const at::Tensor& down_packed, const at::Tensor& down_dm, int64_t I, at::Tensor& out) {
  const int64_t T = h.size(0), d = h.size(1);
  std::unique_ptr<E[]> o(new E[T * d]), x(new E[T * d]), gu(new E[T * 2 * I]), act(new E[T * I]);
  kvcore_fused::mlp(h.data_ptr<E>(), a.data_ptr<E>(), T, d, a.size(1), I, o_packed, o_dm, norm_weight.data_ptr<E>(),
                    static_cast<float>(eps), gate_up_packed, gate_up_dm, down_packed, down_dm,
                    kvcore_fused::MlpScratch<E>{o.get(), x.get(), gu.get(), act.get()}, out.data_ptr<E>());
}

at::Tensor fused_mlp(at::Tensor h, const at::Tensor& attn, const at::Tensor& o_packed, const at::Tensor& o_dm,
                     const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_packed,
                     const at::Tensor& gate_up_dm, const at::Tensor& down_packed, const at::Tensor& down_dm) {
  check_norm(h, norm_weight, "fused_mlp");
  const int64_t T = h.size(0);
  // [T, H, D] as the attention returns it is taken too: the reshape here costs no Python call per layer
  TORCH_CHECK(attn.dim() >= 2 && attn.size(0) == T, "fused_mlp: attn must be a [T, H D] matrix or [T, H, D]");
  const at::Tensor a = attn.reshape({T, -1}).contiguous();
  check_rows(a, h.scalar_type(), T, a.size(1), "fused_mlp: attn");
  const int64_t I = kvcore_fused::check_mlp(h, a.size(1), o_packed, o_dm, norm_weight, gate_up_packed, gate_up_dm,
                                            down_packed, down_dm, "fused_mlp");
  at::Tensor out = at::empty({T, h.size(1)}, h.options());
  if (h.scalar_type() == at::kFloat)
    run_mlp<float>(h, a, o_packed, o_dm, norm_weight, eps, gate_up_packed, gate_up_dm, down_packed, down_dm, I, out);
  else
    run_mlp<BF16>(h, a, o_packed, o_dm, norm_weight, eps, gate_up_packed, gate_up_dm, down_packed, down_dm, I, out);
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
