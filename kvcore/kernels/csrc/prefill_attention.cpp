// kvcore::prefill_attention: causal attention of one sequence's new query rows over its cached keys, in
// bfloat16 on CPUs with AVX512_BF16 (vdpbf16ps: pairs of bfloat16 products summed into float32 lanes).
//
// Query row i sits at absolute position context_len + i and sees keys 0 .. context_len + i (the causal mask
// aligned bottom-right; context_len = 0 is a fresh prompt). Flash-attention blocking: for a tile of 4 query
// rows of one head, key blocks of 32 are scored (S = q K^T, float32), folded into a running max and sum per
// row (online softmax) and their probabilities, rounded to bfloat16 as GPU flash attention does, multiply the
// value block into float32 accumulators. Each KV head's keys and values are first repacked so that one
// 512-bit load feeds 16 lanes: keys as [block][dim pair][32 keys][2], values as [block][key pair][D][2].
//
//   q       [T, H, D]      bfloat16, rows contiguous (any row stride)
//   k, v    [H_kv, L, D]   bfloat16, rows contiguous, L = context_len + T
//   returns [T, H, D]      bfloat16
//
// Built only where the compiler targets AVX512_BF16 (kvcore/cpu_kernels.py); callers check
// built_with("avx512_bf16") (isa.cpp) and use torch's SDPA otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "isa.h"

