// kvcore::rescore_top_k: the second pass of the int4 LM head (kvcore/lm_head.py). Per row r, the k largest
// estimated logits are found and replaced by the exact hidden[r] . weight[j] (float32 sums of the products, rounded
// once to the model dtype), in place.
//
//   logits  [N, V]  model dtype (bfloat16 or float32), contiguous; the estimates, overwritten at each row's top k
//   hidden  [N, d]  model dtype, contiguous
//   weight  [V, d]  model dtype, rows contiguous (the dense head)
//   returns logits
//
// Selection keeps a min-heap of the k best seen so far and skips whole blocks of 64 logits whose maximum
// (one vectorised pass) does not beat the heap's smallest: after the first few thousand logits almost every
// block is skipped, so a row costs about one read of its logits (torch.topk sorts far more). Which of equal
// values at the k-th place is kept is unspecified (as for torch.topk); NaN estimates are never selected. Rows run
// in parallel.
//
// For a head held as quantized blocks (no dense [V, d] table) the two passes are separate operators, the rows
// decoded in between: top_k_candidates(logits, k) -> [N, k] int64 indices (the same selection, in the same
// order), then rescore_candidates(logits, hidden, rows [N, k, d], indices) writes the same dot products.
//
// rescore_top_k_float and rescore_candidates_float take bfloat16 and return the same logits as new float32 [N, V]
// tensors (the estimates widened by ATen's copy inside the call): each value is the bfloat16 one widened, bit for bit
// what .float() of the bfloat16 result gives, without a second operator call from Python after the head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
using Entry = std::pair<float, int64_t>;  // (logit, index); std::greater on it makes a min-heap by logit
constexpr int64_t kBlock = 64;

inline void load_floats(const float* x, Vec& out) { out = Vec::loadu(x); }
inline void load_floats(const c10::BFloat16* x, Vec& out) { at::vec::load_to_float(x, out); }

// Indices of the k largest of x[0..V) (any order).
template <typename E>
void top_k(const E* x, int64_t V, int64_t k, std::vector<Entry>& heap) {
  heap.clear();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < k; ++j) {
    const float v = static_cast<float>(x[j]);
    heap.emplace_back(std::isnan(v) ? neg_inf : v, j);
  }
  const auto cmp = [](const Entry& a, const Entry& b) { return a.first > b.first; };
  std::make_heap(heap.begin(), heap.end(), cmp);
  const auto offer = [&](int64_t j) {
    const float v = static_cast<float>(x[j]);
    if (v > heap.front().first) {  // false for NaN
      std::pop_heap(heap.begin(), heap.end(), cmp);
      heap.back() = {v, j};
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
  };
  int64_t j = k;
  for (; j + kBlock <= V; j += kBlock) {
    Vec best(neg_inf), part;
    for (int64_t i = 0; i < kBlock; i += Vec::size()) {
      load_floats(x + j + i, part);
      best = at::vec::maximum(best, part);  // a NaN propagates: its lane fails the test below, the block is scanned
    }
    // a lane where !(best <= threshold) (zero in the comparison's mask) may hold a candidate
    if ((best <= Vec(heap.front().first)).zero_mask() != 0)
      for (int64_t i = j; i < j + kBlock; ++i) offer(i);
  }
  for (; j < V; ++j) offer(j);
}

template <typename E>
float dot(const E* a, const E* b, int64_t d) {
  Vec acc(0.f), va, vb;
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    load_floats(a + i, va);
    load_floats(b + i, vb);
    acc = at::vec::fmadd(va, vb, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < d; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

// Each row's top k of the estimates `logits` (element type E), rescored into out [N, V] (of type T: logits itself,
// in place, or the widened estimates), each value rounded to E first.
template <typename E, typename T>
at::Tensor rescore_top_k_into(const at::Tensor& logits, at::Tensor out, const at::Tensor& hidden,
                              const at::Tensor& weight, int64_t k) {
  const auto type = c10::CppTypeToScalarType<E>::value;
  TORCH_CHECK(logits.scalar_type() == type && hidden.scalar_type() == type && weight.scalar_type() == type,
              "rescore_top_k: logits, hidden and weight of one dtype, bfloat16 or float32");
  TORCH_CHECK(logits.dim() == 2 && hidden.dim() == 2 && weight.dim() == 2 && logits.is_contiguous() &&
              hidden.is_contiguous() && weight.stride(1) == 1,
              "rescore_top_k: contiguous logits [N, V] and hidden [N, d], weight [V, d] with contiguous rows");
  const int64_t N = logits.size(0), V = logits.size(1), d = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == N && weight.size(0) == V && weight.size(1) == d,
              "rescore_top_k: shapes must be logits [N, V], hidden [N, d], weight [V, d]");
  TORCH_CHECK(k >= 1 && k <= V, "rescore_top_k: k must be 1..V");
  const E* lp = logits.data_ptr<E>();
  T* op = out.data_ptr<T>();
  const E* hp = hidden.data_ptr<E>();
  const E* wp = weight.data_ptr<E>();
  const int64_t w_stride = weight.stride(0);
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Entry> heap;
    heap.reserve(k);
    for (int64_t r = r0; r < r1; ++r) {
      top_k(lp + r * V, V, k, heap);  // the whole row is selected from before any of it is written
      // the k weight rows are scattered over the head and rarely cached: request them all before the first
      // dot product needs one, so their cache misses overlap
      for (const Entry& e : heap)
        for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(E)); byte += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(wp + e.second * w_stride) + byte);
      for (const Entry& e : heap)
        op[r * V + e.second] = static_cast<T>(E(dot(hp + r * d, wp + e.second * w_stride, d)));
    }
  });
  return out;
}

