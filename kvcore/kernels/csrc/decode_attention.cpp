// kvcore::decode_attention: one decode step's attention over a contiguous KV cache, on CPU.
//
// Each sequence has one new query token; its H query heads form H_kv groups of G = H / H_kv rows that
// share one KV head (grouped-query attention). The work is split over (sequence, KV head, key chunk)
// ("split-K", as flash-decoding does on GPUs) so that even one sequence with few KV heads keeps every
// thread busy; each chunk keeps a running max and sum per query row (online softmax) and the chunks of a split
// row are merged at the end. Each key and value row is read once for the whole group and widened to float32 once;
// all arithmetic is float32, vectorised with ATen's Vectorized<float> for the ISA the build targets. Built
// with AVX512_BF16, bfloat16 rows whose size is a multiple of 32 take attend_chunk_bf16 instead (vdpbf16ps on
// the rows as they are).
//
//   q        [B, H_kv, G, D]   float32 or bfloat16, contiguous
//   k, v     [B, H_kv, L, D]   same dtype; any strides on the first three dims, rows contiguous
//   seq_lens [B]               int32, keys of sequence b: 0 .. seq_lens[b] - 1 (1 <= seq_lens[b] <= L)
//   window                     > 0: a sliding window, only keys seq_lens[b] - window .. seq_lens[b] - 1 (0: all)
//   softcap                    > 0: the scaled scores become softcap * tanh(s / softcap) (0: none)
//   returns  [B, H_kv, G, D]   dtype of q
//
// kvcore::cached_decode_attention: the cpu_decode backend's whole layer for R query tokens per sequence after its
// cache (R = 1: a decode step; R > 1: a speculative verification's [last token, drafts], a short prefill chunk)
// in one call (a Python and dispatcher round trip per op costs more than a decode step's attention at short
// contexts): writes the tokens' K/V rows into the cache, at the rows the backend planned (what its two index_copy_
// calls write), then attends over the layer's views of the batch's consecutive slots, token t of a sequence to its
// own causal length seq_lens[b] - R + 1 + t. A work item's R * G query rows share each block of keys and values
// (read once for all of them) and keep an online softmax each.
//
//   q        [B * R, H, D]      R tokens per sequence, in order; any strides, rows contiguous
//   k, v     [B * R, H_kv, D]   their keys and values; any strides, rows contiguous
//   k_cache, v_cache [L, S, H_kv, S_max, D]  contiguous, same dtype as q; written in place
//   rows     [L, B * R * H_kv]  int64: the row of each (layer, token, KV head) in k_cache viewed as [-1, D]; rows
//                               contiguous within a layer
//   layer, first_slot, max_len  the layer; the batch reads slots first_slot .. first_slot + B - 1, keys 0 .. max_len - 1
//   seq_lens [B]                int32: keys of each sequence's last token (R <= seq_lens[b] <= max_len)
//   scale, window, softcap      as decode_attention (a window counts back from each token's own position)
//   returns  [B * R, H, D]      contiguous

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "decode_attention.h"
#include "isa.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxRows = 16;  // query tokens per sequence
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kBlock = 32;      // keys scored before their values are accumulated
constexpr int64_t kAhead = 64;     // prefetch distance in keys
constexpr int64_t kChunk = 256;     // keys per work item (split-K); fewer cost more in merging than they save
constexpr int64_t kSerialRows = 512;  // keys read (sequences x KV heads x tokens) below which one thread does it all
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline void load_vec(const float* src, Vec& dst) { dst = Vec::loadu(src); }
inline void load_vec(const c10::BFloat16* src, Vec& dst) { at::vec::load_to_float(src, dst); }

// One row of D elements as NV float32 vectors, zero-padded past D (zeros change no dot product or sum).
template <int64_t NV, typename T>
inline void load_row(const T* src, int64_t D, Vec* dst) {
  if (D == NV * Vec::size()) {  // the common case, unrolled
    for (int64_t i = 0; i < NV; ++i) load_vec(src + i * Vec::size(), dst[i]);
    return;
  }
  const int64_t full = D / Vec::size();
  for (int64_t i = 0; i < full; ++i) load_vec(src + i * Vec::size(), dst[i]);
  alignas(64) float tail[Vec::size()] = {0};
  for (int64_t d = full * Vec::size(); d < D; ++d) tail[d - full * Vec::size()] = static_cast<float>(src[d]);
  for (int64_t i = full; i < NV; ++i) dst[i] = i == full ? Vec::loadu(tail) : Vec(0.f);
}

