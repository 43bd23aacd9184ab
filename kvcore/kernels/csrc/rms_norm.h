// A residual add and RMSNorm over rows of T (bfloat16 or float32): kvcore::rms_norm (rms_norm.cpp documents the
// rounding) and the fused decoder-layer operators (fused_layer.cpp) run this one function, so their results agree bit
// for bit. In float32 the roundings to T are no-ops.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace kvcore_norm {

// h [T, d] (updated to h + delta when delta is not null), weight [d] -> out [T, d]
template <typename E>
inline void add_rms_norm(E* hp, const E* dp, const E* wp, int64_t T, int64_t d, float eps, E* op) {
  // a decode step's row is too short to share: rows run in parallel only for prefills
  at::parallel_for(0, T, T >= 16 ? 1 : T, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      E* row = hp + r * d;
      float ss = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        if (dp != nullptr) row[i] = E(static_cast<float>(row[i]) + static_cast<float>(dp[r * d + i]));
        const float v = static_cast<float>(row[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) {
        const float normed = static_cast<float>(E(static_cast<float>(row[i]) * inv));
        op[r * d + i] = E(normed * static_cast<float>(wp[i]));
      }
    }
  });
}

}  // namespace kvcore_norm
