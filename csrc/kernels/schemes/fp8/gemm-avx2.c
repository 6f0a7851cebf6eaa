/*
 * AVX2 + FMA + F16C kernels for FP8 (e4m3fn) W8A16 (see fp8/gemm-avx512.c for the
 * layouts, the exact decoding and the decode/prefill split; contracts: common/ukernels.h).
 *
 * A K block is summed unscaled (decoded values times 2^-8) and folded in with its scale at
 * the end (common/ukernels.h).
 *
 * Decoding, 32 bytes (16 columns x 2 k) at a time, in the 16-bit lanes that hold a column's
 * (k0, k1) byte pair, as fp8/gemm-avx512.c's fast route: an arithmetic shift right by 1 and
 * a mask leave k1's sign at bit 15 and its value bits at 13..7, the fp16 bits of value * 2^-8
 * (exact, subnormals included); a byte shuffle that moves k0's byte up by 8 (to the port the
 * shifts and FMAs leave idle) does the same for k0: 5 integer ops per 32 weights, where the
 * widening route before took 13 (3 of them shuffles and unpacks). The words of k0 and of k1 come
 * out with the columns in order, so vcvtph2ps gives each k's columns 0-7 and 8-15 and the fp32 FMA
 * chains keep their order (the scalar tier's bits).
 *
 * NaN codes (0x7f, 0xff) come out as +-1.875 there. The exact route (nan_words) adds 0x80:
 * only a NaN code's word has bits 7-13 all set, so only it carries into bit 14, and or-ing
 * that bit in gives the scalar tier's fp16 NaN; 3 more ops per 16 words. The decode kernel
 * instead tracks the codes (2 ops per 32 bytes) and redoes a block that holds one by the exact
 * route, which no checkpoint's weights need.
 *
 * Decode kernel (blocks of up to 2 rows, where the weights stream once and decoding them is the
 * cost): one pass over all 32 columns, 64 bytes per k pair in memory order, read ahead
 * (CM_DECODE_PF_*_AVX2); vcvtph2ps reads the words from L1 (from a register the upper 8 need
 * a lane extract, and both take the shuffle port). Registers for 2 rows: 4 accumulators a row,
 * the 4 decoded vectors of one half and 2 broadcasts = 14 ymm. Prefill tiles 4 x 16 (two
 * passes for 32 columns, as unquant/gemm-avx2.c) and the chunk conversion take the exact route.
 * The avx2 tier's prefill is the chunk path: chunks converted once to fp32, then a 6 x 16 fp32
 * tile (CM_TILE_MR_AVX2_F32: 12 accumulators, 2 B vectors, a broadcast = 15 ymm, where 4 rows'
 * 8 accumulators match the FMA latency x ports with no slack). Against 4 rows, Qwen3 on the AMX
 * Xeon capped to avx2: M = 512 0.844, M = 64 0.966 (docs/PERFORMANCE-HISTORY.md).
 */
#include <immintrin.h>

#include "common/tile-avx2.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX2

/* 32 bytes (16 columns x 2 k, VNNI-2: column j's k0 byte, then its k1 byte) -> the fp16 words
 * of k0 and of k1 for the 16 columns in order (header). A NaN code gives 0x3f80 | sign here;
 * nan_words makes it NaN. */
CM_INLINE void e4m3_words(__m256i bytes, __m256i *k0, __m256i *k1) {
  /* each column's k0 byte into the high byte of its word (lane by lane: columns 0-7, 8-15) */
  const __m256i k0_high =
      _mm256_setr_epi8(-128, 0, -128, 2, -128, 4, -128, 6, -128, 8, -128, 10, -128, 12, -128, 14,
                       -128, 0, -128, 2, -128, 4, -128, 6, -128, 8, -128, 10, -128, 12, -128, 14);
  const __m256i g0 = _mm256_shuffle_epi8(bytes, k0_high);
  *k0 = _mm256_and_si256(_mm256_srai_epi16(g0, 1), _mm256_set1_epi16((short)0xbfff));
  *k1 = _mm256_and_si256(_mm256_srai_epi16(bytes, 1), _mm256_set1_epi16((short)0xbf80));
}

/* Words of e4m3_words -> the exact ones: a NaN code's word is the only one whose bits 7-13 are
 * all set, so adding 0x80 carries into bit 14 for it alone (0x3f80 | sign -> 0x7f80 | sign). */
CM_INLINE __m256i nan_words(__m256i w) {
  const __m256i carry = _mm256_add_epi16(w, _mm256_set1_epi16(0x80));
  return _mm256_or_si256(w, _mm256_and_si256(carry, _mm256_set1_epi16(0x4000)));
}

