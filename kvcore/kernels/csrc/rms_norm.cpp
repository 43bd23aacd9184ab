// kvcore::rms_norm: a decoder's residual add and RMSNorm as one operator (kvcore/model/layers.py), bfloat16 or
// float32 (below for bfloat16; in float32 the same steps without the roundings).
//
// Per row r of h [T, d]: with delta, h[r] += delta[r] first, in place (each sum rounded to bfloat16, as
// torch's bfloat16 add_). Then out[r] = bf16(bf16(h[r] * inv) * weight), inv = 1 / sqrt(mean(h[r]^2) + eps)
// in float32: Hugging Face Llama's rounding (normalised in float32, rounded, scaled by the weight, rounded).
// The eager ops it replaces cost a dispatch each (cast, square, mean, rsqrt, two products, a cast), several
// times the arithmetic of a decode step's row; the sum of squares is taken in another order than ATen's, so a
// result may differ from theirs by one bfloat16 step where a product falls on a rounding boundary.
//
//   h       [T, d]  bfloat16 or float32, contiguous; updated when delta is given
//   delta   [T, d]  h's dtype, contiguous, or None
//   weight  [d]     h's dtype, contiguous
//   returns [T, d]  h's dtype

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "rms_norm.h"

namespace {

template <typename E>
void run(at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  kvcore_norm::add_rms_norm(h.data_ptr<E>(), delta.has_value() ? delta->data_ptr<E>() : nullptr, weight.data_ptr<E>(),
                            h.size(0), h.size(1), static_cast<float>(eps), out.data_ptr<E>());
}

at::Tensor rms_norm(at::Tensor h, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK((h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat) &&
              weight.scalar_type() == h.scalar_type(), "rms_norm: h and weight both bfloat16 or both float32");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && weight.dim() == 1 && weight.is_contiguous() &&
              weight.size(0) == h.size(1), "rms_norm: contiguous h [T, d] and weight [d]");
  if (delta.has_value())
    TORCH_CHECK(delta->scalar_type() == h.scalar_type() && delta->is_contiguous() && delta->sizes() == h.sizes(),
                "rms_norm: delta must be a contiguous tensor shaped like h, of its dtype");
  at::Tensor out = at::empty_like(h);
  if (h.scalar_type() == at::kFloat)
    run<float>(h, delta, weight, eps, out);
  else
    run<c10::BFloat16>(h, delta, weight, eps, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("rms_norm", &rms_norm); }