at::Tensor rescore_top_k(at::Tensor logits, const at::Tensor& hidden, const at::Tensor& weight, int64_t k) {
  if (logits.scalar_type() == at::kFloat) return rescore_top_k_into<float, float>(logits, logits, hidden, weight, k);
  return rescore_top_k_into<c10::BFloat16, c10::BFloat16>(logits, logits, hidden, weight, k);
}

at::Tensor rescore_top_k_float(const at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight,
                               int64_t k) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 && logits.is_contiguous(),
              "rescore_top_k_float: contiguous bfloat16 logits [N, V]");
  return rescore_top_k_into<c10::BFloat16, float>(logits, logits.to(at::kFloat), hidden, weight, k);
}

template <typename E>
at::Tensor top_k_candidates_of(const at::Tensor& logits, int64_t k) {
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "top_k_candidates: k must be 1..V");
  at::Tensor out = at::empty({N, k}, logits.options().dtype(at::kLong));
  const E* lp = logits.data_ptr<E>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Entry> heap;
    heap.reserve(k);
    for (int64_t r = r0; r < r1; ++r) {
      top_k(lp + r * V, V, k, heap);
      for (int64_t j = 0; j < k; ++j) op[r * k + j] = heap[j].second;
    }
  });
  return out;
}

at::Tensor top_k_candidates(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK((logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat) && logits.dim() == 2 &&
              logits.is_contiguous(), "top_k_candidates: contiguous bfloat16 or float32 logits [N, V]");
  if (logits.scalar_type() == at::kFloat) return top_k_candidates_of<float>(logits, k);
  return top_k_candidates_of<c10::BFloat16>(logits, k);
}

// Writes the rescored candidates into out [N, V] (of type T: in place, or the widened estimates), each value rounded
// to E (the dtype of hidden and rows) first.
template <typename E, typename T>
at::Tensor rescore_candidates_into(at::Tensor out, const at::Tensor& hidden, const at::Tensor& rows,
                                   const at::Tensor& index) {
  const auto type = c10::CppTypeToScalarType<E>::value;
  TORCH_CHECK(hidden.scalar_type() == type && rows.scalar_type() == type && index.scalar_type() == at::kLong,
              "rescore_candidates: logits, hidden and rows of one dtype (bfloat16 or float32), int64 index");
  TORCH_CHECK(out.dim() == 2 && hidden.dim() == 2 && rows.dim() == 3 && index.dim() == 2 &&
              out.is_contiguous() && hidden.is_contiguous() && rows.is_contiguous() && index.is_contiguous(),
              "rescore_candidates: contiguous logits [N, V], hidden [N, d], rows [N, k, d], index [N, k]");
  const int64_t N = out.size(0), V = out.size(1), d = hidden.size(1), k = index.size(1);
  TORCH_CHECK(hidden.size(0) == N && index.size(0) == N && rows.size(0) == N && rows.size(1) == k &&
              rows.size(2) == d, "rescore_candidates: shapes must be logits [N, V], hidden [N, d], rows [N, k, d], "
              "index [N, k]");
  T* lp = out.data_ptr<T>();
  const E* hp = hidden.data_ptr<E>();
  const E* rp = rows.data_ptr<E>();
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * k; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < V, "rescore_candidates: index out of range");
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < k; ++j)
        lp[r * V + ip[r * k + j]] = static_cast<T>(E(dot(hp + r * d, rp + (r * k + j) * d, d)));
  });
  return out;
}

at::Tensor rescore_candidates(at::Tensor logits, const at::Tensor& hidden, const at::Tensor& rows,
                              const at::Tensor& index) {
  if (logits.scalar_type() == at::kFloat) return rescore_candidates_into<float, float>(logits, hidden, rows, index);
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "rescore_candidates: bfloat16 or float32 logits");
  return rescore_candidates_into<c10::BFloat16, c10::BFloat16>(logits, hidden, rows, index);
}

at::Tensor rescore_candidates_float(const at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& rows,
                                    const at::Tensor& index) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 && logits.is_contiguous(),
              "rescore_candidates_float: contiguous bfloat16 logits [N, V]");
  return rescore_candidates_into<c10::BFloat16, float>(logits.to(at::kFloat), hidden, rows, index);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("rescore_top_k(Tensor(a!) logits, Tensor hidden, Tensor weight, int k) -> Tensor(a!)");
  m.def("top_k_candidates(Tensor logits, int k) -> Tensor");
  m.def("rescore_candidates(Tensor(a!) logits, Tensor hidden, Tensor rows, Tensor index) -> Tensor(a!)");
  m.def("rescore_top_k_float(Tensor logits, Tensor hidden, Tensor weight, int k) -> Tensor");
  m.def("rescore_candidates_float(Tensor logits, Tensor hidden, Tensor rows, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("rescore_top_k", &rescore_top_k);
  m.impl("top_k_candidates", &top_k_candidates);
  m.impl("rescore_candidates", &rescore_candidates);
  m.impl("rescore_top_k_float", &rescore_top_k_float);
  m.impl("rescore_candidates_float", &rescore_candidates_float);
}