/* bytes whose value bits are all ones (the NaN codes) make this 0 (fp8/gemm-avx512.c's) */
CM_INLINE __m256i nan_track(__m256i track, __m256i bytes) {
  return _mm256_min_epu8(track, _mm256_andnot_si256(bytes, _mm256_set1_epi8(0x7f)));
}

CM_INLINE int saw_nan(__m256i track) {
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(track, _mm256_setzero_si256())) != 0;
}

/* 32 bytes -> fp32 k0 and k1 vectors of columns 0-7 and 8-15, times 2^-8, exact (NaN too) */
CM_INLINE void decode_exact(const uint8_t *p, __m256 k0[2], __m256 k1[2]) {
  __m256i w0, w1;
  e4m3_words(_mm256_loadu_si256((const __m256i *)p), &w0, &w1);
  w0 = nan_words(w0);
  w1 = nan_words(w1);
  k0[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(w0));
  k0[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(w0, 1));
  k1[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(w1));
  k1[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(w1, 1));
}

/* one K block of 16 columns [col0, col0 + 16): P = FMA chains of A x d from +0, then
 * C = fma(P, scale, C or +0) */
static inline __attribute__((always_inline)) void gemm_half(
    const int mr, size_t kc, const float *restrict a, size_t as, const uint8_t *restrict b,
    const float *restrict scale, float *restrict c, int accumulate, int col0) {
  __m256 acc0[MR], acc1[MR];
  cm_tile_load__avx2(mr, acc0, acc1, c, col0, 0);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const uint8_t *bk = b + kp * 64 + col0 * 2;
    _mm_prefetch((const char *)(bk + 4096), _MM_HINT_T0);
    __m256 k0[2], k1[2];
    decode_exact(bk, k0, k1);
    cm_tile_fma_k__avx2(mr, acc0, acc1, k0[0], k0[1], a + 2 * kp * as);
    cm_tile_fma_k__avx2(mr, acc0, acc1, k1[0], k1[1], a + (2 * kp + 1) * as);
  }
  const __m256 s0 = _mm256_loadu_ps(scale + col0), s1 = _mm256_loadu_ps(scale + col0 + 8);
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    float *out = c + r * CM_NR + col0;
    const __m256 c0 = accumulate ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
    const __m256 c1 = accumulate ? _mm256_loadu_ps(out + 8) : _mm256_setzero_ps();
    _mm256_storeu_ps(out, _mm256_fmadd_ps(acc0[r], s0, c0));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(acc1[r], s1, c1));
  }
}

/* decode_exact's vectors without the NaN step, the NaN codes tracked in *track; the
 * conversions read the words from L1 (header) */
CM_INLINE void decode_tracking_nan(const uint8_t *p, __m256 k0[2], __m256 k1[2], __m256i *track) {
  const __m256i bytes = _mm256_loadu_si256((const __m256i *)p);
  *track = nan_track(*track, bytes);
  _Alignas(32) uint16_t words[32];
  e4m3_words(bytes, (__m256i *)words, (__m256i *)(words + 16));
  __asm__ volatile("" ::: "memory"); /* keep the round trip: no lane extracts */
  k0[0] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)words));
  k0[1] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(words + 8)));
  k1[0] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(words + 16)));
  k1[1] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(words + 24)));
}

/* The decode kernel's pass over rows [0, mr), exact or fast (NaN codes decoded as +-1.875 and
 * tracked). Returns 0, leaving c as it was, if the fast pass met a NaN code. */
CM_INLINE int decode_body(const int mr, const int exact, size_t kc, const float *restrict a,
                          size_t as, const uint8_t *restrict b, const float *restrict scale,
                          float *restrict c, int accumulate) {
  __m256 acc[2][4]; /* [row][columns 8j..8j+7] */
  __m256i track = _mm256_set1_epi8(0x7f);
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const uint8_t *bk = b + kp * 64;
    cm_prefetch_ahead(bk, CM_DECODE_PF_L1_BYTES_AVX2, CM_DECODE_PF_L2_BYTES_AVX2, 1);
    const float *ak = a + 2 * kp * as;
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { /* columns 16h .. 16h + 15 */
      __m256 k0[2], k1[2];
      if (exact)
        decode_exact(bk + 32 * h, k0, k1);
      else
        decode_tracking_nan(bk + 32 * h, k0, k1, &track);
#pragma GCC unroll 2
      for (int r = 0; r < mr; r++) {
        const __m256 x0 = _mm256_broadcast_ss(ak + r), x1 = _mm256_broadcast_ss(ak + as + r);
        acc[r][2 * h] = _mm256_fmadd_ps(x0, k0[0], acc[r][2 * h]);
        acc[r][2 * h + 1] = _mm256_fmadd_ps(x0, k0[1], acc[r][2 * h + 1]);
        acc[r][2 * h] = _mm256_fmadd_ps(x1, k1[0], acc[r][2 * h]);
        acc[r][2 * h + 1] = _mm256_fmadd_ps(x1, k1[1], acc[r][2 * h + 1]);
      }
    }
  }
  if (!exact && saw_nan(track)) return 0;
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      float *out = c + r * CM_NR + 8 * j;
      const __m256 prior = accumulate ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
      _mm256_storeu_ps(out, _mm256_fmadd_ps(acc[r][j], _mm256_loadu_ps(scale + 8 * j), prior));
    }
  return 1;
}

