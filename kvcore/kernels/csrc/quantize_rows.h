// Activations quantized per row and group of G columns to int8 (a = max|x| / 127, p = round(x / a)), as llama.cpp
// does with its Q8 blocks, with the sum of each group's quantized values, a * sum(p) (Q8_1's s): what
// int4_linear.cpp and int8_group_linear.cpp feed to vpdpbusd (or, on AVX2, to vpmaddubsw). |p| <= 127: the AVX2
// products rely on it.
//
// Why the quantized sum and not the exact one: the weights' codes are unsigned (q in 0..15 or 0..255, W = d q + m
// with m near -8 d or -128 d), so d * a * sum(q p) carries the rounding errors of p times q's large mean. m * a *
// sum(p) takes that part back out; m * sum(x) would leave it in (several times the error on real activations).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "isa.h"

namespace kvcore_a8 {

#ifdef KVCORE_VNNI
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const c10::BFloat16* src) {  // bfloat16 is the top half of a float32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#elif defined(KVCORE_AVX2_DOT)
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const c10::BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline float reduce_max(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline float reduce_add(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// One group of G (16 or 32) values to int8 codes in dst; returns max |x| and sets the sum of the codes.
template <int64_t G, typename T>
float quantize_group(const T* src, int8_t* dst, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int64_t i = 0; i < 4; ++i) v[i] = i < G / 8 ? load8(src + 8 * i) : _mm256_setzero_ps();
  const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  const float amax = reduce_max(amax8);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];  // cvtps rounds to nearest even, as the portable loop's nearbyint does
  for (int64_t i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // |p| <= 127: the integer sum is exact, and so is its float
  *sum = reduce_add(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
  // the packs interleave the 128-bit lanes: dwords 0 4 1 5 2 6 3 7 restore the order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (G == 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(ordered));
  return amax;
}
#endif

// Rows x[M, K] -> codes p[M, K], scales a[M, K / G] and sums sx[M, K / G] = a * sum(p); G is 16 or 32.
template <int64_t G, typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* p, float* a, float* sx) {
  static_assert(G == 16 || G == 32);
  const int64_t groups = K / G;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = x + r * K + g * G;
      int8_t* dst = p + (r * groups + g) * G;
#ifdef KVCORE_VNNI
      const __m512 v0 = load16(src), v1 = G == 32 ? load16(src + 16) : _mm512_setzero_ps();
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // cvtps rounds to nearest even, as nearbyint does below
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      const float sum = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
      if (G == 32) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
#elif defined(KVCORE_AVX2_DOT)
      float sum;
      const float amax = quantize_group<G>(src, dst, &sum);
#else
      float v[G], amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < G; ++i) {
        v[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t i = 0; i < G; ++i) {
        dst[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        sum += dst[i];
      }
#endif
      a[r * groups + g] = amax / 127.f;
      sx[r * groups + g] = amax / 127.f * sum;
    }
  }
}

}  // namespace kvcore_a8