inline float sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

#if defined(CPU_CAPABILITY_AVX512)
// The 16 horizontal sums of s[0..15] as one vector (lane t = sum of s[t]): pairs merged by interleaving and
// adding, 32-bit then 64-bit elements within each 128-bit lane, then 128-bit lanes across vectors; 45
// instructions instead of 16 separate reductions.
using RawVec = __m512;
inline __m512 lane_sums(const __m512* s) {
  __m512 a[8], b[4];
  for (int t = 0; t < 8; ++t)  // per 128-bit lane: [s2t, s2t+1, s2t, s2t+1] partial sums
    a[t] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * t], s[2 * t + 1]), _mm512_unpackhi_ps(s[2 * t], s[2 * t + 1]));
  for (int u = 0; u < 4; ++u) {  // per 128-bit lane: keys 4u .. 4u + 3, that lane's share of each sum
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * u]), _mm512_castps_pd(a[2 * u + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * u]), _mm512_castps_pd(a[2 * u + 1]));
    b[u] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c01, c23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(CPU_CAPABILITY_AVX2)
// AVX2's counterpart: the 8 horizontal sums of s[0..7] as one vector, by three rounds of pairwise horizontal adds
// (within 128-bit lanes) and one add across the lanes; 9 instructions instead of 8 separate reductions.
using RawVec = __m256;
inline __m256 lane_sums(const __m256* s) {
  const __m256 a0 = _mm256_hadd_ps(s[0], s[1]), a1 = _mm256_hadd_ps(s[2], s[3]), a2 = _mm256_hadd_ps(s[4], s[5]),
               a3 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per lane: a quarter of s[0..3], s[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// One block's online-softmax step for one query row: its scores p[lo..hi) (the keys the row sees, lo < hi) become
// exp(score - max) in place (the rest of p[0..kBlock) is set to 0), and its running max m and sum l take the
// block in. Returns the factor for what was accumulated before: exp(old max - new max), 1 when the max did not
// move, 0 on the first block (m = -inf).
inline float softmax_block(float* p, int64_t lo, int64_t hi, float& m, float& l, float softcap) {
  if (softcap > 0.f)  // Gemma 2's soft-capping, on the scaled scores before the softmax
    for (int64_t j = lo; j < hi; ++j) p[j] = softcap * std::tanh(p[j] / softcap);
  std::fill(p, p + lo, kNegInf);  // keys before the row's window, after its position, padding: exp gives 0
  std::fill(p + hi, p + kBlock, kNegInf);
  Vec top = Vec::loadu(p);
  for (int64_t j = Vec::size(); j < kBlock; j += Vec::size()) top = at::vec::maximum(top, Vec::loadu(p + j));
  const float new_max =
      std::max(m, at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top));
  const float correction = new_max > m ? std::exp(m - new_max) : 1.f;  // exp(0) is 1: no call when unmoved
  Vec total(0.f);
  for (int64_t j = 0; j < kBlock; j += Vec::size()) {
    Vec e = (Vec::loadu(p + j) - Vec(new_max)).exp_u20();
    e.store(p + j);
    total = total + e;
  }
  l = l * correction + sum(total);
  m = new_max;
  return correction;
}

// The query rows of one (sequence, KV head) a work item attends: N = R * G rows, row i the query head i % G of the
// group for token i / G, at q + (i / G) * q_r + (i % G) * D; row i sees keys [lo[i], hi[i]) (its causal length and
// window, clipped to the item's chunk; none when lo[i] >= hi[i]).
struct Rows {
  int64_t N, G, q_r;
  const int64_t *lo, *hi;
};

// Keys [begin, end) of one (sequence, KV head) for the rows r: unnormalised output rows acc[N][NV * Vec::size()],
// running max m[N] and sum l[N] of exp(score - m). Each block of keys and values is widened to float32 once into
// buffers that stay in L1 and serves every row; the per-row loops keep their query and accumulator vectors in
// registers.
template <typename T, int64_t NV>
void attend_chunk(const T* q, const T* k, const T* v, int64_t k_stride, int64_t v_stride, int64_t begin,
                  int64_t end, const Rows& r, int64_t D, float scale, float softcap, float* acc, float* m, float* l) {
  constexpr int64_t W = NV * Vec::size();
  alignas(64) float kf[kBlock][W];
  alignas(64) float vf[kBlock][W];
  alignas(64) float p[kBlock];
  for (int64_t i = 0; i < r.N; ++i) {
    std::fill(acc + i * W, acc + (i + 1) * W, 0.f);
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t n = std::min(kBlock, end - b0);
    for (int64_t j = 0; j < n; ++j) {
      // Rows kAhead keys on, requested into the outer caches (locality 1): the loop waits on memory more than
      // on arithmetic, and measured faster than prefetching into L1 or leaving it to the hardware.
      if (b0 + kAhead + j < end) {
        for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k + (b0 + kAhead + j) * k_stride) + byte, 0, 1);
          __builtin_prefetch(reinterpret_cast<const char*>(v + (b0 + kAhead + j) * v_stride) + byte, 0, 1);
        }
      }
      Vec row[NV];
      load_row<NV>(k + (b0 + j) * k_stride, D, row);
      for (int64_t i = 0; i < NV; ++i) row[i].store(kf[j] + i * Vec::size());
      load_row<NV>(v + (b0 + j) * v_stride, D, row);
      for (int64_t i = 0; i < NV; ++i) row[i].store(vf[j] + i * Vec::size());
    }
    for (int64_t g = 0; g < r.N; ++g) {
      const int64_t lo = std::max(r.lo[g], b0) - b0, hi = std::min(r.hi[g], b0 + n) - b0;
      if (lo >= hi) continue;  // a row that sees none of this block
      Vec qv[NV], out[NV];
      load_row<NV>(q + (g / r.G) * r.q_r + (g % r.G) * D, D, qv);
      for (int64_t i = 0; i < NV; ++i) qv[i] = qv[i] * Vec(scale);
      int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      for (; j + Vec::size() <= hi; j += Vec::size()) {  // a vector's width of keys, summed by one lane_sums
        RawVec s[Vec::size()];
        for (int64_t t = 0; t < Vec::size(); ++t) {
          Vec acc_t = qv[0] * Vec::loadu(kf[j + t]);
          for (int64_t i = 1; i < NV; ++i) acc_t = at::vec::fmadd(qv[i], Vec::loadu(kf[j + t] + i * Vec::size()), acc_t);
          s[t] = acc_t;
        }
        Vec(lane_sums(s)).store(p + j);
      }
#endif
      for (; j < hi; ++j) {  // (the scores before lo are computed and masked)
        Vec s = qv[0] * Vec::loadu(kf[j]);
        for (int64_t i = 1; i < NV; ++i) s = at::vec::fmadd(qv[i], Vec::loadu(kf[j] + i * Vec::size()), s);
        p[j] = sum(s);
      }
      const float correction = softmax_block(p, lo, hi, m[g], l[g], softcap);
      for (int64_t i = 0; i < NV; ++i) out[i] = Vec::loadu(acc + g * W + i * Vec::size()) * Vec(correction);
      for (int64_t j = lo; j < hi; ++j) {
        const Vec pj(p[j]);
        for (int64_t i = 0; i < NV; ++i) out[i] = at::vec::fmadd(pj, Vec::loadu(vf[j] + i * Vec::size()), out[i]);
      }
      for (int64_t i = 0; i < NV; ++i) out[i].store(acc + g * W + i * Vec::size());
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(KVCORE_BF16)
#define KVCORE_BF16_DECODE 1
using BF16 = c10::BFloat16;

// acc += vdpbf16ps(q, the 32 bfloat16 at `row`), the load folded into the instruction.
inline __m512 dot_row(__m512 acc, __m512bh q, const BF16* row) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(q), "m"(*reinterpret_cast<const __m512i*>(row)));
  return acc;
}

