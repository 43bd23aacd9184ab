// The ISA extensions kvcore's kernels were compiled for. kvcore/cpu_kernels.py passes -mavx512vnni and
// -mavx512bf16 where the CPU has them (and AVX-512), -mavx2 -mfma -mf16c on an AVX2 CPU; every kernel file and the
// built_with probe (isa.cpp) test these macros, so that what a kernel uses and what the probe reports cannot disagree.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVCORE_VNNI 1  // vpdpbusd: int4 x int8 dot products (int4_linear.cpp)
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVCORE_BF16 1  // vdpbf16ps: bfloat16 pair products (bf16_linear.cpp, prefill_attention.cpp, decode_attention.cpp)
#endif
#if !defined(KVCORE_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVCORE_AVX2_DOT 1  // vpmaddubsw + vpmaddwd: the same integer dot products without VNNI (int4a8.h)
#endif
#if defined(KVCORE_VNNI) || defined(KVCORE_BF16) || defined(KVCORE_AVX2_DOT)
#include <immintrin.h>
#endif
