// kvcore::built_with(feature): whether the kernels were compiled with an ISA extension (isa.h), "avx512_vnni"
// (the int4a8 and int8-group kernels' products on vpdpbusd), "avx2_dot" (the same products on AVX2's vpmaddubsw,
// where VNNI is absent; without either those kernels run portable loops) or "avx512_bf16" (the bf16_linear and
// prefill_attention kernels, the bfloat16 decode path). Callers check it before using those kernels.

#include <torch/library.h>

#include <string>

#include "isa.h"

namespace {

bool built_with(const std::string& feature) {
  if (feature == "avx512_vnni") {
#ifdef KVCORE_VNNI
    return true;
#else
    return false;
#endif
  }
  if (feature == "avx2_dot") {
#ifdef KVCORE_AVX2_DOT
    return true;
#else
    return false;
#endif
  }
  TORCH_CHECK(feature == "avx512_bf16", "built_with: unknown feature '", feature,
              "' (avx512_vnni, avx2_dot, avx512_bf16)");
#ifdef KVCORE_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcore, m) { m.def("built_with(str feature) -> bool", &built_with); }