namespace {

#ifdef KVCORE_BF16

constexpr int64_t kKeys = 32;  // keys per block
constexpr int64_t kRows = 4;   // query rows per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^y for y <= 0 (the scaled score minus the running max, in base 2): y = n + f with n an integer and
// |f| <= 1/2, 2^f by its degree-5 Taylor polynomial (relative error below 4e-6, far under the bfloat16
// rounding the probabilities then get), 2^n applied by vscalefps. Eight vector operations, a third of a general
// float32 exp; y below -126 (masked keys: -inf) is clamped there, giving ~1e-38 instead of 0, which no sum or
// bfloat16 product can tell apart.
inline __m512 exp2_16(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln(2)^k / k!, k = 5 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Keys of one KV head as [blocks][Dp / 2][32][2] and values as [blocks][16][Dp][2]; zero past L and D.
void pack_kv(const c10::BFloat16* k, const c10::BFloat16* v, int64_t row_stride_k, int64_t row_stride_v,
             int64_t L, int64_t D, int64_t Dp, uint16_t* kp, uint16_t* vp) {
  const int64_t blocks = (L + kKeys - 1) / kKeys;
  std::memset(kp, 0, blocks * Dp * kKeys * sizeof(uint16_t));
  std::memset(vp, 0, blocks * Dp * kKeys * sizeof(uint16_t));
  for (int64_t j = 0; j < L; ++j) {
    const uint16_t* kr = reinterpret_cast<const uint16_t*>(k + j * row_stride_k);
    const uint16_t* vr = reinterpret_cast<const uint16_t*>(v + j * row_stride_v);
    const int64_t b = j / kKeys, jj = j % kKeys;
    uint16_t* kb = kp + b * Dp * kKeys;
    uint16_t* vb = vp + b * Dp * kKeys;
    for (int64_t d = 0; d < D; ++d) {
      kb[((d / 2) * kKeys + jj) * 2 + d % 2] = kr[d];
      vb[((jj / 2) * Dp + d) * 2 + jj % 2] = vr[d];
    }
  }
}

// One tile of R query rows (R <= 4) of one head against packed keys/values; NV = Dp / 16 output vectors.
template <int64_t R, int64_t NV>
void tile(const c10::BFloat16* const* qrows, const int64_t* pos, const uint16_t* kp, const uint16_t* vp,
          int64_t D, float scale, c10::BFloat16* const* orows) {
  constexpr int64_t Dp = NV * 16;
  const float scale2 = scale * 1.44269504f;  // exp(scale x) = 2^(scale log2(e) x)
  __m512 o[R][NV];
  __m512 l[R];  // running softmax denominators, lane-wise (summed once at the end)
  float m[R];
  _Pragma("GCC unroll 4")
  for (int64_t r = 0; r < R; ++r) {
    _Pragma("GCC unroll 16")
    for (int64_t i = 0; i < NV; ++i) o[r][i] = _mm512_setzero_ps();
    m[r] = kNegInf;
    l[r] = _mm512_setzero_ps();
  }
  // query rows as 32-bit words (pairs of dims), zero past D
  alignas(64) uint32_t qw[R][Dp / 2];
  _Pragma("GCC unroll 4")
  for (int64_t r = 0; r < R; ++r) {
    std::memset(qw[r], 0, sizeof(qw[r]));
    std::memcpy(qw[r], qrows[r], D * sizeof(c10::BFloat16));
  }
  const int64_t last_key = pos[R - 1];  // rows are in position order
  const int64_t blocks = last_key / kKeys + 1;
  alignas(64) uint32_t pw[R][kKeys / 2];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* kb = kp + b * Dp * kKeys;
    const uint16_t* vb = vp + b * Dp * kKeys;
    __m512 s[R][2];
    _Pragma("GCC unroll 4")
    for (int64_t r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < Dp / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kKeys * 2);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * kKeys * 2 + 32);
      _Pragma("GCC unroll 4")
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(qw[r][p]);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], a, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], a, k1);
      }
    }
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _Pragma("GCC unroll 4")
    for (int64_t r = 0; r < R; ++r) {
      __m512 x0 = s[r][0], x1 = s[r][1];  // unscaled: the scale (> 0) is applied inside the exponent
      if ((b + 1) * kKeys - 1 > pos[r]) {  // the block reaches past this row's position: mask those keys
        const __m512i key0 = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(b * kKeys)));
        const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
        const __m512i row = _mm512_set1_epi32(static_cast<int32_t>(pos[r]));
        x0 = _mm512_mask_mov_ps(x0, _mm512_cmpgt_epi32_mask(key0, row), _mm512_set1_ps(kNegInf));
        x1 = _mm512_mask_mov_ps(x1, _mm512_cmpgt_epi32_mask(key1, row), _mm512_set1_ps(kNegInf));
      }
      const __m512 top = _mm512_max_ps(x0, x1);
      // the running max moved (rare after the first blocks; one compare tells): rescale what was accumulated
      if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m[r]), _CMP_GT_OQ)) {
        const float block_max = _mm512_reduce_max_ps(top);
        const __m512 c = _mm512_set1_ps(std::exp((m[r] - block_max) * scale));  // 0 for the first block (m = -inf)
        l[r] = _mm512_mul_ps(l[r], c);
        _Pragma("GCC unroll 16")
        for (int64_t i = 0; i < NV; ++i) o[r][i] = _mm512_mul_ps(o[r][i], c);
        m[r] = block_max;
      }
      const __m512 shift = _mm512_set1_ps(-m[r] * scale2);  // m is finite: key 0 is always visible
      const __m512 e0 = exp2_16(_mm512_fmadd_ps(x0, _mm512_set1_ps(scale2), shift));  // exp(scale (s - m))
      const __m512 e1 = exp2_16(_mm512_fmadd_ps(x1, _mm512_set1_ps(scale2), shift));
      l[r] = _mm512_add_ps(l[r], _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));  // keys 0..31 as bfloat16 pairs
    }
    for (int64_t kp2 = 0; kp2 < kKeys / 2; ++kp2) {
      __m512bh vv[NV];
      _Pragma("GCC unroll 16")
      for (int64_t i = 0; i < NV; ++i) vv[i] = (__m512bh)_mm512_loadu_si512(vb + (kp2 * Dp + i * 16) * 2);
      _Pragma("GCC unroll 4")
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pw[r][kp2]);
        _Pragma("GCC unroll 16")
        for (int64_t i = 0; i < NV; ++i) o[r][i] = _mm512_dpbf16_ps(o[r][i], a, vv[i]);
      }
    }
  }
  _Pragma("GCC unroll 4")
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) float out[Dp];
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    _Pragma("GCC unroll 16")
    for (int64_t i = 0; i < NV; ++i) _mm512_storeu_ps(out + i * 16, _mm512_mul_ps(o[r][i], inv));
    for (int64_t d = 0; d < D; ++d) orows[r][d] = c10::BFloat16(out[d]);
  }
}