/* the fast pass; a NaN code in the block (never in a checkpoint's weights) costs a second,
 * exact one */
CM_INLINE void decode_rows(const int mr, size_t kc, const float *a, size_t as, const uint8_t *b,
                           const float *scale, float *c, int accumulate) {
  if (!decode_body(mr, 0, kc, a, as, b, scale, c, accumulate))
    decode_body(mr, 1, kc, a, as, b, scale, c, accumulate);
}

void cm_fp8_gemm_decode_mrx32__avx2(size_t mr, size_t kc, const void *a, size_t as,
                                    const uint8_t *b, const float *scale, float *c,
                                    int accumulate) {
  CM_EXPECT((mr == 1 || mr == 2) && kc % 2 == 0 && as >= mr);
  if (mr == 1)
    decode_rows(1, kc, (const float *)a, as, b, scale, c, accumulate);
  else
    decode_rows(2, kc, (const float *)a, as, b, scale, c, accumulate);
}

static inline __attribute__((always_inline)) void gemm_f32b_half(const int mr, size_t kc,
                                                                 const float *restrict a, size_t as,
                                                                 const float *restrict b,
                                                                 float *restrict c, int accumulate,
                                                                 int col0) {
  __m256 acc0[CM_TILE_MR_AVX2_F32], acc1[CM_TILE_MR_AVX2_F32];
  cm_tile_load__avx2(mr, acc0, acc1, c, col0, accumulate);
  for (size_t k = 0; k < kc; k++)
    cm_tile_fma_k__avx2(mr, acc0, acc1, _mm256_loadu_ps(b + k * CM_NR + col0),
                        _mm256_loadu_ps(b + k * CM_NR + col0 + 8), a + k * as);
  cm_tile_store__avx2(mr, acc0, acc1, c, col0);
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc, const float *a,
                                                            size_t as, const uint8_t *b,
                                                            const float *scale, float *c,
                                                            int accumulate) {
  gemm_half(mr, kc, a, as, b, scale, c, accumulate, 0);
  gemm_half(mr, kc, a, as, b, scale, c, accumulate, 16);
}

static inline __attribute__((always_inline)) void gemm_f32b_body(const int mr, size_t kc,
                                                                 const float *a, size_t as,
                                                                 const float *b, float *c,
                                                                 int accumulate) {
  gemm_f32b_half(mr, kc, a, as, b, c, accumulate, 0);
  gemm_f32b_half(mr, kc, a, as, b, c, accumulate, 16);
}

void cm_fp8_gemm_f32acc_mrx32__avx2(size_t mr, size_t kc, const void *a, size_t as,
                                    const uint8_t *b, const float *scale, float *c,
                                    int accumulate) {
  CM_EXPECT(kc % 2 == 0 && as >= mr);
  CM_MR_SWITCH4(gemm_body, kc, (const float *)a, as, b, scale, c, accumulate)
}

void cm_f32_gemm_f32acc_mrx32__avx2(size_t mr, size_t kc, const void *a, size_t as, const void *b,
                                    float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(as >= mr);
  CM_MR_SWITCH6(gemm_f32b_body, kc, (const float *)a, as, (const float *)b, c, accumulate)
}

void cm_fp8_to_f32__avx2(size_t kc, const uint8_t *b, void *out) {
  float *dst = (float *)out;
  for (size_t kp = 0; kp < kc / 2; kp++)
    for (int col0 = 0; col0 < CM_NR; col0 += 16) {
      __m256 k0[2], k1[2];
      decode_exact(b + kp * 64 + col0 * 2, k0, k1);
      float *even = dst + 2 * kp * CM_NR + col0, *odd = even + CM_NR;
      _mm256_storeu_ps(even, k0[0]);
      _mm256_storeu_ps(even + 8, k0[1]);
      _mm256_storeu_ps(odd, k1[0]);
      _mm256_storeu_ps(odd + 8, k1[1]);
    }
}
