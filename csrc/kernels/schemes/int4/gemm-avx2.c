/*
 * AVX2 micro-kernels for INT4 W4A8 (contracts: common/ukernels.h, layout: common/int4.h):
 * the decode-path GEMM that expands nibbles in registers, a panel's rows two at a time,
 * the unpacking of packed blocks into s8 VNNI-4 tiles of w - zero for the prefill path, and
 * the prefill path's GEMM on those tiles, and the per-block fold of the exact int32 sums into
 * the fp32 tile. Blocks of up to 2 rows take the decode path, larger ones the prefill path
 * (dispatch/config.c); avx2vnni runs its own vpdpbusd tile on the unpacked tiles instead.
 *
 * Prefill GEMM (cm_int4_unpacked_gemm_s32acc_mrx32__avx2): an unpacked tile holds w - zero,
 * |.| <= 15, so vpmaddubsw can take it as its signed operand and the u8 activations (q + 128)
 * as the unsigned one: each int16 lane is a0 w0 + a1 w1 with |.| <= 2 * 255 * 15 = 7650,
 * exact, and CM_INT4_TILE_I16_QUADS = 4 k-quads add up in int16 (|.| <= 30600 < 2^15) before
 * vpmaddwd with ones widens them. Its sums equal the u8 x s8 GEMM's, which full-range int8
 * needs widened to int16 for vpmaddwd (int8/gemm-avx2.c): half the products per instruction.
 * A row at a time, the weights as the instruction's memory operand (the tile stays in L1):
 * per k-quad one broadcast, 4 vpmaddubsw and 4 vpaddw, and per 4 quads 4 vpmaddwd and 4 vpaddd.
 * No nibble split per row pair as in the decode kernel: Qwen3 M = 512 0.831x the time of every
 * block on the decode kernel.
 *
 * Unpacking: the first 32 bytes of a packed k-quad are dword lanes 0..7, whose low nibbles
 * are columns 0..7 and high nibbles columns 8..15; the next 32 bytes give columns 16..23
 * and 24..31. So each ymm splits into two natural 32-byte runs of the VNNI-4 tile, with no
 * lane shuffle: low = v & 15, high = (v >> 4) & 15, each minus its columns' zero points.
 *
 * Decode (at decode the weights stream once and are the whole cost): the nibbles
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
 * Qwen3 M = 512 on avx2 0.794 (docs/PERFORMANCE-HISTORY.md). The int16 sums are pinned to
 * their registers after each update (cm_keep_in_registers2__avx2): without it GCC spilled two
 * of them and copied the rest at every quad (time level, fewer instructions).
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
          cm_keep_in_registers2__avx2(&sum16[r][2 * h], &sum16[r][2 * h + 1]);
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

#define CM_INT4_TILE_I16_QUADS 4 /* k quads summed in int16 before widening (header) */

/* sum16[j] += the products of one k quad of a row (4 u8 at a) and columns 8j..8j+7 of b */
static inline __attribute__((always_inline)) void unpacked_quad(const uint8_t *a, const int8_t *b,
                                                                __m256i sum16[4]) {
  int32_t a4;
  memcpy(&a4, a, 4);
  const __m256i x = _mm256_set1_epi32(a4);
  for (int j = 0; j < 4; j++)
    sum16[j] = _mm256_add_epi16(
        sum16[j], _mm256_maddubs_epi16(x, _mm256_loadu_si256((const __m256i *)(b + 32 * j))));
  cm_keep_in_registers2__avx2(&sum16[0], &sum16[1]);
  cm_keep_in_registers2__avx2(&sum16[2], &sum16[3]);
}

/* One row of the unpack path's u8 x s8 GEMM on an unpacked tile (|w - zero| <= 15): the
 * activations (u8) are vpmaddubsw's unsigned operand, broadcast, and the weights its signed
 * one, read from L1 by the instruction; 4 int16 sums, 4 int32 sums, x: 9 ymm. The int16 stage
 * is a fixed run of CM_INT4_TILE_I16_QUADS quads (GCC copies the sums of a loop of varying
 * length through other registers at every step), the rest one quad at a time. */
static inline __attribute__((always_inline)) void unpacked_row(size_t quads, const uint8_t *a,
                                                               size_t as, const int8_t *b,
                                                               int32_t *acc, int accumulate) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum32[4];
  for (int j = 0; j < 4; j++)
    sum32[j] =
        accumulate ? _mm256_loadu_si256((const __m256i *)(acc + 8 * j)) : _mm256_setzero_si256();
  size_t kq = 0;
  for (; kq + CM_INT4_TILE_I16_QUADS <= quads; kq += CM_INT4_TILE_I16_QUADS) {
    __m256i sum16[4];
    for (int j = 0; j < 4; j++) sum16[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int i = 0; i < CM_INT4_TILE_I16_QUADS; i++)
      unpacked_quad(a + (kq + (size_t)i) * as * 4, b + (kq + (size_t)i) * 4 * CM_NR, sum16);
    for (int j = 0; j < 4; j++)
      sum32[j] = _mm256_add_epi32(sum32[j], _mm256_madd_epi16(sum16[j], ones));
  }
  for (; kq < quads; kq++) {
    __m256i sum16[4];
    for (int j = 0; j < 4; j++) sum16[j] = _mm256_setzero_si256();
    unpacked_quad(a + kq * as * 4, b + kq * 4 * CM_NR, sum16);
    for (int j = 0; j < 4; j++)
      sum32[j] = _mm256_add_epi32(sum32[j], _mm256_madd_epi16(sum16[j], ones));
  }
  for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(acc + 8 * j), sum32[j]);
}

void cm_int4_unpacked_gemm_s32acc_mrx32__avx2(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                              const int8_t *b, int32_t *acc, int accumulate,
                                              cm_prefetch prefetch) {
  CM_EXPECT(kc % 4 == 0 && as >= mr);
  cm_prefetch_cursor pf = cm_prefetch_begin(prefetch); /* a share per row */
  for (size_t r = 0; r < mr; r++) {
    cm_prefetch_step(&pf, mr);
    unpacked_row(kc / 4, a + 4 * r, as, b, acc + r * CM_NR, accumulate);
  }
  cm_prefetch_finish(&pf);
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
