// The int4a8 matmul y = x @ W.T (W in 4-bit groups of 32 input columns, activations quantized per row and group of
// 32 to int8) as a function: what kvcore::int4_linear runs (int4_linear.cpp documents the arithmetic and the packed
// layout) and what the fused decoder-layer operators (fused_layer.cpp) call between their other steps.
//
//   x       [M, K]                  float32 or bfloat16, K a multiple of 32
//   packed  [N / 16, K / 32, 256]   uint8
//   dm      [N / 16, K / 32, 2, 16] float16 or float32
//   out     [M, N]                  dtype of x, each value rounded once from its float32 sum
//
// With AVX512-VNNI (and AVX512BW) at build time the products are vpdpbusd's; on AVX2, vpmaddubsw's pair sums added
// in int16 and widened once per group by vpmaddwd (exact: see block_dot); otherwise plain loops (slow; tests).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "group_matmul.h"
#include "isa.h"

namespace kvcore_int4a8 {

constexpr int64_t kGroup = 32;
using kvcore_gm::kMaxM;
using kvcore_gm::kRows;
constexpr int64_t kAhead = kvcore_gm::kPrefetchBytes / 256;  // groups of codes (256 bytes) prefetched ahead
#ifdef KVCORE_AVX2_DOT
constexpr int64_t kAvx2Tile = 4;  // rows per pass over a block's codes (benchmarks/micro/group_matmul_kernel.py)
#endif

#ifdef KVCORE_VNNI
inline __m512 load_scales(const c10::Half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m512 load_scales(const float* src) { return _mm512_loadu_ps(src); }
#elif defined(KVCORE_AVX2_DOT)
inline __m256 load_scales8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
inline __m256 load_scales8(const float* src) { return _mm256_loadu_ps(src); }
#endif

// Output block nb (16 rows) for all M rows into out_f[M][16]. M is a template parameter so that the M
// accumulators stay in registers and the M dot-product chains interleave (one chain would wait on
// vpdpbusd's latency).
template <int64_t M, typename S>
void block_dot(const uint8_t* packed, const S* dm, const int8_t* p, const float* a, const float* sx,
               int64_t G, float* out_f) {
#ifdef KVCORE_VNNI
  __m512 acc[M];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = packed + g * 256;
    // codes and scales ahead (past the block's end: the next block's, which the same thread reads next, or harmless)
    for (int64_t line = 0; line < 256; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * 256 + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dm + (g + kAhead) * 32), _MM_HINT_T0);
    __m512i s[M];
    for (int64_t r = 0; r < M; ++r) s[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 4; ++j) {  // codes unpacked as used: registers for the row accumulators instead
      const __m512i v = _mm512_loadu_si512(w + 64 * j);
      const __m512i lo = _mm512_and_si512(v, low);                       // codes 4j .. 4j+3 of every row
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // codes 16+4j .. 16+4j+3
      for (int64_t r = 0; r < M; ++r) {
        const int32_t* pr = reinterpret_cast<const int32_t*>(p + (r * G + g) * kGroup);
        s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(pr[j]));
        s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(pr[4 + j]));
      }
    }
    const __m512 d = load_scales(dm + g * 32), m = load_scales(dm + g * 32 + 16);
    for (int64_t r = 0; r < M; ++r) {
      const __m512 da = _mm512_mul_ps(d, _mm512_set1_ps(a[r * G + g]));
      acc[r] = _mm512_fmadd_ps(da, _mm512_cvtepi32_ps(s[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), acc[r]);
    }
  }
  for (int64_t r = 0; r < M; ++r) _mm512_storeu_ps(out_f + r * kRows, acc[r]);
