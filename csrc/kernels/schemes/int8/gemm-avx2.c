/*
 * AVX2 micro-kernels for INT8 W8A8 on CPUs without VNNI: u8 x s8 -> exact int32, and the
 * dequantization of a finished tile (contracts and layouts: common/ukernels.h,
 * int8/gemm-avx512.c).
 *
 * Method and why it cannot overflow: the usual vpmaddubsw multiplies u8 by s8 and adds
 * pairs into int16 with saturation (255*127*2 > 32767), which is not exact. Instead both
 * operands are widened to int16 (A zero-extended, B sign-extended) and multiplied with
 * vpmaddwd, which adds pairs of int16 products into int32: |pair| <= 2*255*128 = 65280,
 * far inside int32. Accumulation is int32, exact while k*255*128 < 2^31 (k <= 65792; the
 * op checks its reductions against that).
 *
 * Tile 6 x 8 per pass (CM_TILE_MR_AVX2_INT8), four passes for 32 columns: 32 bytes of B hold
 * 8 columns x 4 k; sign-extended they are 2 ymm of int16 (columns 0-3 and 4-7, each column's 4
 * k in 4 int16), each widened straight from memory (a load-op vpmovsxbw; from one 32-byte load
 * the upper half needs a lane extract too). Row r's 4 u8 are zero-extended into a 64-bit
 * pattern and broadcast; vpmaddwd then gives two int32 partial sums per column, folded with
 * vphaddd at the end. 6 rows x 2 accumulators + 2 B + 1 A = 15 of 16 ymm: the B widening is
 * shared by 12 vpmaddwd instead of 8. Qwen3 M = 512 against the 4-row tile that widened from a
 * 32-byte load: the load-op widening 0.907, then 6 rows 0.944 and 0.976 (M = 64 about even;
 * docs/PERFORMANCE-HISTORY.md). The rows are widened once per stretch
 * of 128 k quads into a stack buffer that all four passes broadcast from (a load each, where
 * widening in each pass cost 3 shuffle-port ops per row and quad), and the stretch's 16 KiB
 * of weights stay in L1 across the passes; the accumulators are pinned to their registers
 * (cm_keep_in_registers2__avx2). Qwen3 M = 512: 0.770x the time (docs/PERFORMANCE-HISTORY.md).
 *
 * Decode kernel (blocks of up to 2 rows, where the weights stream from memory once and are
 * the whole cost): the four passes would read each 64-byte line in two halves, one pass
 * apart, at a 128-byte stride. It does all 32 columns in one pass instead, 128 bytes per k
 * quad in memory order, both lines prefetched ahead (CM_DECODE_PF_*_AVX2). One row: 8
 * accumulators (two per 8 columns, as above) + 1 A + 3 B = 12 ymm; two rows: each k quad's
 * pair sums folded at once with vphaddd, 4 accumulators per row. The same exact int32 sums.
 */
#include <immintrin.h>
#include <string.h>

#include "common/tile-avx2.h" /* the mr switch */
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX2_INT8

/* a row's k quad (4 u8) zero-extended to 4 int16 in the low 64 bits */
static inline __attribute__((always_inline)) __m128i widen_a(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm_cvtepu8_epi16(_mm_cvtsi32_si128(v));
}

/* the same broadcast to the 4 quadwords of a ymm */
static inline __attribute__((always_inline)) __m256i widen_a_all(const uint8_t *p) {
  return _mm256_broadcastq_epi64(widen_a(p));
}

/* 8 columns' int32 sums in the lane order 0,1,4,5 | 2,3,6,7 (what vphaddd of the pair-sum
 * accumulators gives) into out[0..8), added to it if accumulate */
static inline __attribute__((always_inline)) void store_sums(int32_t *out, __m256i lane_order,
                                                             int accumulate) {
  __m256i v = _mm256_permute4x64_epi64(lane_order, 0xd8);
  if (accumulate) v = _mm256_add_epi32(v, _mm256_loadu_si256((const __m256i *)out));
  _mm256_storeu_si256((__m256i *)out, v);
}

