/*
 * AVX-512 kernels for FP8 (e4m3fn) W8A16: weights decoded exactly to fp32 and scaled per
 * 2-D block, fp32 FMA against fp32 activation panels (contracts: common/ukernels.h).
 *
 *   A panel: fp32 [kc][a_stride];  C: fp32 [mr][32], one FMA chain per element over k.
 *   B:       fp8 VNNI-2 [kc/2][32][2] (docs/FORMATS.md): per k pair 64 bytes, columns
 *            0..15 in bytes 0..31, 16..31 in 32..63; one 16-bit pair = 2 k of one column.
 *   scale:   fp32 [32], the block scale of each column for this chunk (the chunk never
 *            crosses a K block).
 *
 * Exact decoding: an e4m3 byte s.eeee.mmm moved into fp16 position (s at bit 15, e.m at
 * bits 13..7) is the fp16 number value * 2^-8 exactly, subnormals and zero included
 * (fp16 has 5 exponent bits, so every e4m3 value times 2^-8 is representable); vcvtph2ps
 * widens it exactly and a multiply by 2^8 (exact) restores the value. The NaN code (0x7f/0xff) is
 * forced to an fp16 NaN. So w = fp32(e4m3) * block_scale, rounded once: the scalar tier's bits.
 *
 * Fast exact decoding (the common case): the byte's magnitude shifted to fp32 bits 20..26
 * and its sign to bit 31 is the fp32 number value * 2^-120 (exponents 1..15 land in the
 * normal range; e = 0 gives the exact denormals m * 2^-129), and the 2^120 rides in the
 * scale while scale * 2^120 stays finite (scale < 2^8, checked once per call): 9 integer
 * ops per 32 weights instead of the fp16 route's ~20. A k pair containing a NaN code (NaN
 * must stay NaN) or a subnormal code (its fast bits would be an fp32 denormal: a microcode
 * assist, measured ~10x slower) takes the fp16 route; both are rare in real weights (zero
 * is neither). Both routes give the same product value * scale, rounded once.
 *
 * Two ways to use the weights, chosen by the pipeline, with identical results:
 *   decode  (few rows): cm_fp8_gemm_f32acc_mrx32 decodes in registers, nothing stored.
 *   prefill (many rows): cm_fp8_to_f32 decodes a chunk once into an L1-resident fp32
 *           buffer [kc][32], then cm_f32_gemm_f32acc_mrx32 runs every panel on it.
 * Tiles: decode 12 x 32 like the bf16 kernel (24 accumulators + 4 decoded B vectors);
 * the fp32-B kernel 12 x 32 with 2 B loads per k (24 accumulators + 2 B + broadcasts).
 */
#include <immintrin.h>

#include "common/tile-avx512.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX512

/* 32 bytes (16 columns x 2 k) -> fp32 even-k and odd-k vectors, times 2^-8 */
static inline __attribute__((always_inline)) void decode_pair(__m256i bytes, __m512 *even,
                                                              __m512 *odd) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes); /* dword j = (k even, k odd) of column j */
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
  __m512i h = _mm512_or_si512(_mm512_slli_epi16(mag, 7),
                              _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7c00)));
  *even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
  *odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
}

/* 32 bytes (16 columns x 2 k), no NaN code -> even/odd k as fp32 value * 2^-120 */
static inline __attribute__((always_inline)) void decode_pair_fast(__m256i bytes, __m512 *even,
                                                                   __m512 *odd) {
  const __m512i d = _mm512_cvtepu16_epi32(bytes); /* dword j: byte0 = k even, byte1 = k odd */
  const __m512i mag = _mm512_set1_epi32(0x07f00000), sign = _mm512_set1_epi32((int)0x80000000u);
  const __m512i te = _mm512_slli_epi32(d, 24), to = _mm512_slli_epi32(d, 16);
  /* (t >> 4) & mag | t & sign */
  *even = _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(te, 4), mag), te, sign, 0xf8));
  *odd = _mm512_castsi512_ps(
      _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(to, 4), mag), to, sign, 0xf8));
}

/* 64 bytes of one k pair -> four fp32 vectors times `scale`; the fast route when the pair
 * holds no NaN code and `fast` (scale * 2^120 finite), else the fp16 route. */
