/*
 * The fp32 register tile shared by the AVX2 GEMM micro-kernels (unquant/, fp8/): one
 * 16-column half [col0, col0 + 16) of a C tile [mr][32], rows r < mr <= 4 in acc0[r]
 * (columns col0..col0+7) and acc1[r] (+8..+15). Each update is one FMA per accumulator,
 * in k order: every C element stays one sequential fp32 FMA chain (the scalar tier's
 * bits). Include only from files compiled with the avx2 tier's flags.
 */
#ifndef CPUMOE_COMMON_TILE_AVX2_H
#define CPUMOE_COMMON_TILE_AVX2_H

#include <immintrin.h>

#include "common/ukernels.h"

#define CM_TILE_MR_AVX2 4
#define CM_TILE_MR_AVX2VNNI 6   /* the INT8 (and INT4 prefill) tile of avx2vnni */
#define CM_TILE_MR_AVX2_16BIT 6 /* avx2's bf16/fp16-weight tile (unquant/gemm-avx2.c) */
#define CM_TILE_MR_AVX2_F32 6   /* avx2's fp32-weight tile: FP8's chunks (fp8/gemm-avx2.c) */
#define CM_TILE_MR_AVX2_INT8 6  /* avx2's INT8 tile (int8/gemm-avx2.c) */

#define CM_INLINE static inline __attribute__((always_inline))

/* The avx2 and avx2vnni decode kernels' read-ahead (unquant/, int8/, int4/, fp8/, mxfp4/),
 * bytes of weights: into L1 and into L2 (cm_prefetch_ahead). With the weights on huge pages
 * 4 KiB into L2 streams faster than 8: the INT8 kernel over 1 GiB, two threads, 12.8-13.1 ->
 * 17.0-17.7 GB/s each (bf16 15.8-16.8 -> 18.0-18.5); Qwen3 M = 1 on the AMX Xeon capped to
 * avx2, paired A/Bs: INT8 0.94, bf16 0.94, fp16 0.90, MXFP4 0.97, FP8 and INT4 (bound by
 * their decode work) 0.99 (docs/PERFORMANCE-HISTORY.md). */
#define CM_DECODE_PF_L1_BYTES_AVX2 2048
#define CM_DECODE_PF_L2_BYTES_AVX2 4096

/* An empty asm that takes and gives back two accumulators, after their update: GCC otherwise
 * computes an integer tile's update (a multiply into a fresh register, then the add) in the
 * new register and copies it back, a vmovdqa per accumulator per step and a spill to the
 * stack (int8/gemm-avx2.c's tile: 9 copies per k quad of 4 rows). */
CM_INLINE void cm_keep_in_registers2__avx2(__m256i *a, __m256i *b) {
#ifndef CM_PORTABLE_INTRINSICS
  __asm__("" : "+x"(*a), "+x"(*b));
#else
  (void)a, (void)b;
#endif
}

/* acc = C[:, col0..col0+16) (accumulate) or +0 */
CM_INLINE void cm_tile_load__avx2(const int mr, __m256 *acc0, __m256 *acc1, const float *c,
                                  int col0, int accumulate) {
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    acc0[r] = accumulate ? _mm256_loadu_ps(c + r * CM_NR + col0) : _mm256_setzero_ps();
    acc1[r] = accumulate ? _mm256_loadu_ps(c + r * CM_NR + col0 + 8) : _mm256_setzero_ps();
  }
}

/* one k: acc[r] += a[r] * (b0 | b1), the A strip of that k broadcast per row */
CM_INLINE void cm_tile_fma_k__avx2(const int mr, __m256 *acc0, __m256 *acc1, __m256 b0, __m256 b1,
                                   const float *a_k) {
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    const __m256 x = _mm256_broadcast_ss(a_k + r);
    acc0[r] = _mm256_fmadd_ps(x, b0, acc0[r]);
    acc1[r] = _mm256_fmadd_ps(x, b1, acc1[r]);
  }
}

CM_INLINE void cm_tile_store__avx2(const int mr, const __m256 *acc0, const __m256 *acc1, float *c,
                                   int col0) {
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    _mm256_storeu_ps(c + r * CM_NR + col0, acc0[r]);
    _mm256_storeu_ps(c + r * CM_NR + col0 + 8, acc1[r]);
  }
}

/* body(rows, args...) for rows = mr (1..4), so the tile's loops unroll */
#define CM_MR_SWITCH4(body, ...)          \
  CM_EXPECT(mr >= 1 && mr <= 4);          \
  switch (mr) {                           \
    case 1: body(1, __VA_ARGS__); break;  \
    case 2: body(2, __VA_ARGS__); break;  \
    case 3: body(3, __VA_ARGS__); break;  \
    default: body(4, __VA_ARGS__); break; \
  }

/* the same for rows = mr (1..6): tiles whose accumulators fit 6 rows (int8/gemm-avx2vnni.c) */
#define CM_MR_SWITCH6(body, ...)          \
  CM_EXPECT(mr >= 1 && mr <= 6);          \
  switch (mr) {                           \
    case 1: body(1, __VA_ARGS__); break;  \
    case 2: body(2, __VA_ARGS__); break;  \
    case 3: body(3, __VA_ARGS__); break;  \
    case 4: body(4, __VA_ARGS__); break;  \
    case 5: body(5, __VA_ARGS__); break;  \
    default: body(6, __VA_ARGS__); break; \
  }

#endif
