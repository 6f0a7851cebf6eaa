/*
 * What the avx512bf16 tier's kernels (schemes/unquant/, schemes/fp8/) share beyond the
 * AVX-512 register tile (common/tile-avx512.h). Include only from files compiled with the
 * avx512bf16 tier's flags.
 */
#ifndef CPUMOE_COMMON_TILE_AVX512BF16_H
#define CPUMOE_COMMON_TILE_AVX512BF16_H

#include <immintrin.h>
#include <string.h>

#include "common/tile-avx512.h"

/* The 32 bf16 of a vector as vdpbf16ps's operand type: a reinterpretation, no instruction.
 * The emulating build's vector types are not GCC vectors of one size, so it copies. */
static inline __attribute__((always_inline)) __m512bh cm_as_bf16x32__avx512bf16(__m512i v) {
#ifdef CM_PORTABLE_INTRINSICS
  __m512bh r;
  memcpy(&r, &v, sizeof r);
  return r;
#else
  return (__m512bh)v;
#endif
}

#endif /* CPUMOE_COMMON_TILE_AVX512BF16_H */
