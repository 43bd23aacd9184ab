// kvcore::bf16_linear: y = x @ W.T for the few rows of a decode step, bfloat16 weights and activations,
// float32 sums rounded once to bfloat16 (kvcore/linear.py uses it for dense bfloat16 weights of up to 128 rows).
//
// A decode step's matmuls are a stream over the weights: each weight is read once per step and used by a few
// rows. The weights are repacked so that one 64-byte load is the operand of one vdpbf16ps for every row:
// for each block of 16 output rows and each pair of input columns p, the 16 rows' pairs (W[n, 2p], W[n, 2p+1])
// in order; a row's x[2p], x[2p+1] broadcast as one 32-bit word is the other operand, and each float32 lane
// accumulates its output row's pair products. No horizontal sums, no per-call packing.
//
//   x       [M, K]                 bfloat16, contiguous, K a multiple of 32
//   packed  [N / 16, K / 2, 16, 2] bfloat16 (kvcore.linear.pack_bf16)
//   returns [M, N]                 bfloat16
//
// Built only where the compiler targets AVX512_BF16 (isa.h); built_with("avx512_bf16") says whether it was.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "isa.h"

namespace {

#ifdef KVCORE_BF16

constexpr int64_t kRows = 16;  // output rows per block
constexpr int64_t kMaxM = 16;

// Output block (16 rows) for all M rows of x. Each row keeps S independent accumulators (pairs p, p + 1, ...
// taken in turn) so that at least four vdpbf16ps chains are in flight whatever M is; summed at the end.
template <int64_t M>
void block_dot(const uint16_t* w, const uint32_t* xw, int64_t pairs, c10::BFloat16* out, int64_t out_stride) {
  constexpr int64_t S = M >= 4 ? 1 : 4 / M;
  __m512 acc[M][S];
  for (int64_t r = 0; r < M; ++r)
    for (int64_t s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += S) {
    for (int64_t s = 0; s < S; ++s) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (p + s + 64) * 32), _MM_HINT_T0);  // 4 KiB ahead (past the end: harmless)
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (p + s) * 32);
      for (int64_t r = 0; r < M; ++r)
        acc[r][s] = _mm512_dpbf16_ps(acc[r][s], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xw[r * pairs + p + s])), wv);
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    __m512 sum = acc[r][0];
    for (int64_t s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[r][s]);
    alignas(64) float lanes[kRows];
    _mm512_store_ps(lanes, sum);
    for (int64_t n = 0; n < kRows; ++n) out[r * out_stride + n] = c10::BFloat16(lanes[n]);
  }
}

using BlockDot = void (*)(const uint16_t*, const uint32_t*, int64_t, c10::BFloat16*, int64_t);
constexpr BlockDot kBlockDots[kMaxM] = {block_dot<1>, block_dot<2>, block_dot<3>, block_dot<4>,
                                        block_dot<5>, block_dot<6>, block_dot<7>, block_dot<8>,
                                        block_dot<9>, block_dot<10>, block_dot<11>, block_dot<12>,
                                        block_dot<13>, block_dot<14>, block_dot<15>, block_dot<16>};

#endif  // KVCORE_BF16

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed) {
#ifdef KVCORE_BF16
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: x and packed must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1, "bf16_linear: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.size(1) % 32 == 0, "bf16_linear: K must be a multiple of 32");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * 2 == x.size(1) &&
              packed.size(2) == kRows && packed.size(3) == 2, "bf16_linear: packed must be [N / 16, K / 2, 16, 2]");
  const int64_t M = x.size(0), pairs = x.size(1) / 2, blocks = packed.size(0), N = blocks * kRows;
  at::Tensor out = at::empty({M, N}, x.options());
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  // Up to 16 rows: one tile, the work split over output blocks. More rows: tiles of at most 16, as even as possible
  // (17 rows: 9 + 8, not 16 + 1, each tile being a pass over the weights), items ordered tile-major so that each
  // thread walks the weights once per tile with the tile's rows in L1.
  const int64_t tiles = (M + kMaxM - 1) / kMaxM, tile_m = (M + tiles - 1) / tiles;
  at::parallel_for(0, tiles * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t t = item / blocks, b = item % blocks, r0 = t * tile_m, rows = std::min(tile_m, M - r0);
      kBlockDots[rows - 1](wp + b * pairs * 32, xw + r0 * pairs, pairs, op + r0 * N + b * kRows, N);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: kvcore's CPU kernels were built without AVX512_BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("bf16_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
