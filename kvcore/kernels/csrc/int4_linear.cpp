// kvcore::int4_linear: y = x @ W.T, W in 4-bit groups of 32 input columns
// (W[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..15, g = k / 32: llama.cpp's Q4_1; Q4_0 is m = -8 d).
//
// Activations are quantized per row and group of 32 to int8 (a = max|x| / 127, p = round(x / a)), as
// llama.cpp does with Q8 blocks, so that one AVX512-VNNI instruction (vpdpbusd) multiplies 64 weight codes by
// 64 activation codes and sums them in groups of four. Per row r, output n and group g:
//
//   sum_k W[n, k] x[r, k] ~= d[n, g] * a[r, g] * sum_k q[n, k] p[r, k]  +  m[n, g] * a[r, g] * sum_k p[r, k]
//
// (the second term from the quantized activations, as llama.cpp's Q8_1 sums: quantize_rows.h says why). Float32
// accumulation, output rounded once.
//
// Layout (kvcore.quant.pack_int4a8 packs it): output rows in blocks of 16, for each block and group 256 bytes:
// byte (j, l) of the 4 x 64-byte vectors j = 0..3, l = 4 * row + i holds q[row, 4 j + i] in its low nibble
// and q[row, 16 + 4 j + i] in its high one: each 32-bit lane of a vector is one output row's four
// consecutive codes, vpdpbusd's operand shape. Scales: d and m, [blocks, groups, 2, 16], in float16 (exact for
// Q4_0 / Q4_1) or float32 (exact for Q4_K, whose d is a float16 times a 6-bit sub-scale).
//
//   x       [M, K]                  float32 or bfloat16, K a multiple of 32
//   packed  [N / 16, K / 32, 256]   uint8
//   dm      [N / 16, K / 32, 2, 16] float16 or float32
//   returns [M, N]                  dtype of x
//
// The matmul itself is int4a8.h's (shared with the fused decoder-layer operators, fused_layer.cpp).

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "int4a8.h"

namespace {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_linear: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.size(0) >= 1, "int4_linear: x has no rows");
  kvcore_int4a8::check_weight(packed, dm, x.size(1), "int4_linear");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_linear: x must be float32 or bfloat16");
  at::Tensor out = at::empty({x.size(0), packed.size(0) * kvcore_int4a8::kRows}, x.options());
  if (x.scalar_type() == at::kFloat)
    kvcore_int4a8::linear(x.data_ptr<float>(), x.size(0), x.size(1), packed, dm, out.data_ptr<float>());
  else
    kvcore_int4a8::linear(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), packed, dm,
                          out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("int4_linear", &int4_linear); }