// The scaled scores of keys [0, hi) of a block (rows `stride` elements apart, hi <= kBlock) for one query row qv of
// D = 32 NB: vdpbf16ps of the query with each key row as the cache holds it (pairs of products summed into float32
// lanes), 16 keys' lanes summed at once (lane_sums). Scores past hi (up to the next 16) are 0.
template <int64_t NB>
inline void score_block(const __m512bh* qv, const BF16* kb, int64_t stride, int64_t hi, float scale, float* p) {
  for (int64_t j0 = 0; j0 < hi; j0 += 16) {
    __m512 sc[16];
    if (j0 + 16 <= hi) {
#pragma GCC unroll 16
      for (int64_t t = 0; t < 16; ++t) {
        const BF16* key = kb + (j0 + t) * stride;
        sc[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int64_t i = 0; i < NB; ++i) sc[t] = dot_row(sc[t], qv[i], key + 32 * i);
      }
    } else {
      for (int64_t t = 0; t < 16; ++t) {
        sc[t] = _mm512_setzero_ps();
        if (j0 + t < hi)
          for (int64_t i = 0; i < NB; ++i)
            sc[t] = dot_row(sc[t], qv[i], kb + (j0 + t) * stride + 32 * i);
      }
    }
    _mm512_store_ps(p + j0, _mm512_mul_ps(lane_sums(sc), _mm512_set1_ps(scale)));
  }
}

