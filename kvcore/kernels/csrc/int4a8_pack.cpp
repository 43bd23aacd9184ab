// int4a8 weights (the layout int4_linear.cpp reads: per block of 16 rows and group of 32 columns, byte 64 j + 4 r + i
// holds codes 4 j + i (low nibble) and 16 + 4 j + i (high) of row r, then d and m of the 16 rows as float16) made
// in one pass. Both run over a whole model's weights the first time its file is prepared, so they go at memory
// speed.
//
// kvcore::q4_blocks_to_int4a8: GGUF Q4_0 / Q4_1 blocks rewritten in that layout, nothing decoded. A block's byte i
// holds codes i and 16 + i, the pair the layout's byte 64 j + 4 r + i' holds for i = 4 j + i': so each block's 16
// code bytes move as four 4-byte words, and its float16 d (and Q4_1's m) go beside those of the other 15 rows.
// Q4_0's offset is -8 d, exact in float16 unless it overflows.
//
//   blocks   [rows, cols / 32 * (S + 16)]  uint8, contiguous: per block the float16 d (S = 2, Q4_0) or d and m
//                                          (S = 4, Q4_1), then 16 code bytes
//   q4_1                                   whether the blocks are Q4_1 (else Q4_0)
//   codes    [rows / 16, cols / 32, 256]   uint8, contiguous: written
//   dm       [rows / 16, cols / 32, 2, 16] float16, contiguous: written (d, then m, per row)
//   returns  whether every block fit; false (codes and dm then partly written) when a Q4_0 -8 d has no float16
//            value (the caller packs such a weight another way)
//
// kvcore::int4a8_quantize: float rows quantized to 4 bits and packed, bit for bit what Int4Groups.from_float then
// pack_int4a8 make (kvcore/kernels/quant.py): per group of 32, s = max((hi - lo) / 15, 1e-12) and z = lo + 8 s, each
// rounded to the rows' dtype, q = clamp(round_half_even((w - z) / s) + 8, 0, 15), every step one float32 operation
// as torch does it; then d = s and m = z - 8 s in float16.
//
//   w        [rows, cols]                  float32, bfloat16 or float16, contiguous; rows a multiple of 16, cols of 32
//   codes    [rows / 16, cols / 32, 256]   uint8, contiguous: written
//   dm       [rows / 16, cols / 32, 2, 16] float16, contiguous: written

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;  // columns per group
constexpr int64_t kRows = 16;   // rows per block of the layout

void check_outputs(const char* op, const at::Tensor& codes, const at::Tensor& dm) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == 256 && codes.is_contiguous(),
              op, ": codes must be contiguous uint8 [rows / 16, cols / 32, 256]");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.dim() == 4 && dm.size(0) == codes.size(0) &&
              dm.size(1) == codes.size(1) && dm.size(2) == 2 && dm.size(3) == kRows,
              op, ": dm must be contiguous float16 [rows / 16, cols / 32, 2, 16]");
}

// Calls row(b, g, r, packed, d_out) for row r of every block (b: 16 rows, g: 32 columns) of the layout, blocks of rows
// split over threads: packed is the block's 256 code bytes, d_out its 32 float16 (d of the 16 rows, then m).
template <typename Row>
void for_each_block_row(int64_t row_blocks, int64_t groups, uint8_t* codes, c10::Half* dm, const Row& row) {
  at::parallel_for(0, row_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* packed = codes + (b * groups + g) * 256;
        c10::Half* d_out = dm + (b * groups + g) * 2 * kRows;
        for (int64_t r = 0; r < kRows; ++r) row(b, g, r, packed, d_out);
      }
    }
  });
}

