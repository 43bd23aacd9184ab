// kvcore::int8_group_linear: y = x @ W.T, W as 8-bit codes in groups of G = 16 or 32 input columns with a float32
// scale and offset per group: W[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..255, g = k / G. llama.cpp's 5-, 6- and
// 8-bit blocks are exactly this (kvcore/loaders/gguf_codes.py): Q5_0 / Q5_1 / Q5_K / Q8_0 with G = 32, Q6_K with
// G = 16 (its sub-blocks), the K-quants' d being a float16 times an integer sub-scale (exact in float32).
//
// Activations are quantized per row and group of G to int8 (quantize_rows.h), so that vpdpbusd multiplies 16 rows'
// 4 consecutive codes by 4 activation codes per instruction. Per row r, output n and group g:
//
//   sum_k W[n, k] x[r, k] ~= d[n, g] * a[r, g] * sum_k q[n, k] p[r, k]  +  m[n, g] * a[r, g] * sum_k p[r, k]
//
// Float32 accumulation, output rounded once.
//
// Layout (kvcore.kernels.group_quant.pack_int8_groups packs it): output rows in blocks of 16, for each block and group
// 16 G bytes: byte 64 j + 4 row + i holds q[row, G g + 4 j + i] (j = 0 .. G / 4 - 1).
//
//   x       [M, K]                  float32 or bfloat16, K a multiple of G
//   packed  [N / 16, K / G, 16 G]   uint8
//   dm      [N / 16, K / G, 2, 16]  float32
//   returns [M, N]                  dtype of x
//
// Without AVX512-VNNI (and AVX512BW) at build time: on AVX2 the codes' two nibbles go through vpmaddubsw apart (a
// full byte times an int8 code could overflow its int16 pair sums), otherwise plain loops (slow; tests).

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "group_matmul.h"
#include "isa.h"

namespace {

using kvcore_gm::kMaxM;
using kvcore_gm::kRows;
#ifdef KVCORE_AVX2_DOT
constexpr int64_t kAvx2Tile = 4;  // rows per pass over a block's codes (benchmarks/micro/group_matmul_kernel.py)
#endif

// Output block (16 rows) for all M rows into out_f[M][16]; M a template parameter as in int4a8.h.
template <int64_t M, int64_t G>
void block_dot(const uint8_t* packed, const float* dm, const int8_t* p, const float* a, const float* sx,
               int64_t groups, float* out_f) {
  constexpr int64_t kBytes = kRows * G;
#ifdef KVCORE_VNNI
  __m512 acc[M];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = packed + g * kBytes;
    // codes and scales ahead, as in int4a8.h
    for (int64_t line = 0; line < kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kvcore_gm::kPrefetchBytes + line), _MM_HINT_T0);
    for (int64_t line = 0; line < 128; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(dm + (g + kvcore_gm::kPrefetchBytes / kBytes) * 32) + line,
                   _MM_HINT_T0);
    __m512i s[M];
    for (int64_t r = 0; r < M; ++r) s[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < G / 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + 64 * j);  // codes 4j .. 4j+3 of every row
      for (int64_t r = 0; r < M; ++r) {
        const int32_t* pr = reinterpret_cast<const int32_t*>(p + (r * groups + g) * G);
        s[r] = _mm512_dpbusd_epi32(s[r], v, _mm512_set1_epi32(pr[j]));
      }
    }
    const __m512 d = _mm512_loadu_ps(dm + g * 32), m = _mm512_loadu_ps(dm + g * 32 + 16);
    for (int64_t r = 0; r < M; ++r) {
      const __m512 da = _mm512_mul_ps(d, _mm512_set1_ps(a[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(da, _mm512_cvtepi32_ps(s[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
    }
  }
  for (int64_t r = 0; r < M; ++r) _mm512_storeu_ps(out_f + r * kRows, acc[r]);
#elif defined(KVCORE_AVX2_DOT)
  // Rows in tiles of kAvx2Tile, as in int4a8.h: more rows at once spill more of their accumulators (six ymm per
  // row) to the stack than re-reading the block's codes from L1 costs.
  if constexpr (M > kAvx2Tile) {
    block_dot<kAvx2Tile, G>(packed, dm, p, a, sx, groups, out_f);
    block_dot<M - kAvx2Tile, G>(packed, dm, p + kAvx2Tile * groups * G, a + kAvx2Tile * groups,
                                sx + kAvx2Tile * groups, groups, out_f + kAvx2Tile * kRows);
    return;
  }
  // q = lo + 16 hi with nibbles lo, hi: each nibble's G / 4 pair sums per int16 lane stay below 32767 (as in
  // int4a8.h), and vpmaddwd widens them, by ones and by sixteens, into the exact int32 dot product.
  __m256 acc[M][2];
  for (int64_t r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = packed + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64)  // as above
      _mm_prefetch(reinterpret_cast<const char*>(w + kvcore_gm::kPrefetchBytes + line), _MM_HINT_T0);
    for (int64_t line = 0; line < 128; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(dm + (g + kvcore_gm::kPrefetchBytes / kBytes) * 32) + line,
                   _MM_HINT_T0);
    __m256i lo_sum[M][2], hi_sum[M][2];
    for (int64_t r = 0; r < M; ++r)
      lo_sum[r][0] = lo_sum[r][1] = hi_sum[r][0] = hi_sum[r][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < G / 4; ++j)
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int64_t r = 0; r < M; ++r) {
          const __m256i pj = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(p + (r * groups + g) * G)[j]);
          lo_sum[r][h] = _mm256_add_epi16(lo_sum[r][h], _mm256_maddubs_epi16(lo, pj));
          hi_sum[r][h] = _mm256_add_epi16(hi_sum[r][h], _mm256_maddubs_epi16(hi, pj));
        }
      }
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 d = _mm256_loadu_ps(dm + g * 32 + 8 * h), m = _mm256_loadu_ps(dm + g * 32 + 16 + 8 * h);
      for (int64_t r = 0; r < M; ++r) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo_sum[r][h], ones),
                                             _mm256_madd_epi16(hi_sum[r][h], sixteens));
        const __m256 da = _mm256_mul_ps(d, _mm256_set1_ps(a[r * groups + g]));
        acc[r][h] = _mm256_fmadd_ps(da, _mm256_cvtepi32_ps(dot), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(out_f + r * kRows + 8 * h, acc[r][h]);
#else
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < kRows; ++n) out_f[r * kRows + n] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = packed + g * kBytes;
    for (int64_t n = 0; n < kRows; ++n) {
      const float d = dm[g * 32 + n], m = dm[g * 32 + 16 + n];
      for (int64_t r = 0; r < M; ++r) {
        int32_t s = 0;
        for (int64_t k = 0; k < G; ++k) s += w[64 * (k / 4) + 4 * n + k % 4] * p[(r * groups + g) * G + k];
        out_f[r * kRows + n] += d * a[r * groups + g] * static_cast<float>(s) + m * sx[r * groups + g];
      }
    }
  }