// T rows' accumulators acc[T][D] (D = 32 NB, dims in unpacklo/unpackhi order) += the values of key pairs
// [first, last) of a block of n keys weighted by each row's bfloat16 probability pairs pw[t][pair]: each pair's
// two value rows are interleaved in registers once for the T rows, whose accumulators stay in registers.
template <int64_t NB, int64_t T>
inline void accumulate_values(const BF16* vb, int64_t stride, int64_t n, int64_t first, int64_t last,
                              const uint32_t (*pw)[kBlock / 2], float* acc) {
  constexpr int64_t D = 32 * NB;
  __m512 o[T][2 * NB];
#pragma GCC unroll 16
  for (int64_t t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int64_t i = 0; i < 2 * NB; ++i) o[t][i] = _mm512_loadu_ps(acc + t * D + 16 * i);
  const auto pair = [&](int64_t jp, bool both) {
    const BF16* v0 = vb + 2 * jp * stride;
    __m512bh vi[2 * NB];
#pragma GCC unroll 16
    for (int64_t i = 0; i < NB; ++i) {
      const __m512i x0 = _mm512_loadu_si512(v0 + 32 * i);
      const __m512i x1 = both ? _mm512_loadu_si512(v0 + stride + 32 * i) : _mm512_setzero_si512();
      vi[2 * i] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
      vi[2 * i + 1] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    }
#pragma GCC unroll 16
    for (int64_t t = 0; t < T; ++t) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pw[t][jp]));
#pragma GCC unroll 16
      for (int64_t i = 0; i < 2 * NB; ++i) o[t][i] = _mm512_dpbf16_ps(o[t][i], pp, vi[i]);
    }
  };
  const int64_t whole = std::min(last, n / 2);  // pairs with both keys in the block
  for (int64_t jp = first; jp < whole; ++jp) pair(jp, true);
  if (whole < last) pair(whole, false);  // the block's odd last key, its partner 0
#pragma GCC unroll 16
  for (int64_t t = 0; t < T; ++t)
#pragma GCC unroll 16
    for (int64_t i = 0; i < 2 * NB; ++i) _mm512_storeu_ps(acc + t * D + 16 * i, o[t][i]);
}

