// The driver of kvcore's group-quantized matmuls y = x @ W.T (int4a8.h's 4-bit codes, int8_group_linear.cpp's 8-bit
// codes): W's output rows in blocks of 16, each block's codes group after group (G input columns per group), the
// activations quantized per row and group to int8 (quantize_rows.h). A kernel supplies the block product; this file
// quantizes the rows, splits the work over threads and rounds the outputs once.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "quantize_rows.h"

namespace kvcore_gm {

constexpr int64_t kRows = 16;  // output rows per block
constexpr int64_t kMaxM = 16;  // rows of one tile at decode (a template parameter of the block products)
constexpr int64_t kTileM = 8;  // rows per tile of a longer matmul: accumulators and codes fit in registers
// How far ahead of the group being read the block products prefetch, in bytes of codes: far enough that a line
// from L3 or memory arrives before it is used at batch 1, where nothing else hides the latency.
constexpr int64_t kPrefetchBytes = 4096;

// out [M, blocks * 16] = x [M, K] @ W.T. dot(rows, nb, p, a, sx, block) writes block nb's 16 outputs for ``rows``
// rows (codes p, scales a, sums sx of the first of them) into block[rows][16].
template <int64_t G, typename T, typename Dot>
void drive(const T* x, int64_t M, int64_t K, int64_t blocks, T* op, const Dot& dot) {
  const int64_t groups = K / G;
  // every element is written by quantize_rows before it is read
  std::unique_ptr<int8_t[]> p(new int8_t[M * K]);
  std::unique_ptr<float[]> a(new float[M * groups]), sx(new float[M * groups]);
  at::parallel_for(0, M, M > kMaxM ? 1 : M, [&](int64_t r0, int64_t r1) {
    kvcore_a8::quantize_rows<G, T>(x + r0 * K, r1 - r0, K, p.get() + r0 * K, a.get() + r0 * groups,
                                   sx.get() + r0 * groups);
  });
  // Up to 16 rows (decode): one tile of all rows, the work split over output blocks. More rows (prefill): tiles of
  // kTileM rows, items ordered tile-major so that each thread keeps its tile's activations in L1 and walks the
  // weights (small enough to stay in L2) once per tile.
  const int64_t tile_m = M <= kMaxM ? M : kTileM, tiles = (M + tile_m - 1) / tile_m;
  at::parallel_for(0, tiles * blocks, 1, [&](int64_t first, int64_t last) {
    float block[kMaxM * kRows];
    for (int64_t item = first; item < last; ++item) {
      const int64_t t = item / blocks, nb = item % blocks, r0 = t * tile_m, rows = std::min(tile_m, M - r0);
      dot(rows, nb, p.get() + r0 * K, a.get() + r0 * groups, sx.get() + r0 * groups, block);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < kRows; ++n)
          op[(r0 + r) * blocks * kRows + nb * kRows + n] = static_cast<T>(block[r * kRows + n]);
    }
  });
}

}  // namespace kvcore_gm
