// The small passes over a decode step's logits, each one operator instead of several ATen ops: after the
// weights of a step have streamed through the caches, every distinct ATen op costs its dispatch and its code's
// cache and TLB misses again, more than its arithmetic on one [N, V] row block.
//
//   all_finite(tensors) -> bool
//     whether every value of every tensor (float32 / bfloat16 / float16, any layout) is finite: the backend
//     check's once-per-step flag (kvcore/execution/backend_check.py)
//   argmax_rows(logits [N, V] float32, contiguous) -> [N] int64
//     torch.argmax(logits, -1): the first maximum of each row; a NaN counts as larger than any number, so a row
//     with one gives the index of its first NaN (kvcore/sampling/processors.py)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// x * 0 is 0 for a finite x and NaN for an infinite or NaN one: the sum of those is NaN exactly when some x is
// not finite (no sum of zeros overflows)
template <typename T>
bool finite_values(const T* x, int64_t n) {
  Vec acc(0.f), v;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    if constexpr (std::is_same_v<T, float>) {
      v = Vec::loadu(x + i);
    } else {
      at::vec::load_to_float(x + i, v);
    }
    acc = acc + v * Vec(0.f);
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += static_cast<float>(x[i]) * 0.f;
  const float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc) + tail;
  return sum == 0.f;
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu(), "all_finite: CPU tensors");
    const at::Tensor c = t.contiguous();
    const int64_t n = c.numel();
    bool ok;
    switch (c.scalar_type()) {
      case at::kFloat: ok = finite_values(c.data_ptr<float>(), n); break;
      case at::kBFloat16: ok = finite_values(c.data_ptr<c10::BFloat16>(), n); break;
      case at::kHalf: ok = finite_values(c.data_ptr<c10::Half>(), n); break;
      default: TORCH_CHECK(false, "all_finite: float32, bfloat16 or float16 tensors, got ", c.scalar_type());
    }
    if (!ok) return false;
  }
  return true;
}

int64_t argmax_row(const float* x, int64_t V) {
  // pass 1: the first chunk holding the row's maximum, or its first NaN (vectorised maxima; NaN propagates)
  constexpr int64_t kChunk = 4 * Vec::size();
  float best = -INFINITY;
  int64_t best_at = 0, j = 0;
  for (; j + kChunk <= V; j += kChunk) {
    Vec m = at::vec::maximum(at::vec::maximum(Vec::loadu(x + j), Vec::loadu(x + j + Vec::size())),
                             at::vec::maximum(Vec::loadu(x + j + 2 * Vec::size()), Vec::loadu(x + j + 3 * Vec::size())));
    const float c = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
    if (std::isnan(c)) {
      best_at = j, best = c;
      break;
    }
    if (c > best || j == 0) best = c, best_at = j;
  }
  if (!std::isnan(best))
    for (int64_t i = j; i < V; ++i) {  // the tail after the last whole chunk (or a row shorter than one)
      if (std::isnan(x[i])) return i;  // a NaN found before the tail would have ended pass 1
      if (x[i] > best || (i == 0 && j == 0)) best = x[i], best_at = i;
    }
  // pass 2: the first element of that chunk equal to the maximum (or NaN), in order
  const int64_t end = std::min(best_at + kChunk, V);
  for (int64_t i = best_at; i < end; ++i)
    if (std::isnan(best) ? std::isnan(x[i]) : x[i] == best) return i;
  return best_at;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
              logits.device().is_cpu() && logits.size(1) >= 1,
              "argmax_rows: contiguous float32 logits [N, V] on CPU, V >= 1");
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(lp + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("all_finite(Tensor[] tensors) -> bool");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("all_finite", &all_finite);
  m.impl("argmax_rows", &argmax_rows);
}