// attend_chunk for bfloat16 rows of D = 32 NB on CPUs with AVX512_BF16: no widening to float32, no copies. The
// scores come from the key rows as the cache holds them (score_block); the values of two consecutive keys are
// interleaved (the bfloat16-pair operand of vdpbf16ps) once per block and tile of rows and weighted by the two keys'
// probabilities rounded to bfloat16, as the prefill kernel and GPU flash attention do. Each row adds its keys in key
// order whatever the other rows of the call (a key a row does not see has probability 0 and adds an exact 0), so a
// row's result does not depend on the call's other rows. The accumulators (acc's rows) hold the dimensions in
// unpacklo/unpackhi order (per 128-bit lane: 4 dims from the low half, 4 from the high half) until the chunk is
// written out.
template <int64_t NB>
void attend_chunk_bf16(const BF16* q, const BF16* k, const BF16* v, int64_t k_stride, int64_t v_stride, int64_t begin,
                       int64_t end, const Rows& r, float scale, float softcap, float* acc, float* m, float* l) {
  constexpr int64_t D = 32 * NB;
  constexpr int64_t kTile = std::max<int64_t>(1, 24 / (2 * NB));  // rows whose accumulators fit the registers
  alignas(64) float p[kBlock];
  alignas(64) uint32_t pw[kMaxRows * kMaxGroup][kBlock / 2];  // each row's probabilities of key pairs as bfloat16 pairs
  for (int64_t g = 0; g < r.N; ++g) {
    std::fill(acc + g * D, acc + (g + 1) * D, 0.f);
    m[g] = kNegInf;
    l[g] = 0.f;
  }
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t n = std::min(kBlock, end - b0);
    for (int64_t j = 0; j < n; ++j)  // as attend_chunk: rows kAhead keys on into the outer caches
      if (b0 + kAhead + j < end)
        for (int64_t byte = 0; byte < D * 2; byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k + (b0 + kAhead + j) * k_stride) + byte, 0, 1);
          __builtin_prefetch(reinterpret_cast<const char*>(v + (b0 + kAhead + j) * v_stride) + byte, 0, 1);
        }
    int64_t first = kBlock / 2, last = 0;  // the key pairs some row sees
    for (int64_t g = 0; g < r.N; ++g) {  // scores, softmax, and the correction of what the row accumulated
      const int64_t lo = std::max(r.lo[g], b0) - b0, hi = std::min(r.hi[g], b0 + n) - b0;
      if (lo >= hi) {  // a row that sees none of this block
        std::fill(pw[g], pw[g] + kBlock / 2, 0u);
        continue;
      }
      first = std::min(first, lo / 2), last = std::max(last, (hi + 1) / 2);
      const BF16* qg = q + (g / r.G) * r.q_r + (g % r.G) * D;
      __m512bh qv[NB];
      for (int64_t i = 0; i < NB; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qg + 32 * i);
      score_block<NB>(qv, k + b0 * k_stride, k_stride, hi, scale, p);
      const float correction = softmax_block(p, lo, hi, m[g], l[g], softcap);
      if (correction != 1.f) {  // the running max moved: rescale what was accumulated
        float* ob = acc + g * D;
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t i = 0; i < 2 * NB; ++i) _mm512_storeu_ps(ob + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(ob + 16 * i), c));
      }
      _mm512_store_si512(pw[g], (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(p + 16), _mm512_load_ps(p)));
    }
    const BF16* vb = v + b0 * v_stride;
    int64_t g = 0;
    for (; g + kTile <= r.N; g += kTile) accumulate_values<NB, kTile>(vb, v_stride, n, first, last, pw + g, acc + g * D);
    [&]<int64_t... T>(std::integer_sequence<int64_t, T...>) {  // the last rows, fewer than a tile
      ((r.N - g == T + 1 ? accumulate_values<NB, T + 1>(vb, v_stride, n, first, last, pw + g, acc + g * D) : void()), ...);
    }(std::make_integer_sequence<int64_t, kTile - 1>{});
  }
  for (int64_t g = 0; g < r.N; ++g) {  // back to dimension order: lane f of vector (i, half) is dim 32 i + 8 (f / 4) + 4 half + f % 4
    alignas(64) float ob[D];
    std::copy(acc + g * D, acc + (g + 1) * D, ob);
    for (int64_t i = 0; i < NB; ++i)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t f = 0; f < 16; ++f) acc[g * D + 32 * i + 8 * (f / 4) + 4 * half + f % 4] = ob[(2 * i + half) * 16 + f];
  }
}
#endif

// One call's operands as pointers and element strides: R query tokens per sequence, query row (b, t, h, g) at
// q + b * q_b + t * q_r + (h * G + g) * D, key row (b, h, j) at k + b * k_b + h * k_h + j * k_l, value rows alike;
// out [B, R, H, G, D] contiguous (H: the KV heads). Token t of sequence b is at position seq_lens[b] - R + t: it
// sees keys up to its own (causal), the last token all seq_lens[b].
struct Strides {
  int64_t B, R, H, G, D, q_b, q_r, k_b, k_h, k_l, v_b, v_h, v_l;
};
template <typename T>
struct Operands : Strides {
  const T *q, *k, *v;
  T* out;
};