/* 16 s8 weights (4 columns x 4 k) sign-extended to int16, straight from memory: one load-op
 * uop, where a 32-byte load would need a lane extract for its upper half. */
static inline __attribute__((always_inline)) __m256i widen_b(const int8_t *p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* 8 columns [col0, col0 + 8) over `quads` k quads; a16[kq * mr + r] is row r's k quad kq
 * zero-extended to 4 int16; with_pf: one prefetch step per quad */
static inline __attribute__((always_inline)) void gemm_cols8(const int mr, size_t quads,
                                                             const int64_t *restrict a16,
                                                             const int8_t *restrict b,
                                                             int32_t *restrict acc, int accumulate,
                                                             int col0, cm_prefetch_cursor *pf,
                                                             size_t pf_steps, const int with_pf) {
  __m256i acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    acc0[r] = _mm256_setzero_si256();
    acc1[r] = _mm256_setzero_si256();
  }
  for (size_t kq = 0; kq < quads; kq++) {
    if (with_pf) cm_prefetch_step(pf, pf_steps);
    const __m256i b0 = widen_b(b + kq * 128 + col0 * 4);
    const __m256i b1 = widen_b(b + kq * 128 + col0 * 4 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      const __m256i x = _mm256_set1_epi64x(a16[kq * (size_t)mr + (size_t)r]); /* a load */
      acc0[r] = _mm256_add_epi32(acc0[r], _mm256_madd_epi16(x, b0));
      acc1[r] = _mm256_add_epi32(acc1[r], _mm256_madd_epi16(x, b1));
      cm_keep_in_registers2__avx2(&acc0[r], &acc1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    /* lanes (2j, 2j+1) of acc0 are column j's halves (j < 4), of acc1 column 4 + j */
    store_sums(acc + r * CM_NR + col0, _mm256_hadd_epi32(acc0[r], acc1[r]), accumulate);
  }
}

#define A16_QUADS 128 /* k quads widened at a time: 4 KiB of int16 rows on the stack */

/* The four 8-column passes over each stretch of A16_QUADS k quads, whose rows are widened
 * to int16 once for all four passes (each broadcast is then a load, not 3 shuffle-port ops
 * per pass) and whose 16 KiB of weights stay in L1 from the first pass to the last. */
static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const uint8_t *a, size_t as,
                                                            const int8_t *b, int32_t *acc,
                                                            int accumulate, cm_prefetch prefetch) {
  cm_prefetch_cursor pf = cm_prefetch_begin(prefetch); /* spread over the first passes */
  const size_t pf_steps = kc / 4;
  int64_t a16[A16_QUADS * MR];
  for (size_t kq0 = 0; kq0 < kc / 4; kq0 += A16_QUADS) {
    const size_t quads = kc / 4 - kq0 < A16_QUADS ? kc / 4 - kq0 : A16_QUADS;
    for (size_t kq = 0; kq < quads; kq++)
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++) {
        const __m128i x = widen_a(a + ((kq0 + kq) * as + (size_t)r) * 4);
        a16[kq * (size_t)mr + (size_t)r] = _mm_cvtsi128_si64(x);
      }
    /* the caller's share of the next chunk is requested during the first pass alone: the
     * credit arithmetic of each step is scalar work on the vector ALU ports, which the other
     * three passes are spared */
    gemm_cols8(mr, quads, a16, b + kq0 * 128, acc, accumulate || kq0 > 0, 0, &pf, pf_steps, 1);
    for (int col0 = 8; col0 < CM_NR; col0 += 8)
      gemm_cols8(mr, quads, a16, b + kq0 * 128, acc, accumulate || kq0 > 0, col0, &pf, pf_steps, 0);
  }
  cm_prefetch_finish(&pf);
}

void cm_u8s8_gemm_s32acc_mrx32__avx2(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                     const int8_t *b, int32_t *acc, int accumulate,
                                     cm_prefetch prefetch) {
  CM_EXPECT(kc % 4 == 0 && as >= mr);
  CM_MR_SWITCH6(gemm_body, kc, a, as, b, acc, accumulate, prefetch)
}