#elif defined(KVCORE_AVX2_DOT)
  // Each row takes four ymm accumulators of the sixteen: more than kAvx2Tile rows go in tiles of that many, each tile
  // a pass over the block's codes (from L1 after the first), as spilling more accumulators to the stack costs more.
  if constexpr (M > kAvx2Tile) {
    block_dot<kAvx2Tile, S>(packed, dm, p, a, sx, G, out_f);
    block_dot<M - kAvx2Tile, S>(packed, dm, p + kAvx2Tile * G * kGroup, a + kAvx2Tile * G, sx + kAvx2Tile * G, G,
                                out_f + kAvx2Tile * kRows);
    return;
  }
  // Each 64-byte vector of codes is two halves, output rows 0-7 and 8-15. vpmaddubsw sums pairs of code x
  // activation products into int16 (at most 2 * 15 * 127), and the group's eight such sums per lane still fit
  // (8 * 3810 < 32767), so the group is added in int16 and widened to int32 once, by vpmaddwd with ones.
  __m256 acc[M][2];
  for (int64_t r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = packed + g * 256;
    for (int64_t line = 0; line < 256; line += 64)  // as above
      _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * 256 + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dm + (g + kAhead) * 32), _MM_HINT_T0);
    __m256i s[M][2];
    for (int64_t r = 0; r < M; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, the compiler hoists all eight code vectors' unpacking and spills the sums
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int64_t r = 0; r < M; ++r) {
          const int32_t* pr = reinterpret_cast<const int32_t*>(p + (r * G + g) * kGroup);
          s[r][h] = _mm256_add_epi16(s[r][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(pr[j])));
          s[r][h] = _mm256_add_epi16(s[r][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(pr[4 + j])));
        }
      }
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 d = load_scales8(dm + g * 32 + 8 * h), m = load_scales8(dm + g * 32 + 16 + 8 * h);
      for (int64_t r = 0; r < M; ++r) {
        const __m256 da = _mm256_mul_ps(d, _mm256_set1_ps(a[r * G + g]));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(da, dot, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * G + g]), acc[r][h]);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(out_f + r * kRows + 8 * h, acc[r][h]);
#else
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < kRows; ++n) out_f[r * kRows + n] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = packed + g * 256;
    for (int64_t n = 0; n < kRows; ++n) {
      int32_t codes[kGroup];
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t i = 0; i < 4; ++i) {
          const uint8_t byte = w[64 * j + 4 * n + i];
          codes[4 * j + i] = byte & 0x0F;
          codes[16 + 4 * j + i] = byte >> 4;
        }
      const float d = static_cast<float>(dm[g * 32 + n]), m = static_cast<float>(dm[g * 32 + 16 + n]);
      for (int64_t r = 0; r < M; ++r) {
        int32_t s = 0;
        for (int64_t k = 0; k < kGroup; ++k) s += codes[k] * p[(r * G + g) * kGroup + k];
        out_f[r * kRows + n] += d * a[r * G + g] * static_cast<float>(s) + m * sx[r * G + g];
      }
    }
  }
#endif
}

template <typename S>
using BlockDot = void (*)(const uint8_t*, const S*, const int8_t*, const float*, const float*, int64_t, float*);
template <typename S>
constexpr BlockDot<S> kBlockDots[kMaxM] = {block_dot<1, S>, block_dot<2, S>, block_dot<3, S>, block_dot<4, S>,
                                           block_dot<5, S>, block_dot<6, S>, block_dot<7, S>, block_dot<8, S>,
                                           block_dot<9, S>, block_dot<10, S>, block_dot<11, S>, block_dot<12, S>,
                                           block_dot<13, S>, block_dot<14, S>, block_dot<15, S>, block_dot<16, S>};

template <typename T, typename S>
void linear(const T* x, int64_t M, int64_t K, const uint8_t* wp, const S* sp, int64_t blocks, T* op) {
  const int64_t G = K / kGroup;
  kvcore_gm::drive<kGroup>(x, M, K, blocks, op, [&](int64_t rows, int64_t nb, const int8_t* p, const float* a,
                                                    const float* sx, float* block) {
    kBlockDots<S>[rows - 1](wp + nb * G * 256, sp + nb * G * 32, p, a, sx, G, block);
  });
}

// Checks a weight's tensors for inputs of K columns (``what`` names the operator and the weight in the message).
inline void check_weight(const at::Tensor& packed, const at::Tensor& dm, int64_t K, const char* what) {
  TORCH_CHECK(K % kGroup == 0, what, ": K must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
              packed.size(1) == K / kGroup && packed.size(2) == 256,
              what, ": packed must be uint8 [N / 16, K / 32, 256]");
  TORCH_CHECK((dm.scalar_type() == at::kHalf || dm.scalar_type() == at::kFloat) && dm.is_contiguous() &&
              dm.numel() == packed.size(0) * packed.size(1) * 32,
              what, ": dm must be float16 or float32 [N / 16, K / 32, 2, 16]");
}

// out [M, N] = x [M, K] @ W.T, the scales' dtype dispatched (check_weight first).
template <typename T>
void linear(const T* x, int64_t M, int64_t K, const at::Tensor& packed, const at::Tensor& dm, T* out) {
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (dm.scalar_type() == at::kHalf)
    linear<T, c10::Half>(x, M, K, wp, dm.data_ptr<c10::Half>(), packed.size(0), out);
  else
    linear<T, float>(x, M, K, wp, dm.data_ptr<float>(), packed.size(0), out);
}

}  // namespace kvcore_int4a8
