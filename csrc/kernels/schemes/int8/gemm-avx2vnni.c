/*
 * AVX-VNNI micro-kernels for INT8 W8A8, for CPUs with AVX2 and the VEX-encoded vpdpbusd but
 * no AVX-512 (Intel client cores from Alder Lake on): u8 activations x s8 weights -> exact
 * int32, the avx512 tier's method (int8/gemm-avx512.c) at 256 bits. The dequantization of a
 * finished tile stays the avx2 tier's (contracts and layouts: common/ukernels.h).
 *
 *   A panel: u8 [kc/4][a_stride][4]; B: s8 VNNI-4 [kc/4][32][4], per k-quad 128 bytes,
 *   columns 8j..8j+7 in bytes 32j..32j+31; acc: int32 [mr][32].
 *   vpdpbusd adds four u8*s8 products (each |.| <= 255*128) into an int32 lane: exact, no
 *   saturation, while kc*255*128 < 2^31 (the op checks its reductions against that). The
 *   sums are the avx2 tier's exact integers, so the bits are the same.
 *
 * Tile 6 x 16, two passes for 32 columns: per k-quad a pass loads its half of the quad (one
 * 64-byte line) as 2 ymm and broadcasts each row's A dword; 6 rows x 2 accumulators + 2 B +
 * 1 A = 15 of 16 ymm, 12 vpdpbusd per 2 loads and 6 broadcasts. 12 independent chains also
 * cover vpdpbusd's latency at two per cycle (8, from 4 rows, would not). All 32 columns in
 * one pass would need 4 accumulators a row and leave room for 2 rows only.
 *
 * Decode (blocks of up to 2 rows, where the weights stream from memory once and are the whole
 * cost): one pass over the 32 columns in memory order, 128 bytes per k-quad, both lines read
 * ahead (CM_DECODE_PF_*_AVX2); 4 accumulators a row: 2 x 4 + 4 B + 1 A = 13 ymm.
 */
#include <immintrin.h>
#include <string.h>

#include "common/tile-avx2.h" /* the mr switch, the decode read-ahead */
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX2VNNI

/* row r's 4 u8 of a k-quad in every dword lane */
static inline __attribute__((always_inline)) __m256i broadcast_quad(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* columns [col0, col0 + 16) over the chunk */
static inline __attribute__((always_inline)) void gemm_cols16(const int mr, size_t kc,
                                                              const uint8_t *restrict a, size_t as,
                                                              const int8_t *restrict b,
                                                              int32_t *restrict acc, int accumulate,
                                                              int col0, cm_prefetch_cursor *pf) {
  __m256i acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < mr; r++) {
    int32_t *c = acc + r * CM_NR + col0;
    acc0[r] = accumulate ? _mm256_loadu_si256((const __m256i *)c) : _mm256_setzero_si256();
    acc1[r] = accumulate ? _mm256_loadu_si256((const __m256i *)(c + 8)) : _mm256_setzero_si256();
  }
  for (size_t kq = 0; kq < kc / 4; kq++) {
    cm_prefetch_step(pf, CM_NR / 16 * (kc / 4));
    const int8_t *bk = b + kq * 128 + col0 * 4;
    const __m256i b0 = _mm256_loadu_si256((const __m256i *)bk);
    const __m256i b1 = _mm256_loadu_si256((const __m256i *)(bk + 32));
    const uint8_t *ak = a + kq * as * 4;
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
      const __m256i x = broadcast_quad(ak + 4 * r);
      acc0[r] = _mm256_dpbusd_avx_epi32(acc0[r], x, b0);
      acc1[r] = _mm256_dpbusd_avx_epi32(acc1[r], x, b1);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < mr; r++) {
    int32_t *c = acc + r * CM_NR + col0;
    _mm256_storeu_si256((__m256i *)c, acc0[r]);
    _mm256_storeu_si256((__m256i *)(c + 8), acc1[r]);
  }
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const uint8_t *a, size_t as,
                                                            const int8_t *b, int32_t *acc,
                                                            int accumulate, cm_prefetch prefetch) {
  cm_prefetch_cursor pf = cm_prefetch_begin(prefetch); /* spread over the two passes */
  for (int col0 = 0; col0 < CM_NR; col0 += 16)
    gemm_cols16(mr, kc, a, as, b, acc, accumulate, col0, &pf);
  cm_prefetch_finish(&pf);
}

void cm_u8s8_gemm_s32acc_mrx32__avx2vnni(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                         const int8_t *b, int32_t *acc, int accumulate,
                                         cm_prefetch prefetch) {
  CM_EXPECT(kc % 4 == 0 && as >= mr);
  CM_MR_SWITCH6(gemm_body, kc, a, as, b, acc, accumulate, prefetch)
}

static inline __attribute__((always_inline)) void decode_body(const int mr, size_t kc,
                                                              const uint8_t *a, size_t as,
                                                              const int8_t *b, int32_t *acc,
                                                              int accumulate) {
  __m256i sums[2][4]; /* [row][columns 8j..8j+7] */
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      const __m256i *c = (const __m256i *)(acc + r * CM_NR + 8 * j);
      sums[r][j] = accumulate ? _mm256_loadu_si256(c) : _mm256_setzero_si256();
    }
  for (size_t kq = 0; kq < kc / 4; kq++) {
    const int8_t *bk = b + kq * 128;
    cm_prefetch_ahead(bk, CM_DECODE_PF_L1_BYTES_AVX2, CM_DECODE_PF_L2_BYTES_AVX2, 2);
    __m256i w[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) w[j] = _mm256_loadu_si256((const __m256i *)(bk + 32 * j));
#pragma GCC unroll 2
    for (int r = 0; r < mr; r++) {
      const __m256i x = broadcast_quad(a + kq * as * 4 + 4 * r);
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) sums[r][j] = _mm256_dpbusd_avx_epi32(sums[r][j], x, w[j]);
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      _mm256_storeu_si256((__m256i *)(acc + r * CM_NR + 8 * j), sums[r][j]);
}

void cm_u8s8_gemm_decode_mrx32__avx2vnni(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                         const int8_t *b, int32_t *acc, int accumulate,
                                         cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT((mr == 1 || mr == 2) && kc % 4 == 0 && as >= mr);
  if (mr == 1)
    decode_body(1, kc, a, as, b, acc, accumulate);
  else
    decode_body(2, kc, a, as, b, acc, accumulate);
}