bool q4_blocks_to_int4a8(const at::Tensor& blocks, bool q4_1, const at::Tensor& codes, const at::Tensor& dm) {
  const int64_t scale_bytes = q4_1 ? 4 : 2, block_bytes = scale_bytes + 16;
  check_outputs("q4_blocks_to_int4a8", codes, dm);
  const int64_t row_blocks = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(0) == row_blocks * kRows && blocks.size(1) == groups * block_bytes,
              "q4_blocks_to_int4a8: blocks must be contiguous uint8 [rows, cols / 32 * block bytes] matching codes");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  c10::Half* scales = dm.data_ptr<c10::Half>();
  const int64_t row_bytes = groups * block_bytes;
  std::atomic<bool> fits{true};
  for_each_block_row(row_blocks, groups, out, scales, [&](int64_t b, int64_t g, int64_t r, uint8_t* packed,
                                                          c10::Half* d_out) {
    const uint8_t* block = src + (b * kRows + r) * row_bytes + g * block_bytes;
    for (int64_t j = 0; j < 4; ++j) std::memcpy(packed + 64 * j + 4 * r, block + scale_bytes + 4 * j, 4);
    c10::Half d, m;
    std::memcpy(&d, block, 2);  // unaligned: blocks are 18 or 20 bytes
    if (q4_1) {
      std::memcpy(&m, block + 2, 2);
    } else {
      const float offset = -8.0f * static_cast<float>(d);
      m = c10::Half(offset);
      if (static_cast<float>(m) != offset) fits.store(false, std::memory_order_relaxed);
    }
    d_out[r] = d;
    d_out[kRows + r] = m;
  });
  return fits.load();
}

// x rounded to T (to nearest, ties to even, as torch's casts round) and back
template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float rounded<float>(float x) {
  return x;
}

template <typename T>
void quantize(const T* w, int64_t row_blocks, int64_t groups, uint8_t* codes, c10::Half* dm) {
  using Vec = at::vec::Vectorized<float>;
  static_assert(kGroup % Vec::size() == 0, "a group is whole vectors");
  const int64_t cols = groups * kGroup;
  for_each_block_row(row_blocks, groups, codes, dm, [&](int64_t b, int64_t gi, int64_t r, uint8_t* packed,
                                                       c10::Half* d_out) {
    float g[kGroup], qf[kGroup];
    const T* src = w + (b * kRows + r) * cols + gi * kGroup;
    for (int64_t i = 0; i < kGroup; ++i) g[i] = static_cast<float>(src[i]);
    Vec lo_v = Vec::loadu(g), hi_v = lo_v;
    for (int64_t i = Vec::size(); i < kGroup; i += Vec::size()) {
      lo_v = at::vec::minimum(lo_v, Vec::loadu(g + i));
      hi_v = at::vec::maximum(hi_v, Vec::loadu(g + i));
    }
    const float lo = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return at::vec::minimum(a, c); }, lo_v);
    const float hi = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return at::vec::maximum(a, c); }, hi_v);
    const float s = rounded<T>(std::max((hi - lo) / 15.0f, 1e-12f));
    const float z = rounded<T>(lo + 8.0f * s);
    for (int64_t i = 0; i < kGroup; i += Vec::size()) {
      // round(): to nearest, ties to even, as torch.round
      const Vec v = ((Vec::loadu(g + i) - Vec(z)) / Vec(s)).round() + Vec(8.0f);
      at::vec::clamp(v, Vec(0.0f), Vec(15.0f)).store(qf + i);
    }
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t i = 0; i < 4; ++i)
        packed[64 * j + 4 * r + i] = static_cast<uint8_t>(static_cast<uint8_t>(qf[4 * j + i]) |
                                                          (static_cast<uint8_t>(qf[16 + 4 * j + i]) << 4));
    d_out[r] = c10::Half(s);
    d_out[kRows + r] = c10::Half(z - 8.0f * s);
  });
}

void int4a8_quantize(const at::Tensor& w, const at::Tensor& codes, const at::Tensor& dm) {
  check_outputs("int4a8_quantize", codes, dm);
  const int64_t row_blocks = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == row_blocks * kRows && w.size(1) == groups * kGroup,
              "int4a8_quantize: w must be contiguous [rows, cols] matching codes");
  uint8_t* out = codes.data_ptr<uint8_t>();
  c10::Half* scales = dm.data_ptr<c10::Half>();
  switch (w.scalar_type()) {
    case at::kFloat: quantize(w.data_ptr<float>(), row_blocks, groups, out, scales); break;
    case at::kBFloat16: quantize(w.data_ptr<c10::BFloat16>(), row_blocks, groups, out, scales); break;
    case at::kHalf: quantize(w.data_ptr<c10::Half>(), row_blocks, groups, out, scales); break;
    default: TORCH_CHECK(false, "int4a8_quantize: w must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("q4_blocks_to_int4a8(Tensor blocks, bool q4_1, Tensor(a!) codes, Tensor(b!) dm) -> bool");
  m.def("int4a8_quantize(Tensor w, Tensor(a!) codes, Tensor(b!) dm) -> ()");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("q4_blocks_to_int4a8", &q4_blocks_to_int4a8);
  m.impl("int4a8_quantize", &int4a8_quantize);
}