template <typename T, int64_t NV>
void decode_attention_impl(const Operands<T>& x, const int32_t* seq_lens, float scale, int64_t window, float softcap) {
  const int64_t B = x.B, R = x.R, H = x.H, G = x.G, D = x.D, N = R * G, W = NV * Vec::size();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, seq_lens[b]);
  // Chunks of a fixed kChunk keys, and blocks at multiples of kBlock: where a row's keys split never depends on
  // the other rows of the call (their lengths, R, B) nor on the thread count, so a verification row computes the
  // one-token step at its position bit for bit (speculative decoding's greedy stream is the stream without it).
  const int64_t chunk = kChunk, chunks = std::max<int64_t>(1, (max_len + chunk - 1) / chunk);
  // not cleared: an item writes its rows before the merge reads them (an empty chunk only m and l, and l = 0 skips it)
  std::unique_ptr<float[]> acc(new float[B * H * chunks * N * W]), m(new float[B * H * chunks * N]),
      l(new float[B * H * chunks * N]);

  T* op = x.out;
  // out row of item row i of (b, h): token i / G, query head h * G + i % G
  const auto out_row = [&](int64_t b, int64_t h, int64_t i) { return ((b * R + i / G) * H + h) * G + i % G; };
  // Little work (short contexts) runs on the calling thread: waking the pool costs more than it saves.
  const int64_t items = B * H * chunks, grain = B * H * R * max_len < kSerialRows ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t first, int64_t last) {
    int64_t lo[kMaxRows * kMaxGroup], hi[kMaxRows * kMaxGroup];
    for (int64_t item = first; item < last; ++item) {
      const int64_t c = item % chunks, bh = item / chunks, b = bh / H, h = bh % H;
      // row i sees keys up to its token's position; a sliding window: only its last `window` keys (its own included)
      int64_t begin = c * chunk + chunk, end = c * chunk;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t len = seq_lens[b] - R + 1 + i / G, first_key = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        lo[i] = std::max(c * chunk, first_key);
        hi[i] = std::min(len, c * chunk + chunk);
        if (lo[i] < hi[i]) begin = std::min(begin, lo[i]), end = std::max(end, hi[i]);
      }
      begin -= begin % kBlock;  // (chunks start at multiples of kBlock; a window's first key may not)
      float* as = acc.get() + item * N * W;
      float* ms = m.get() + item * N;
      float* ls = l.get() + item * N;
      if (begin >= end) {  // a short sequence of a ragged batch: no keys in this chunk
        std::fill(ms, ms + N, kNegInf);
        std::fill(ls, ls + N, 0.f);
        continue;
      }
      const Rows rows{N, G, x.q_r, lo, hi};
      const T* q = x.q + b * x.q_b + h * G * D;
      const T* k = x.k + b * x.k_b + h * x.k_h;
      const T* v = x.v + b * x.v_b + h * x.v_h;
      bool done = false;
#ifdef KVCORE_BF16_DECODE
      if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
        if (D == W) {  // whole 32-dim bfloat16 vectors
          attend_chunk_bf16<NV / 2>(q, k, v, x.k_l, x.v_l, begin, end, rows, scale, softcap, as, ms, ls);
          done = true;
        }
      }
#endif
      if (!done) attend_chunk<T, NV>(q, k, v, x.k_l, x.v_l, begin, end, rows, D, scale, softcap, as, ms, ls);
      if (chunks == 1)  // the whole row in one item: normalise here, no merge pass (the same values: w = 1)
        for (int64_t i = 0; i < N; ++i)
          for (int64_t d = 0; d < D; ++d) op[out_row(b, h, i) * D + d] = static_cast<T>(as[i * W + d] / ls[i]);
    }
  });
  if (chunks == 1) return;

  at::parallel_for(0, B * H * N, grain == 1 ? 1 : B * H * N, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const int64_t bh = r / N, i = r % N;
      float top = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, m[(bh * chunks + c) * N + i]);
      float total = 0.f, merged[NV * Vec::size()] = {0};
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (bh * chunks + c) * N + i;
        if (l[at] == 0.f) continue;  // an empty chunk
        const float w = std::exp(m[at] - top);
        total += w * l[at];
        for (int64_t d = 0; d < D; ++d) merged[d] += w * acc[at * W + d];
      }
      for (int64_t d = 0; d < D; ++d) op[out_row(bh / H, bh % H, i) * D + d] = static_cast<T>(merged[d] / total);
    }
  });
}

// NV = vectors per row, rounded up to an instantiated count (extra vectors are zero padding).
template <typename T>
void dispatch_head_dim(const Operands<T>& x, const int32_t* lens, float scale, int64_t window, float softcap) {
  const int64_t nv = (x.D + Vec::size() - 1) / Vec::size();
  if (nv <= 1) return decode_attention_impl<T, 1>(x, lens, scale, window, softcap);
  if (nv <= 2) return decode_attention_impl<T, 2>(x, lens, scale, window, softcap);
  if (nv <= 3) return decode_attention_impl<T, 3>(x, lens, scale, window, softcap);
  if (nv <= 4) return decode_attention_impl<T, 4>(x, lens, scale, window, softcap);
  if (nv <= 5) return decode_attention_impl<T, 5>(x, lens, scale, window, softcap);
  if (nv <= 6) return decode_attention_impl<T, 6>(x, lens, scale, window, softcap);
  if (nv <= 7) return decode_attention_impl<T, 7>(x, lens, scale, window, softcap);
  if (nv <= 8) return decode_attention_impl<T, 8>(x, lens, scale, window, softcap);
  if (nv <= 12) return decode_attention_impl<T, 12>(x, lens, scale, window, softcap);
  if (nv <= 16) return decode_attention_impl<T, 16>(x, lens, scale, window, softcap);
  if (nv <= 24) return decode_attention_impl<T, 24>(x, lens, scale, window, softcap);
  return decode_attention_impl<T, 32>(x, lens, scale, window, softcap);
}

