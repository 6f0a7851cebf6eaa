/*
 * AVX2 micro-kernels for INT4 W4A8 (contracts: common/ukernels.h, layout: common/int4.h):
 * unpacking packed blocks into s8 VNNI-4 tiles of w - zero, and the per-block fold of the
 * exact int32 sums into the fp32 tile. The integer GEMM between them is the INT8 tier's
 * (schemes/int8/gemm-avx2.c, exact int16 widening), so this tier has no in-register decode path.
 *
 * Unpacking: the first 32 bytes of a packed k-quad are dword lanes 0..7, whose low nibbles
 * are columns 0..7 and high nibbles columns 8..15; the next 32 bytes give columns 16..23
 * and 24..31. So each ymm splits into two natural 32-byte runs of the VNNI-4 tile, with no
 * lane shuffle: low = v & 15, high = (v >> 4) & 15, each minus its columns' zero points.
 */
#include <immintrin.h>
#include <string.h>

#include "common/int4.h"
#include "common/ukernels.h"

/* zero points of 8 columns, each repeated over the 4 bytes of its dword */
static inline __m256i zero_dwords(const int8_t *zero) {
  int64_t z;
  memcpy(&z, zero, 8);
  return _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z)),
                            _mm256_set1_epi32(0x01010101));
}

void cm_int4_unpack__avx2(const cm_int4_tile *w, size_t kb0, size_t nb, int8_t *dst) {
  const size_t bk = w->bk;
  const __m256i low_nibbles = _mm256_set1_epi8(15);
  for (size_t b = 0; b < nb; b++) {
    const size_t kb = kb0 + b;
    const uint8_t *block = w->blocks + kb * cm_int4_block_bytes(bk);
    const int8_t *zero = w->zeros + (kb / w->group_blocks) * CM_NR;
    __m256i z[4]; /* columns 0-7, 8-15, 16-23, 24-31 */
    for (int i = 0; i < 4; i++) z[i] = zero_dwords(zero + 8 * i);
    int8_t *out = dst + b * bk * CM_NR;
    for (size_t kq = 0; kq < bk / 4; kq++) {
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(block + kq * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        int8_t *o = out + kq * 4 * CM_NR + 64 * h;
        _mm256_storeu_si256((__m256i *)o, _mm256_sub_epi8(lo, z[2 * h]));
        _mm256_storeu_si256((__m256i *)(o + 32), _mm256_sub_epi8(hi, z[2 * h + 1]));
      }
    }
  }
}

void cm_int4_dequant_mrx32__avx2(size_t mr, const int32_t *restrict acc, const uint8_t *comp,
                                 const float *restrict scale, float *restrict c, int accumulate) {
  __m256i comp128[4];
  __m256 s[4];
  for (int i = 0; i < 4; i++) {
    comp128[i] = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(comp + 32 * i)), 7);
    s[i] = _mm256_loadu_ps(scale + 8 * i);
  }
  for (size_t r = 0; r < mr; r++)
    for (int i = 0; i < 4; i++) {
      const __m256i t = _mm256_loadu_si256((const __m256i *)(acc + r * CM_NR + 8 * i));
      const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(t, comp128[i]));
      float *out = c + r * CM_NR + 8 * i;
      const __m256 prior = accumulate ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
      _mm256_storeu_ps(out, _mm256_fmadd_ps(v, s[i], prior));
    }
}