template <int64_t NV>
void run_tile(int64_t rows, const c10::BFloat16* const* q, const int64_t* pos, const uint16_t* kp,
              const uint16_t* vp, int64_t D, float scale, c10::BFloat16* const* o) {
  switch (rows) {
    case 1: return tile<1, NV>(q, pos, kp, vp, D, scale, o);
    case 2: return tile<2, NV>(q, pos, kp, vp, D, scale, o);
    case 3: return tile<3, NV>(q, pos, kp, vp, D, scale, o);
    default: return tile<4, NV>(q, pos, kp, vp, D, scale, o);
  }
}

template <int64_t NV>
void prefill_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t context_len, float scale,
                  at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0), L = k.size(1), G = H / Hkv;
  constexpr int64_t Dp = NV * 16;
  const int64_t blocks = (L + kKeys - 1) / kKeys, per_head = blocks * Dp * kKeys;
  std::unique_ptr<uint16_t[]> kp_buf(new uint16_t[Hkv * per_head]), vp_buf(new uint16_t[Hkv * per_head]);
  uint16_t* kp = kp_buf.get();  // pack_kv writes every element, zero padding included
  uint16_t* vp = vp_buf.get();
  const c10::BFloat16* qd = q.data_ptr<c10::BFloat16>();
  const c10::BFloat16* kd = k.data_ptr<c10::BFloat16>();
  const c10::BFloat16* vd = v.data_ptr<c10::BFloat16>();
  c10::BFloat16* od = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      pack_kv(kd + h * k.stride(0), vd + h * v.stride(0), k.stride(1), v.stride(1), L, D, Dp,
              kp + h * per_head, vp + h * per_head);
  });
  // Work items (KV head, tile of 4 rows, query head of its group), in that order: consecutive items read the
  // same packed keys and values while they are in cache. Later tiles see more keys, so tiles are taken
  // alternately from both ends of the prompt and each thread's contiguous range mixes cheap and costly ones.
  const int64_t tiles = (T + kRows - 1) / kRows;
  at::parallel_for(0, H * tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t hk = item / (G * tiles), n = (item / G) % tiles, h = hk * G + item % G;
      const int64_t t = n % 2 == 0 ? n / 2 : tiles - 1 - n / 2;
      const int64_t row0 = t * kRows, rows = std::min(kRows, T - row0);
      const c10::BFloat16* qrows[kRows];
      c10::BFloat16* orows[kRows];
      int64_t pos[kRows];
      for (int64_t r = 0; r < rows; ++r) {
        qrows[r] = qd + (row0 + r) * q.stride(0) + h * q.stride(1);
        orows[r] = od + (row0 + r) * out.stride(0) + h * out.stride(1);
        pos[r] = context_len + row0 + r;
      }
      run_tile<NV>(rows, qrows, pos, kp + hk * per_head, vp + hk * per_head, D, scale, orows);
    }
  });
}

#endif  // KVCORE_BF16

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t context_len,
                             double scale) {
#ifdef KVCORE_BF16
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q [T, H, D], k/v [H_kv, L, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "prefill_attention: bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: rows must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(1) % k.size(0) == 0,
              "prefill_attention: shapes must be q [T, H, D], k = v [H_kv, L, D] with H a multiple of H_kv");
  TORCH_CHECK(context_len >= 0 && k.size(1) == context_len + q.size(0), "prefill_attention: L must be context_len + T");
  TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= 256, "prefill_attention: head_dim must be 1..256");
  TORCH_CHECK(scale > 0, "prefill_attention: scale must be positive");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t nv = (q.size(2) + 15) / 16;
  const float s = static_cast<float>(scale);
  if (nv <= 2) prefill_impl<2>(q, k, v, context_len, s, out);
  else if (nv <= 4) prefill_impl<4>(q, k, v, context_len, s, out);
  else if (nv <= 8) prefill_impl<8>(q, k, v, context_len, s, out);
  else prefill_impl<16>(q, k, v, context_len, s, out);
  return out;
#else
  TORCH_CHECK(false, "prefill_attention: kvcore's CPU kernels were built without AVX512_BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int context_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
