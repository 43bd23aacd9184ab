// kvcore::cached_decode_attention's two steps (decode_attention.cpp documents them) on raw rows of T (bfloat16 or
// float32), for
// callers that run many layers in one operator (decode_stack.cpp) and check their arguments once per call.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace kvcore_attn {

// One layer's call for T = B * R tokens, R per sequence (sequence b on cache slot first_slot + b). Token t's
// query heads are the H rows of D at q + t * q_ld, its K/V heads the H_kv rows at k + t * kv_ld, v + t * kv_ld.
template <typename T>
struct CachedCall {
  const T *q, *k, *v;
  int64_t q_ld, kv_ld;
  int64_t B, R, H, H_kv, D;
  const int64_t* rows;      // [T * H_kv] the layer's cache rows (k_cache viewed as [-1, D]), in range
  const int32_t* seq_lens;  // [B] in R .. max_len
  T *k_cache, *v_cache;  // contiguous [L, S, H_kv, S_max, D]
  int64_t slot_offset;      // elements before (layer, first_slot) in the caches
  int64_t S_max, max_len;
  float scale;
  int64_t window;
  float softcap;
  T* out;  // [T, H, D] contiguous
};

// The limits the kernel takes (cached_decode_attention's messages): H a multiple of H_kv with at most 16 query
// heads per KV head, 1 <= D <= 256, 1 <= R <= 16.
void check_shape(int64_t R, int64_t H, int64_t H_kv, int64_t D);

// Writes the tokens' K/V rows into the caches, then attends as cached_decode_attention does.
// Instantiated for bfloat16 and float32.
template <typename T>
void cached_attention(const CachedCall<T>& call);

}  // namespace kvcore_attn
