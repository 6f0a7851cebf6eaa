/*
 * The AVX-512 MXFP4 decoder shared by the avx512, avx512bf16 and amx kernels of
 * schemes/mxfp4/ (static inline, compiled with each includer's tier flags; include only
 * from files of the avx512 tier or its descendants). The fast route of common/mxfp4.h:
 * a vpermw looks up each code's word, a saturating subtraction from its row's scale word
 * leaves the exact bf16 bits.
 */
#ifndef CPUMOE_SCHEMES_MXFP4_DECODE_AVX512_H
#define CPUMOE_SCHEMES_MXFP4_DECODE_AVX512_H

#include <immintrin.h>

#include "common/mxfp4.h"
#include "common/tile-avx512.h"

/* the code words of common/mxfp4.h twice: vpermw's 32 entries (it also reads index bit 4,
 * which holds the other nibble's lowest bit) */
static const uint16_t cm_mxfp4_words32[32]
    __attribute__((aligned(64))) = {CM_MXFP4_CODE_WORDS, CM_MXFP4_CODE_WORDS};

static inline __attribute__((always_inline)) __m512i cm_mxfp4_table__avx512(void) {
  return _mm512_load_si512(cm_mxfp4_words32);
}

/* the scale words of 16 rows, each in both halves of its dword (k even and odd) */
static inline __attribute__((always_inline)) __m512i
cm_mxfp4_scale_words__avx512(const uint8_t *s16) {
  const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)s16));
  const __m512i a = _mm512_add_epi32(_mm512_slli_epi32(s, 7), _mm512_set1_epi32(0x8140));
  return _mm512_or_si512(a, _mm512_slli_epi32(a, 16));
}

/* 1 when every scale of the group lies in the fast route's range: (s - min) as unsigned
 * bytes is at most the width of the range exactly inside it */
static inline __attribute__((always_inline)) int cm_mxfp4_group_fast__avx512(
    const uint8_t *scales) {
  const __m256i off = _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)scales),
                                      _mm256_set1_epi8(CM_MXFP4_FAST_MIN));
  const __m256i width = _mm256_set1_epi8(CM_MXFP4_FAST_MAX - CM_MXFP4_FAST_MIN);
  return _mm256_cmpge_epu8_mask(width, off) == 0xffffffffu;
}

/* words whose bits 3..0 are the codes (low nibbles; the high nibbles after a shift by 4)
 * -> their exact bf16 bits, given the rows' scale words */
static inline __attribute__((always_inline)) __m512i cm_mxfp4_lookup__avx512(__m512i table,
                                                                             __m512i scale_words,
                                                                             __m512i x) {
  return _mm512_subs_epu16(scale_words, _mm512_permutexvar_epi16(x, table));
}

/* one k pair's 32 bytes -> bf16 of rows 0..15 (lo) and 16..31 (hi) in VNNI-2 order (word 2n
 * k even, 2n + 1 k odd), the 16-bit B tile's 128 bytes: vpmovzxbw puts byte j in word j */
static inline __attribute__((always_inline)) void cm_mxfp4_decode_kpair__avx512(
    const uint8_t *bk, __m512i table, __m512i a_lo, __m512i a_hi, __m512i *lo, __m512i *hi) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)bk));
  *lo = cm_mxfp4_lookup__avx512(table, a_lo, x);
  *hi = cm_mxfp4_lookup__avx512(table, a_hi, cm_srli_epi16_mul__avx512(x, 4));
}

/* One group (16 k pairs) into bf16 VNNI-2 [16][32][2] at dst: the fast route if the
 * group's scales allow it, else common/mxfp4.h's exact decoder. */
static inline __attribute__((always_inline)) void cm_mxfp4_decode_group__avx512(
    const uint8_t *b, const uint8_t *scales, __m512i table, uint16_t *dst) {
  if (!cm_mxfp4_group_fast__avx512(scales)) {
    cm_mxfp4_decode_group(b, scales, dst);
    return;
  }
  const __m512i a_lo = cm_mxfp4_scale_words__avx512(scales);
  const __m512i a_hi = cm_mxfp4_scale_words__avx512(scales + 16);
  for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp++) {
    __m512i lo, hi;
    cm_mxfp4_decode_kpair__avx512(b + kp * CM_MXFP4_KP_BYTES, table, a_lo, a_hi, &lo, &hi);
    _mm512_storeu_si512(dst + kp * 64, lo);
    _mm512_storeu_si512(dst + kp * 64 + 32, hi);
  }
}

#endif /* CPUMOE_SCHEMES_MXFP4_DECODE_AVX512_H */