#endif
}

template <int64_t G>
using BlockDot = void (*)(const uint8_t*, const float*, const int8_t*, const float*, const float*, int64_t, float*);
template <int64_t G>
constexpr BlockDot<G> kBlockDots[kMaxM] = {block_dot<1, G>, block_dot<2, G>, block_dot<3, G>, block_dot<4, G>,
                                           block_dot<5, G>, block_dot<6, G>, block_dot<7, G>, block_dot<8, G>,
                                           block_dot<9, G>, block_dot<10, G>, block_dot<11, G>, block_dot<12, G>,
                                           block_dot<13, G>, block_dot<14, G>, block_dot<15, G>, block_dot<16, G>};

template <typename T, int64_t G>
at::Tensor int8_group_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / G, blocks = packed.size(0);
  at::Tensor out = at::empty({M, blocks * kRows}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = dm.data_ptr<float>();
  kvcore_gm::drive<G>(x.data_ptr<T>(), M, K, blocks, out.data_ptr<T>(),
                      [&](int64_t rows, int64_t nb, const int8_t* p, const float* a, const float* sx, float* block) {
                        kBlockDots<G>[rows - 1](wp + nb * groups * kRows * G, sp + nb * groups * 32, p, a, sx, groups,
                                                block);
                      });
  return out;
}

template <typename T>
at::Tensor by_group(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t G) {
  return G == 16 ? int8_group_linear_impl<T, 16>(x, packed, dm) : int8_group_linear_impl<T, 32>(x, packed, dm);
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1,
              "int8_group_linear: x must be a contiguous [M, K] matrix with rows");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
              (packed.size(2) == 16 * 16 || packed.size(2) == 16 * 32),
              "int8_group_linear: packed must be uint8 [N / 16, K / G, 16 G] with G 16 or 32");
  const int64_t G = packed.size(2) / kRows;
  TORCH_CHECK(x.size(1) % G == 0 && packed.size(1) == x.size(1) / G,
              "int8_group_linear: K must be a multiple of G and match packed");
  TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.numel() == packed.size(0) * packed.size(1) * 32,
              "int8_group_linear: dm must be float32 [N / 16, K / G, 2, 16]");
  if (x.scalar_type() == at::kFloat) return by_group<float>(x, packed, dm, G);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "int8_group_linear: x must be float32 or bfloat16");
  return by_group<c10::BFloat16>(x, packed, dm, G);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("int8_group_linear(Tensor x, Tensor packed, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("int8_group_linear", &int8_group_linear); }