/* One row: per 8 columns two accumulators of int32 pair sums (as the tile), folded once at
 * the end. */
static inline __attribute__((always_inline)) void decode_row(size_t kc, const uint8_t *a, size_t as,
                                                             const int8_t *b, int32_t *acc,
                                                             int accumulate) {
  __m256i lo[4], hi[4]; /* columns 8j..8j+3 and 8j+4..8j+7, two partial sums each */
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_si256();
  for (size_t kq = 0; kq < kc / 4; kq++) {
    const int8_t *bk = b + kq * 128;
    cm_prefetch_ahead(bk, CM_DECODE_PF_L1_BYTES_AVX2, CM_DECODE_PF_L2_BYTES_AVX2, 2);
    const __m256i x = widen_a_all(a + kq * as * 4);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      lo[j] = _mm256_add_epi32(lo[j], _mm256_madd_epi16(x, widen_b(bk + 32 * j)));
      hi[j] = _mm256_add_epi32(hi[j], _mm256_madd_epi16(x, widen_b(bk + 32 * j + 16)));
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    store_sums(acc + 8 * j, _mm256_hadd_epi32(lo[j], hi[j]), accumulate);
  }
}

/* Two rows: 16 pair-sum accumulators would not fit, so each k quad's pair sums are folded
 * into one accumulator per 8 columns at once (vphaddd; columns in the tile's lane order
 * 0,1,4,5 | 2,3,6,7 until the end). */
static inline __attribute__((always_inline)) void decode_rows2(size_t kc, const uint8_t *a,
                                                               size_t as, const int8_t *b,
                                                               int32_t *acc, int accumulate) {
  __m256i sums[2][4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) sums[0][j] = sums[1][j] = _mm256_setzero_si256();
  for (size_t kq = 0; kq < kc / 4; kq++) {
    const int8_t *bk = b + kq * 128;
    cm_prefetch_ahead(bk, CM_DECODE_PF_L1_BYTES_AVX2, CM_DECODE_PF_L2_BYTES_AVX2, 2);
    const __m256i x0 = widen_a_all(a + kq * as * 4), x1 = widen_a_all(a + kq * as * 4 + 4);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      const __m256i b0 = widen_b(bk + 32 * j), b1 = widen_b(bk + 32 * j + 16);
      sums[0][j] = _mm256_add_epi32(
          sums[0][j], _mm256_hadd_epi32(_mm256_madd_epi16(x0, b0), _mm256_madd_epi16(x0, b1)));
      sums[1][j] = _mm256_add_epi32(
          sums[1][j], _mm256_hadd_epi32(_mm256_madd_epi16(x1, b0), _mm256_madd_epi16(x1, b1)));
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < 2; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) store_sums(acc + r * CM_NR + 8 * j, sums[r][j], accumulate);
}

void cm_u8s8_gemm_decode_mrx32__avx2(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                     const int8_t *b, int32_t *acc, int accumulate,
                                     cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT((mr == 1 || mr == 2) && kc % 4 == 0 && as >= mr);
  if (mr == 1)
    decode_row(kc, a, as, b, acc, accumulate);
  else
    decode_rows2(kc, a, as, b, acc, accumulate);
}

void cm_u8s8_dequant_mrx32__avx2(size_t mr, const int32_t *restrict acc, const int8_t *comp,
                                 const float *restrict a_scale, const float *restrict w_scale,
                                 float *restrict c) {
  for (size_t r = 0; r < mr; r++) {
    const __m256 as_r = _mm256_set1_ps(a_scale[r]);
    for (int col0 = 0; col0 < CM_NR; col0 += 8) {
      const __m256i cmp = _mm256_loadu_si256((const __m256i *)(comp + 4 * col0));
      const __m256i t = _mm256_loadu_si256((const __m256i *)(acc + r * CM_NR + col0));
      const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(t, cmp));
      _mm256_storeu_ps(c + r * CM_NR + col0,
                       _mm256_mul_ps(_mm256_mul_ps(v, as_r), _mm256_loadu_ps(w_scale + col0)));
    }
  }
}
