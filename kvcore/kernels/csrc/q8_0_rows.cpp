// kvcore::q8_0_rows: rows of a GGUF Q8_0 tensor (a llama.cpp file's usual token table) decoded in one call.
//
// The eager decode (kvcore/loaders/gguf_blocks.py) takes half a dozen ops per lookup (views, two casts, a product,
// a cast), several times the arithmetic of the one to hundred rows a decode step reads (its token's embedding, the
// int4 head's rescored candidates). The values are the same: d * q is exact in float32 (an 11-bit scale times an
// 8-bit code), rounded once to the output dtype as torch rounds it (to nearest, ties to even).
//
//   blocks   [n, columns / 32 * 34]  uint8, contiguous: per block of 32 columns a float16 scale d, then 32 int8 codes
//   columns                          a multiple of 32
//   dtype                            float32, bfloat16 or float16
//   returns  [n, columns]            dtype
//
// kvcore::q8_0_kept_rows: the same decode of rows a FileRows table has kept (kvcore/loaders/file_rows.py), gathered
// from its cache in the same call: a decode step's lookups (its token, the head's candidates) are mostly rows
// earlier steps read, and the NumPy gather before q8_0_rows cost more than the decode.
//
//   kept     [C, columns / 32 * 34]  uint8, contiguous: the kept rows
//   slot_of  [rows]                  int32: each table row's place in kept, -1 where it is not kept
//   index    [n]                     int64 table rows (any shape, read in order)
//   returns  [n, columns]            dtype, or [0, columns] when some row is outside [0, rows) or not kept (the
//                                    caller then reads the rows itself)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockBytes = 2 + kGroup;

template <typename T>
void decode(const uint8_t* src, int64_t n, int64_t columns, T* out) {
  const int64_t blocks = columns / kGroup;
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = src + r * blocks * kBlockBytes;
      T* o = out + r * columns;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = row + b * kBlockBytes;
        c10::Half d;
        std::memcpy(&d, block, 2);  // unaligned: the blocks are packed at 34 bytes
        const float scale = static_cast<float>(d);
        const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
        for (int64_t i = 0; i < kGroup; ++i) o[b * kGroup + i] = static_cast<T>(scale * static_cast<float>(q[i]));
      }
    }
  });
}

at::Tensor q8_0_rows(const at::Tensor& blocks, int64_t columns, at::ScalarType dtype) {
  TORCH_CHECK(columns > 0 && columns % kGroup == 0, "q8_0_rows: columns must be a positive multiple of 32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) == columns / kGroup * kBlockBytes,
              "q8_0_rows: blocks must be contiguous uint8 [n, columns / 32 * 34]");
  at::Tensor out = at::empty({blocks.size(0), columns}, blocks.options().dtype(dtype));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t n = blocks.size(0);
  switch (dtype) {
    case at::kFloat: decode(src, n, columns, out.data_ptr<float>()); break;
    case at::kBFloat16: decode(src, n, columns, out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: decode(src, n, columns, out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "q8_0_rows: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

at::Tensor q8_0_kept_rows(const at::Tensor& kept, const at::Tensor& slot_of, const at::Tensor& index, int64_t columns,
                          at::ScalarType dtype) {
  TORCH_CHECK(columns > 0 && columns % kGroup == 0, "q8_0_kept_rows: columns must be a positive multiple of 32");
  TORCH_CHECK(kept.scalar_type() == at::kByte && kept.dim() == 2 && kept.is_contiguous() &&
              kept.size(1) == columns / kGroup * kBlockBytes,
              "q8_0_kept_rows: kept must be contiguous uint8 [C, columns / 32 * 34]");
  TORCH_CHECK(slot_of.scalar_type() == at::kInt && slot_of.dim() == 1 && slot_of.is_contiguous() &&
              index.scalar_type() == at::kLong, "q8_0_kept_rows: int32 slot_of [rows] and int64 index");
  const at::Tensor ids = index.contiguous();
  const int64_t n = ids.numel(), rows = slot_of.size(0), num_kept = kept.size(0), width = kept.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int32_t* sp = slot_of.data_ptr<int32_t>();
  at::Tensor picked = at::empty({n, width}, kept.options());
  uint8_t* dst = picked.data_ptr<uint8_t>();
  const uint8_t* src = kept.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = ip[i];
    const int32_t slot = row >= 0 && row < rows ? sp[row] : -1;
    if (slot < 0 || slot >= num_kept) return at::empty({0, columns}, kept.options().dtype(dtype));
    std::memcpy(dst + i * width, src + slot * width, width);
  }
  return q8_0_rows(picked, columns, dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) {
  m.def("q8_0_rows(Tensor blocks, int columns, ScalarType dtype) -> Tensor");
  m.def("q8_0_kept_rows(Tensor kept, Tensor slot_of, Tensor index, int columns, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcore, CPU, m) {
  m.impl("q8_0_rows", &q8_0_rows);
  m.impl("q8_0_kept_rows", &q8_0_kept_rows);
}
