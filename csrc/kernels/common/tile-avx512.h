/*
 * The fp32 register tile shared by the AVX-512 GEMM micro-kernels (unquant/, fp8/):
 * rows r < mr <= 12 of a C tile [mr][32] live in acc0[r] (columns 0..15) and acc1[r]
 * (16..31), 24 zmm. Each update is one FMA per accumulator, in k order: every C
 * element stays one sequential fp32 FMA chain (the scalar tier's bits). Also the A-side
 * broadcast of the u8 kernels (int8/, int4/).
 * Include only from files compiled with the avx512 tier's flags.
 */
#ifndef CPUMOE_COMMON_TILE_AVX512_H
#define CPUMOE_COMMON_TILE_AVX512_H

#include <immintrin.h>
#include <string.h>

#include "common/ukernels.h"

#define CM_TILE_MR_AVX512 12

#define CM_INLINE static inline __attribute__((always_inline))

/* Each 16-bit word shifted right by `bits` (1..15), as the high half of its product with
 * 2^(16 - bits). On the AMX Xeon VM a 512-bit shift issues on the port that also runs every
 * permute and saturating add, which the decode loops already fill, and the multiply on
 * either vector port (docs/PERFORMANCE-HISTORY.md, "MXFP4 decode on the AMX tier"). Same
 * bits as vpsrlw. */
CM_INLINE __m512i cm_srli_epi16_mul__avx512(__m512i x, const int bits) {
  return _mm512_mulhi_epu16(x, _mm512_set1_epi16((short)(1u << (16 - bits))));
}

/* The 64 bytes at p, loaded once. Compilers fold a load into each instruction that reads
 * the vector, and at decode, where the line is still on its way from DRAM, the repeated
 * loads slow the weights' stream down (docs/PERFORMANCE-HISTORY.md). An empty asm that takes
 * and gives back the vector keeps it in one register. */
CM_INLINE __m512i cm_load_once__avx512(const void *p) {
  __m512i v = _mm512_loadu_si512(p);
#ifndef CM_PORTABLE_INTRINSICS
  __asm__("" : "+v"(v));
#endif
  return v;
}

/* the 4 bytes at p (one u8 k-quad of an A panel row) in every dword lane */
CM_INLINE __m512i cm_broadcast_dword__avx512(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* acc = C (accumulate) or +0 */
CM_INLINE void cm_tile_load__avx512(const int mr, __m512 *acc0, __m512 *acc1, const float *c,
                                    int accumulate) {
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    acc0[r] = accumulate ? _mm512_loadu_ps(c + r * CM_NR) : _mm512_setzero_ps();
    acc1[r] = accumulate ? _mm512_loadu_ps(c + r * CM_NR + 16) : _mm512_setzero_ps();
  }
}

/* one k: acc[r] += a[r] * (b0 | b1), the A strip of that k broadcast per row */
CM_INLINE void cm_tile_fma_k__avx512(const int mr, __m512 *acc0, __m512 *acc1, __m512 b0, __m512 b1,
                                     const float *a_k) {
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    const __m512 x = _mm512_set1_ps(a_k[r]);
    acc0[r] = _mm512_fmadd_ps(x, b0, acc0[r]);
    acc1[r] = _mm512_fmadd_ps(x, b1, acc1[r]);
  }
}

CM_INLINE void cm_tile_store__avx512(const int mr, const __m512 *acc0, const __m512 *acc1,
                                     float *c) {
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_ps(c + r * CM_NR, acc0[r]);
    _mm512_storeu_ps(c + r * CM_NR + 16, acc1[r]);
  }
}

/* One specialization per row count, so that the tile's loops unroll and the accumulators
 * stay in registers: body(rows, args...) for rows = mr (1..12). */
#define CM_MR_SWITCH12(body, ...)          \
  CM_EXPECT(mr >= 1 && mr <= 12);          \
  switch (mr) {                            \
    case 1: body(1, __VA_ARGS__); break;   \
    case 2: body(2, __VA_ARGS__); break;   \
    case 3: body(3, __VA_ARGS__); break;   \
    case 4: body(4, __VA_ARGS__); break;   \
    case 5: body(5, __VA_ARGS__); break;   \
    case 6: body(6, __VA_ARGS__); break;   \
    case 7: body(7, __VA_ARGS__); break;   \
    case 8: body(8, __VA_ARGS__); break;   \
    case 9: body(9, __VA_ARGS__); break;   \
    case 10: body(10, __VA_ARGS__); break; \
    case 11: body(11, __VA_ARGS__); break; \
    default: body(12, __VA_ARGS__); break; \
  }

#endif