// What both operators check and run: the kernel over q's data and the K/V rows at k, v (q's dtype), as s lays them
// out, the last token of sequence b reading keys 0 .. seq_lens[b] - 1 of at most L; out of out_shape
// (B * R * H * G * D elements), new.
at::Tensor attend(const at::Tensor& q, const void* k, const void* v, const Strides& s, int64_t L,
                  const at::Tensor& seq_lens, double scale, int64_t window, double softcap, at::IntArrayRef out_shape) {
  TORCH_CHECK(s.G <= kMaxGroup, "decode_attention: at most 16 query heads per KV head");
  TORCH_CHECK(s.D >= 1 && s.D <= kMaxHeadDim, "decode_attention: head_dim must be 1..256");
  TORCH_CHECK(s.R >= 1 && s.R <= kMaxRows, "cached_decode_attention: 1..16 query tokens per sequence");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == s.B &&
              seq_lens.is_contiguous(), "decode_attention: seq_lens must be int32 [B]");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < s.B; ++b)
    TORCH_CHECK(lens[b] >= s.R && lens[b] <= L, "decode_attention: seq_lens out of range ", s.R, "..", L);
  TORCH_CHECK(window >= 0 && softcap >= 0, "decode_attention: window and softcap must be >= 0 (0: none)");
  at::Tensor out = at::empty(out_shape, q.options());
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (q.scalar_type() == at::kFloat) {
    const Operands<float> x{s, q.data_ptr<float>(), static_cast<const float*>(k), static_cast<const float*>(v),
                            out.data_ptr<float>()};
    dispatch_head_dim<float>(x, lens, fscale, window, cap);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "decode_attention: dtype must be float32 or bfloat16");
    using BF16 = c10::BFloat16;
    const Operands<BF16> x{s, q.data_ptr<BF16>(), static_cast<const BF16*>(k), static_cast<const BF16*>(v),
                           out.data_ptr<BF16>()};
    dispatch_head_dim<BF16>(x, lens, fscale, window, cap);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-d");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: K/V rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "decode_attention: shapes must be q [B, H_kv, G, D], k = v [B, H_kv, L, D]");
  const Strides s{q.size(0), 1, q.size(1), q.size(2), q.size(3), q.size(1) * q.size(2) * q.size(3), 0,
                  k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  return attend(q, k.data_ptr(), v.data_ptr(), s, k.size(2), seq_lens, scale, window, softcap, q.sizes());
}

// Copies row i of src [B, H_kv, D] (row i = token i / H_kv, head i % H_kv) to row rows[i] of cache [N, D].
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* rows, const char* name) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && src.scalar_type() == cache.scalar_type() &&
              src.size(2) == cache.size(-1), "cached_decode_attention: ", name,
              " must be [B, H_kv, D] rows of the cache's dtype and head size, contiguous within a row");
  const int64_t H = src.size(1), D = src.size(2), n = cache.numel() / D, bytes = D * src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* cp = static_cast<char*>(cache.data_ptr());
  for (int64_t i = 0; i < src.size(0) * H; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < n, "cached_decode_attention: row ", rows[i], " out of range 0..", n - 1);
    const char* from = sp + ((i / H) * src.stride(0) + (i % H) * src.stride(1)) * src.element_size();
    std::memcpy(cp + rows[i] * bytes, from, bytes);
  }
}