static inline __attribute__((always_inline)) void decode_kpair(const uint8_t *bk, int fast,
                                                               __m512 s0f, __m512 s1f, __m512 s0,
                                                               __m512 s1, __m512 *e0, __m512 *o0,
                                                               __m512 *e1, __m512 *o1) {
  const __m512i raw = _mm512_loadu_si512(bk);
  const __m512i mag = _mm512_and_si512(raw, _mm512_set1_epi8(0x7f));
  /* NaN (mag 0x7f) or subnormal (mag 1..7: its fast bits would be an fp32 denormal, and
   * denormal operands cost a microcode assist, ~10x slower): take the fp16 route */
  const __mmask64 special =
      _mm512_cmpeq_epi8_mask(mag, _mm512_set1_epi8(0x7f)) |
      _mm512_cmplt_epu8_mask(_mm512_sub_epi8(mag, _mm512_set1_epi8(1)), _mm512_set1_epi8(7));
  if (fast && !special) {
    decode_pair_fast(_mm512_castsi512_si256(raw), e0, o0);
    decode_pair_fast(_mm512_extracti64x4_epi64(raw, 1), e1, o1);
    *e0 = _mm512_mul_ps(*e0, s0f), *o0 = _mm512_mul_ps(*o0, s0f);
    *e1 = _mm512_mul_ps(*e1, s1f), *o1 = _mm512_mul_ps(*o1, s1f);
  } else {
    const __m512 k256 = _mm512_set1_ps(256.0f); /* value * 2^-8 -> value, exact */
    decode_pair(_mm512_castsi512_si256(raw), e0, o0);
    decode_pair(_mm512_extracti64x4_epi64(raw, 1), e1, o1);
    *e0 = _mm512_mul_ps(_mm512_mul_ps(*e0, k256), s0);
    *o0 = _mm512_mul_ps(_mm512_mul_ps(*o0, k256), s0);
    *e1 = _mm512_mul_ps(_mm512_mul_ps(*e1, k256), s1);
    *o1 = _mm512_mul_ps(_mm512_mul_ps(*o1, k256), s1);
  }
}

/* the fast route needs scale * 2^120, finite while |scale| < 2^8 */
static inline int fast_scales(const float *scale, __m512 *s0f, __m512 *s1f) {
  const __m512 k = _mm512_set1_ps(0x1p120f), lim = _mm512_set1_ps(0x1p8f);
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  *s0f = _mm512_mul_ps(s0, k), *s1f = _mm512_mul_ps(s1, k);
  const __mmask16 ok0 = _mm512_cmp_ps_mask(_mm512_abs_ps(s0), lim, _CMP_LT_OQ);
  const __mmask16 ok1 = _mm512_cmp_ps_mask(_mm512_abs_ps(s1), lim, _CMP_LT_OQ);
  return ok0 == 0xffff && ok1 == 0xffff;
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const float *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const float *restrict scale,
                                                            float *restrict c, int accumulate) {
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, accumulate);
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  __m512 s0f, s1f;
  const int fast = fast_scales(scale, &s0f, &s1f);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const uint8_t *bk = b + kp * 64;
    _mm_prefetch((const char *)(bk + 4096), _MM_HINT_T0); /* 4 KiB ahead, as bf16 */
    __m512 e0, o0, e1, o1;
    decode_kpair(bk, fast, s0f, s1f, s0, s1, &e0, &o0, &e1, &o1);
    cm_tile_fma_k__avx512(mr, acc0, acc1, e0, e1, a + 2 * kp * as);
    cm_tile_fma_k__avx512(mr, acc0, acc1, o0, o1, a + (2 * kp + 1) * as);
  }
  cm_tile_store__avx512(mr, acc0, acc1, c);
}

static inline __attribute__((always_inline)) void gemm_f32b_body(const int mr, size_t kc,
                                                                 const float *restrict a, size_t as,
                                                                 const float *restrict b,
                                                                 float *restrict c,
                                                                 int accumulate) {
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, accumulate);
  for (size_t k = 0; k < kc; k++)
    cm_tile_fma_k__avx512(mr, acc0, acc1, _mm512_loadu_ps(b + k * CM_NR),
                          _mm512_loadu_ps(b + k * CM_NR + 16), a + k * as);
  cm_tile_store__avx512(mr, acc0, acc1, c);
}

void cm_fp8_gemm_f32acc_mrx32__avx512(size_t mr, size_t kc, const float *a, size_t as,
                                      const uint8_t *b, const float *scale, float *c,
                                      int accumulate) {
  CM_MR_SWITCH12(gemm_body, kc, a, as, b, scale, c, accumulate)
}

void cm_f32_gemm_f32acc_mrx32__avx512(size_t mr, size_t kc, const float *a, size_t as,
                                      const float *b, float *c, int accumulate) {
  CM_MR_SWITCH12(gemm_f32b_body, kc, a, as, b, c, accumulate)
}

void cm_fp8_to_f32__avx512(size_t kc, const uint8_t *b, const float *scale, float *dst) {
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  __m512 s0f, s1f;
  const int fast = fast_scales(scale, &s0f, &s1f);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    __m512 e0, o0, e1, o1;
    decode_kpair(b + kp * 64, fast, s0f, s1f, s0, s1, &e0, &o0, &e1, &o1);
    float *even = dst + 2 * kp * CM_NR, *odd = even + CM_NR;
    _mm512_storeu_ps(even, e0);
    _mm512_storeu_ps(even + 16, e1);
    _mm512_storeu_ps(odd, o0);
    _mm512_storeu_ps(odd + 16, o1);
  }
}
