/*
 * AVX2 micro-kernels for INT4 W4A8 (contracts: common/ukernels.h, layout: common/int4.h):
 * the decode-path GEMM that expands nibbles in registers, a panel's rows two at a time,
 * the unpacking of packed blocks into s8 VNNI-4 tiles of w - zero for the prefill path, and
 * the per-block fold of the exact int32 sums into the fp32 tile. The prefill path's integer
 * GEMM is the INT8 tier's (schemes/int8/gemm-avx2.c, exact int16 widening); on avx2 every
 * block takes the decode path instead (dispatch/config.c: twice the products per instruction,
 * the nibbles read again per row from L1), on avx2vnni the prefill path's vpdpbusd tile.
 *
 * Unpacking: the first 32 bytes of a packed k-quad are dword lanes 0..7, whose low nibbles
 * are columns 0..7 and high nibbles columns 8..15; the next 32 bytes give columns 16..23
 * and 24..31. So each ymm splits into two natural 32-byte runs of the VNNI-4 tile, with no
 * lane shuffle: low = v & 15, high = (v >> 4) & 15, each minus its columns' zero points.
 *
 * Decode (one row at a time; at decode the weights stream once and are the whole cost): the nibbles
 * are vpmaddubsw's unsigned operand as they are and the activations q = (q + 128) ^ 0x80 its
 * signed one, so each int16 lane is w0 q0 + w1 q1 with |.| <= 2 * 15 * 128 = 3840, exact and
 * never saturated. CM_INT4_I16_QUADS = 8 k-quads add up in int16 (|.| <= 30720 < 2^15)
 * before vpmaddwd with ones widens each column's sum to int32. Per 64 bytes of nibbles that
 * is 2 loads, 6 mask/shift ops, 4 vpmaddubsw and 4 vpaddw, plus the activation broadcast.
 * The loop around these block sums is int4/decode-avx2.h's: the zero points come in once per
 * block as zero x sum q with the row's block sums (moe/
 * panels.c), then one fmaf per column with the group scale: the exact block sum and the same
 * fold as the unpack path and the avx512 decode, so the same bits. Registers, one row: 4 int16,
 * 4 int32 and 4 fp32 accumulators (columns 0-7 ... 24-31) + 4 temporaries = 16 ymm. Two rows
 * share each load and nibble split (about a fifth fewer ops per row): 8 int16 accumulators, 2
 * activations, the split and the masks stay in registers, while the int32 sums (touched every
 * 8 k-quads) and the fp32 outputs (every block) go to the stack. Against one row at a time:
 * Qwen3 M = 512 on avx2 0.794 (docs/PERFORMANCE-HISTORY.md).
 */
#include <immintrin.h>
#include <string.h>

#include "common/int4.h"
#include "common/tile-avx2.h"
#include "common/ukernels.h"
#include "schemes/int4/decode-avx2.h" /* the decode loop around the block sums */

/* the zero points of 8 columns (cm_int4_zero_ints__avx2), each repeated over the 4 bytes of
 * its dword */
static inline __m256i zero_dwords(const int8_t *zero) {
  return _mm256_mullo_epi32(cm_int4_zero_ints__avx2(zero), _mm256_set1_epi32(0x01010101));
}

#define CM_INT4_I16_QUADS 8 /* k-quads summed in int16 before widening (header) */

/* One block's sum q w per column (decode-avx2.h): vpmaddubsw into int16 for up to
 * CM_INT4_I16_QUADS k-quads at a time, then vpmaddwd with ones into int32. */
static inline __attribute__((always_inline)) void block_sums_maddubs(
    const int rows, const uint8_t *block, size_t quads, const uint8_t *ab, size_t as,
    const cm_int4_readahead *ra, __m256i sum32[][4]) {
  const __m256i low_nibbles = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i flip_sign = _mm256_set1_epi8((char)0x80); /* q + 128 -> q */
  for (size_t kq0 = 0; kq0 < quads; kq0 += CM_INT4_I16_QUADS) {
    const size_t kq1 = kq0 + CM_INT4_I16_QUADS < quads ? kq0 + CM_INT4_I16_QUADS : quads;
    __m256i sum16[2][4];
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < 4; j++) sum16[r][j] = _mm256_setzero_si256();
    for (size_t kq = kq0; kq < kq1; kq++) {
      cm_int4_readahead_quad(ra, block, kq);
      __m256i x[2];
      for (int r = 0; r < rows; r++) {
        int32_t q4;
        memcpy(&q4, ab + (kq * as + (size_t)r) * 4, 4);
        x[r] = _mm256_xor_si256(_mm256_set1_epi32(q4), flip_sign);
      }
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(block + kq * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        for (int r = 0; r < rows; r++) {
          sum16[r][2 * h] = _mm256_add_epi16(sum16[r][2 * h], _mm256_maddubs_epi16(lo, x[r]));
          sum16[r][2 * h + 1] =
              _mm256_add_epi16(sum16[r][2 * h + 1], _mm256_maddubs_epi16(hi, x[r]));
        }
      }
    }
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < 4; j++)
        sum32[r][j] = _mm256_add_epi32(sum32[r][j], _mm256_madd_epi16(sum16[r][j], ones));
  }
}

void cm_int4_gemm_decode_1x32__avx2(size_t mr, const cm_int4_tile *w, size_t kb0, size_t nb,
                                    const uint8_t *a, size_t as, const int32_t *q_sums, float *c,
                                    int accumulate) {
  CM_EXPECT(mr >= 1 && mr <= CM_TILE_MR_AVX2);
  CM_INT4_DECODE_PANEL_AVX2(block_sums_maddubs, mr, w, kb0, nb, a, as, q_sums, c, accumulate);
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
                                 const float *restrict scale, float *restrict c, int accumulate,
                                 int last) {
  (void)last; /* columns in order throughout */
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