// No view ops between the write and the kernel: the layer's slots are pointer offsets into the contiguous caches.
at::Tensor cached_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                   at::Tensor v_cache, const at::Tensor& rows, const at::Tensor& seq_lens,
                                   int64_t layer, int64_t first_slot, int64_t max_len, double scale, int64_t window,
                                   double softcap) {
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.is_contiguous(), "cached_decode_attention: the caches must be contiguous [L, S, H_kv, S_max, D]");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(1) == k_cache.size(2) &&
              v.sizes() == k.sizes() && q.size(1) % k.size(1) == 0,
              "cached_decode_attention: q must be [T, H, D] and k, v [T, H_kv, D]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) >= 1 && q.size(0) % seq_lens.size(0) == 0,
              "cached_decode_attention: seq_lens must be [B], the same number of tokens T / B per sequence");
  const int64_t T = q.size(0), B = seq_lens.size(0), H = q.size(1), D = q.size(2), H_kv = k.size(1);
  const int64_t S_max = k_cache.size(3);
  TORCH_CHECK(layer >= 0 && layer < k_cache.size(0) && first_slot >= 0 && first_slot + B <= k_cache.size(1) &&
              max_len >= 1 && max_len <= S_max, "cached_decode_attention: layer, slots or max_len out of range");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == k_cache.size(0) &&
              rows.size(1) == T * H_kv && rows.stride(1) == 1, "cached_decode_attention: rows must be int64 [L, T * H_kv]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.size(2) == k_cache.size(4),
              "cached_decode_attention: q must have the cache's dtype and head size");
  const int64_t* layer_rows = rows.data_ptr<int64_t>() + layer * rows.stride(0);
  write_rows(k, k_cache, layer_rows, "k");
  write_rows(v, v_cache, layer_rows, "v");
  // a token's query heads in a row (a view of the fused Q/K/V output is): the kernel reads a group's as its rows
  const at::Tensor qs = q.stride(2) == 1 && q.stride(1) == D ? q : q.contiguous();
  const int64_t slot = H_kv * S_max * D, first = (layer * k_cache.size(1) + first_slot) * slot, R = T / B;
  const Strides s{B, R, H_kv, H / H_kv, D, R * qs.stride(0), qs.stride(0), slot, S_max * D, D, slot, S_max * D, D};
  return attend(qs, static_cast<const char*>(k_cache.data_ptr()) + first * k_cache.element_size(),
                static_cast<const char*>(v_cache.data_ptr()) + first * v_cache.element_size(), s, max_len, seq_lens,
                scale, window, softcap, {T, H, D});
}

}  // namespace

// The entry of decode_attention.h: the same row copies and kernel as cached_decode_attention, on checked pointers.
namespace kvcore_attn {

void check_shape(int64_t R, int64_t H, int64_t H_kv, int64_t D) {
  TORCH_CHECK(H_kv >= 1 && H % H_kv == 0 && H / H_kv <= kMaxGroup,
              "cached_decode_attention: H must be a multiple of H_kv, at most 16 query heads per KV head");
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, "decode_attention: head_dim must be 1..256");
  TORCH_CHECK(R >= 1 && R <= kMaxRows, "cached_decode_attention: 1..16 query tokens per sequence");
}

template <typename E>
void cached_attention(const CachedCall<E>& c) {
  const int64_t T = c.B * c.R, D = c.D, bytes = D * int64_t(sizeof(E));
  for (int64_t i = 0; i < T * c.H_kv; ++i) {
    const int64_t from = (i / c.H_kv) * c.kv_ld + (i % c.H_kv) * D;
    std::memcpy(c.k_cache + c.rows[i] * D, c.k + from, bytes);
    std::memcpy(c.v_cache + c.rows[i] * D, c.v + from, bytes);
  }
  const int64_t slot = c.H_kv * c.S_max * D;
  const Strides s{c.B, c.R, c.H_kv, c.H / c.H_kv, D, c.R * c.q_ld, c.q_ld, slot, c.S_max * D, D, slot,
                  c.S_max * D, D};
  const Operands<E> x{s, c.q, c.k_cache + c.slot_offset, c.v_cache + c.slot_offset, c.out};
  dispatch_head_dim<E>(x, c.seq_lens, c.scale, c.window, c.softcap);
}

template void cached_attention<c10::BFloat16>(const CachedCall<c10::BFloat16>&);
template void cached_attention<float>(const CachedCall<float>&);

}  // namespace kvcore_attn

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor seq_lens, float scale, int window=0, "
        "float softcap=0.0) -> Tensor");
  m.def("cached_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, "
        "Tensor seq_lens, int layer, int first_slot, int max_len, float scale, int window=0, float softcap=0.0) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("cached_decode_attention", &cached_decode_attention);
}
