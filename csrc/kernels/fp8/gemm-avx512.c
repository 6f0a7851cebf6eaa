/*
 * AVX-512 kernels for FP8 (e4m3fn) W8A16: weights decoded exactly to fp32 and scaled per
 * 2-D block, fp32 FMA against fp32 activation panels (contracts: common/ukernels.h).
 *
 *   A panel: fp32 [kc][a_stride];  C: fp32 [mr][32], one FMA chain per element over k.
 *   B:       fp8 VNNI-2 [kc/2][32][2] (docs/FORMATS.md): per k pair 64 bytes, columns
 *            0..15 in bytes 0..31, 16..31 in 32..63; one 16-bit pair = 2 k of one column.
 *   scale:   fp32 [32], the block scale of each column for this chunk (the chunk never
 *            crosses a K block), times 2^8 (see below).
 *
 * Exact decoding: an e4m3 byte s.eeee.mmm moved into fp16 position (s at bit 15, e.m at
 * bits 13..7) is the fp16 number value * 2^-8 exactly, subnormals and zero included
 * (fp16 has 5 exponent bits, so every e4m3 value times 2^-8 is representable); vcvtph2ps
 * widens it exactly and the 2^8 rides in the scale. The NaN code (0x7f/0xff) is forced to
 * an fp16 NaN. So w = fp32(e4m3) * block_scale, rounded once: the scalar tier's bits.
 *
 * Two ways to use the weights, chosen by the pipeline, with identical results:
 *   decode  (few rows): cm_fp8_gemm_f32acc_mrx32 decodes in registers, nothing stored.
 *   prefill (many rows): cm_fp8_to_f32 decodes a chunk once into an L1-resident fp32
 *           buffer [kc][32], then cm_f32_gemm_f32acc_mrx32 runs every panel on it.
 * Tiles: decode 12 x 32 like the bf16 kernel (24 accumulators + 4 decoded B vectors);
 * the fp32-B kernel 12 x 32 with 2 B loads per k (24 accumulators + 2 B + broadcasts).
 */
#include <immintrin.h>

#include "common/ukernels.h"

#define MR 12

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

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const float *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const float *restrict scale,
                                                            float *restrict c, int accumulate) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    acc0[r] = accumulate ? _mm512_loadu_ps(c + r * CM_NR) : _mm512_setzero_ps();
    acc1[r] = accumulate ? _mm512_loadu_ps(c + r * CM_NR + 16) : _mm512_setzero_ps();
  }
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const uint8_t *bk = b + kp * 64;
    _mm_prefetch((const char *)(bk + 4096), _MM_HINT_T0); /* 4 KiB ahead, as bf16 */
    __m512 e0, o0, e1, o1;
    decode_pair(_mm256_loadu_si256((const __m256i *)bk), &e0, &o0);
    decode_pair(_mm256_loadu_si256((const __m256i *)(bk + 32)), &e1, &o1);
    e0 = _mm512_mul_ps(e0, s0), o0 = _mm512_mul_ps(o0, s0);
    e1 = _mm512_mul_ps(e1, s1), o1 = _mm512_mul_ps(o1, s1);
    const float *ae = a + 2 * kp * as, *ao = ae + as;
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      const __m512 x0 = _mm512_set1_ps(ae[r]);
      acc0[r] = _mm512_fmadd_ps(x0, e0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x0, e1, acc1[r]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      const __m512 x1 = _mm512_set1_ps(ao[r]);
      acc0[r] = _mm512_fmadd_ps(x1, o0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x1, o1, acc1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_ps(c + r * CM_NR, acc0[r]);
    _mm512_storeu_ps(c + r * CM_NR + 16, acc1[r]);
  }
}

static inline __attribute__((always_inline)) void gemm_f32b_body(const int mr, size_t kc,
                                                                 const float *restrict a, size_t as,
                                                                 const float *restrict b,
                                                                 float *restrict c,
                                                                 int accumulate) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    acc0[r] = accumulate ? _mm512_loadu_ps(c + r * CM_NR) : _mm512_setzero_ps();
    acc1[r] = accumulate ? _mm512_loadu_ps(c + r * CM_NR + 16) : _mm512_setzero_ps();
  }
  for (size_t k = 0; k < kc; k++) {
    const __m512 b0 = _mm512_loadu_ps(b + k * CM_NR), b1 = _mm512_loadu_ps(b + k * CM_NR + 16);
    const float *ak = a + k * as;
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      const __m512 x = _mm512_set1_ps(ak[r]);
      acc0[r] = _mm512_fmadd_ps(x, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, b1, acc1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_ps(c + r * CM_NR, acc0[r]);
    _mm512_storeu_ps(c + r * CM_NR + 16, acc1[r]);
  }
}

#define CM_CASES(body, ...)                \
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

void cm_fp8_gemm_f32acc_mrx32__avx512(size_t mr, size_t kc, const float *a, size_t as,
                                      const uint8_t *b, const float *scale, float *c,
                                      int accumulate) {
  CM_CASES(gemm_body, kc, a, as, b, scale, c, accumulate)
}

void cm_f32_gemm_f32acc_mrx32__avx512(size_t mr, size_t kc, const float *a, size_t as,
                                      const float *b, float *c, int accumulate) {
  CM_CASES(gemm_f32b_body, kc, a, as, b, c, accumulate)
}

void cm_fp8_to_f32__avx512(size_t kc, const uint8_t *b, const float *scale, float *dst) {
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    __m512 e0, o0, e1, o1;
    decode_pair(_mm256_loadu_si256((const __m256i *)(b + kp * 64)), &e0, &o0);
    decode_pair(_mm256_loadu_si256((const __m256i *)(b + kp * 64 + 32)), &e1, &o1);
    float *even = dst + 2 * kp * CM_NR, *odd = even + CM_NR;
    _mm512_storeu_ps(even, _mm512_mul_ps(e0, s0));
    _mm512_storeu_ps(even + 16, _mm512_mul_ps(e1, s1));
    _mm512_storeu_ps(odd, _mm512_mul_ps(o0, s0));
    _mm512_storeu_ps(odd + 16, _mm512_mul_ps(o1, s1));
  }
}
