// Activations quantized per row and group of G columns to int8 (a = max|x| / 127, p = round(x / a)), as llama.cpp
// does with its Q8 blocks, with the exact float sum of each group: what int4_linear.cpp and int8_group_linear.cpp
// feed to vpdpbusd.
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
#endif

// Rows x[M, K] -> codes p[M, K], scales a[M, K / G] and sums sx[M, K / G]; G is 16 or 32.
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
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // cvtps rounds to nearest even, as nearbyint does below
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
      if (G == 32)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
#else
      float v[G], amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < G; ++i) {
        v[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t i = 0; i < G; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
#endif
      a[r * groups + g] = amax / 127.f;
      sx[r * groups + g] = sum;
    }
  }
}

}  // namespace kvcore_a8
