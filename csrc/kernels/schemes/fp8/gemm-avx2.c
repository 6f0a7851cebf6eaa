/*
 * AVX2 + FMA + F16C kernels for FP8 (e4m3fn) W8A16 (see fp8/gemm-avx512.c for the
 * layouts, the exact decoding and the decode/prefill split; contracts: common/ukernels.h).
 *
 * A K block is summed unscaled (decoded values times 2^-8) and folded in with its scale at
 * the end (common/ukernels.h). Tiles 4 x 16, two passes for 32 columns (as unquant/gemm-avx2.c):
 * per k pair a 16-byte load holds 8 columns x 2 k, widened to 16 words, moved into fp16 position,
 * split into even/odd k with a byte shuffle and a lane permute, converted by vcvtph2ps. 4 rows x 2
 * accumulators + 4 decoded B + 2 broadcasts = 14 of 16 ymm.
 *
 * Decode kernel (blocks of up to 2 rows, where the weights stream once and decoding them is the
 * cost): one pass over all 32 columns, 64 bytes per k pair in memory order, prefetched ahead
 * (CM_DECODE_PF_*_AVX2). Each 32-byte half (16 columns x 2 k) is decoded on bytes before any
 * widening: a byte shuffle puts each 8 columns' k0 bytes before their k1 bytes, then for each
 * byte g = s eeee mmm the fp16 word's high byte is s 0 eeee mm ((g >> 1) & 0x3f | g & 0x80) and
 * its low byte m 0000000 ((g << 7) & 0x80), a NaN code (g | 0x80 == 0xff) gets the exponent's
 * top bit (0x40), and two byte unpacks give the k0 and k1 words: 13 integer ops per 32 weights
 * (decode_pair above: 11 per 16) and the same fp16 words, so the same bits. 4 vcvtph2ps then
 * give each k's columns 0-7 and 8-15. Registers for 2 rows: 4 accumulators a row (32 columns),
 * the 4 decoded vectors of one half (the byte work's temporaries die as they are made) and 2
 * broadcasts = 14 ymm.
 */
#include <immintrin.h>

#include "common/tile-avx2.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX2

/* 16 bytes (8 columns x 2 k) -> fp32 even-k and odd-k vectors, times 2^-8 */
static inline __attribute__((always_inline)) void decode_pair(__m128i bytes, __m256 *even,
                                                              __m256 *odd) {
  const __m256i w = _mm256_cvtepu8_epi16(bytes);
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                              _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1,
                                         4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, split), 0xd8);
  *even = _mm256_cvtph_ps(_mm256_castsi256_si128(t));
  *odd = _mm256_cvtph_ps(_mm256_extracti128_si256(t, 1));
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
    __m256 e0, o0, e1, o1;
    decode_pair(_mm_loadu_si128((const __m128i *)bk), &e0, &o0);
    decode_pair(_mm_loadu_si128((const __m128i *)(bk + 16)), &e1, &o1);
    cm_tile_fma_k__avx2(mr, acc0, acc1, e0, e1, a + 2 * kp * as);
    cm_tile_fma_k__avx2(mr, acc0, acc1, o0, o1, a + (2 * kp + 1) * as);
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

/* 32 bytes (16 columns x 2 k, VNNI-2) -> fp32 k0 and k1 vectors of columns 0-7 and 8-15, times
 * 2^-8 (header: the same fp16 words as decode_pair) */
static inline __attribute__((always_inline)) void decode_half(const uint8_t *p, __m256 k0[2],
                                                              __m256 k1[2]) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i g = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)p), split);
  const __m256i sign = _mm256_set1_epi8((char)0x80);
  __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(g, 1), _mm256_set1_epi8(0x3f)),
                               _mm256_and_si256(g, sign));
  const __m256i nan = _mm256_cmpeq_epi8(_mm256_or_si256(g, sign), _mm256_set1_epi8(-1));
  hi = _mm256_or_si256(hi, _mm256_and_si256(nan, _mm256_set1_epi8(0x40)));
  const __m256i lo = _mm256_and_si256(_mm256_slli_epi16(g, 7), sign);
  /* vcvtph2ps from a register takes the shuffle port, which the byte shuffle and the unpacks
   * already load; from memory it does not: the words go through L1 */
  _Alignas(32) uint16_t words[32];
  _mm256_store_si256((__m256i *)words, _mm256_unpacklo_epi8(lo, hi));
  _mm256_store_si256((__m256i *)(words + 16), _mm256_unpackhi_epi8(lo, hi));
  __asm__ volatile("" ::: "memory"); /* keep the round trip: no lane extracts */
  k0[0] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)words));
  k0[1] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(words + 8)));
  k1[0] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(words + 16)));
  k1[1] = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(words + 24)));
}

static inline __attribute__((always_inline)) void decode_body(const int mr, size_t kc,
                                                              const float *restrict a, size_t as,
                                                              const uint8_t *restrict b,
                                                              const float *restrict scale,
                                                              float *restrict c, int accumulate) {
  __m256 acc[2][4]; /* [row][columns 8j..8j+7] */
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
      decode_half(bk + 32 * h, k0, k1);
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
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      float *out = c + r * CM_NR + 8 * j;
      const __m256 prior = accumulate ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
      _mm256_storeu_ps(out, _mm256_fmadd_ps(acc[r][j], _mm256_loadu_ps(scale + 8 * j), prior));
    }
}

void cm_fp8_gemm_decode_mrx32__avx2(size_t mr, size_t kc, const void *a, size_t as,
                                    const uint8_t *b, const float *scale, float *c,
                                    int accumulate) {
  CM_EXPECT((mr == 1 || mr == 2) && kc % 2 == 0 && as >= mr);
  if (mr == 1)
    decode_body(1, kc, (const float *)a, as, b, scale, c, accumulate);
  else
    decode_body(2, kc, (const float *)a, as, b, scale, c, accumulate);
}

static inline __attribute__((always_inline)) void gemm_f32b_half(const int mr, size_t kc,
                                                                 const float *restrict a, size_t as,
                                                                 const float *restrict b,
                                                                 float *restrict c, int accumulate,
                                                                 int col0) {
  __m256 acc0[MR], acc1[MR];
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
  CM_MR_SWITCH4(gemm_f32b_body, kc, (const float *)a, as, (const float *)b, c, accumulate)
}

void cm_fp8_to_f32__avx2(size_t kc, const uint8_t *b, void *out) {
  float *dst = (float *)out;
  for (size_t kp = 0; kp < kc / 2; kp++)
    for (int col0 = 0; col0 < CM_NR; col0 += 8) {
      __m256 e, o;
      decode_pair(_mm_loadu_si128((const __m128i *)(b + kp * 64 + col0 * 2)), &e, &o);
      _mm256_storeu_ps(dst + 2 * kp * CM_NR + col0, e);
      _mm256_storeu_ps(dst + (2 * kp + 1) * CM_NR + col0, o);
    }
}
