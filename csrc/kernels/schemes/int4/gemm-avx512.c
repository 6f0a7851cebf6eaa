/*
 * AVX-512 VNNI micro-kernels for INT4 W4A8 (contracts: common/ukernels.h, layout:
 * common/int4.h): the decode-path GEMM that expands nibbles in registers, the unpacking of
 * blocks into s8 VNNI-4 tiles for the prefill path, and the per-block fold into fp32.
 *
 *   A panel: u8 [k/4][a_stride][4] (activations q + 128, one dword = 4 k of a row).
 *   B:       per k-quad one 64-byte vector v; (v & 15) holds columns 0-7 and 16-23,
 *            ((v >> 4) & 15) columns 8-15 and 24-31, as u8 dwords. vpdpbusd takes them as
 *            they are: the accumulators just carry the columns in that lane order ("lo" =
 *            0-7|16-23, "hi" = 8-15|24-31), and the C tile is permuted to and from natural
 *            order once per call (vshuff32x4).
 *   Prefill: the unpack stores each k-quad's lo and hi vectors as they are, so the B tile's
 *            columns, acc's and C's are in lane order (16 "columns" lo, then 16 hi) until the
 *            dequant of the reduction's last block puts C in column order. That saves the
 *            unpack two lane shuffles per k-quad; the dequant shuffles comp and the scales
 *            once per call instead, and each C row once per reduction.
 *   Exactness: every block sum is the exact integer sum q (w - zero), |q| <= 128 and
 *            |w - zero| <= 16, so at most 128*128*16 for bk <= 128: its fp32 conversion is
 *            exact (< 2^24) and both paths give the same bits.
 *
 * Decode tile mr x 32 with mr <= 4 and why: the nibbles are the unsigned operand of
 * vpdpbusd as they are and the activations the signed one (q = (q + 128) ^ 0x80), so a
 * k-quad costs and, shift, and for 64 weight bytes plus, per row, a broadcast, a xor and
 * two vpdpbusd; the zero points come in once per block as zero x sum q, with the per-row
 * block sums of q computed once per call by the pipeline (moe/panels.c). At mr = 1
 * that is 6 vector uops per 64 bytes of weights. Accumulators: 2 int32 + 2 fp32 per row,
 * 16 zmm at mr = 4, plus constants and temporaries: under 32 zmm, no spills. Larger blocks
 * of rows take the unpack path.
 *   This replaced subtracting the zero points from the nibbles (two more uops per k-quad)
 * and the +128 of the activations with column sums of w - zero (two more vpdpbusd).
 *
 * The decode GEMM never reads a block's comp: its read-ahead requests only nibble lines
 * (the same k-quad some blocks ahead). That keeps the 128 comp bytes of every 2 KiB block
 * (6%) out of the stream.
 */
#include <immintrin.h>
#include <string.h>

#include "common/int4.h"
#include "common/tile-avx2.h"   /* CM_MR_SWITCH4 */
#include "common/tile-avx512.h" /* cm_broadcast_dword__avx512 */
#include "common/ukernels.h"

#define MR_DECODE 4
/* Decode GEMM, bytes of nibbles requested ahead: prefetcht0 2 KiB and prefetcht1 4 KiB
 * ahead, rounded up to whole blocks (two blocks of 128 k for both). Both are faster than the
 * best single prefetcht0 distance; with the weights on huge pages 4 KiB into L2 is faster
 * than 8 (Qwen3 M = 1 on amx, paired A/Bs: 0.960 and 0.965, M = 4 0.974; the avx512 tier
 * 0.979; docs/PERFORMANCE-HISTORY.md). */
#define CM_INT4_PREFETCH_L1_BYTES 2048
#define CM_INT4_PREFETCH_L2_BYTES 4096
/* The unpack's own read-ahead into L1, on top of the share of the chunk that the GEMM calls
 * before it requested into L2 (as FP8's chunk decode): amx INT4 M=512 about 3 % faster
 * (docs/PERFORMANCE-HISTORY.md, "FP8 prefill on the AMX tier, taken apart"). */
#define CM_INT4_UNPACK_PREFETCH_BYTES 1024
/* The zero points and scales live in arrays of their own, which no read-ahead above
 * covers: the decode GEMM requests those of the group this many groups ahead into L1 (past
 * the tile's last group they are the next tile's). Without it, one thread streamed below
 * the plain read bandwidth. */
#define CM_INT4_META_GROUPS_AHEAD 4

/* natural 32 columns (c0: 0-15, c1: 16-31) <-> lane order (lo: 0-7|16-23, hi: 8-15|24-31);
 * the same 128-bit lane selection does both directions */
#define CM_SELECT_LOW_HALVES 0x44  /* lanes 0,1 of a then 0,1 of b */
#define CM_SELECT_HIGH_HALVES 0xEE /* lanes 2,3 of a then 2,3 of b */

/* zero points of the lo and hi lane orders as int32 lanes */
static inline __attribute__((always_inline)) void zero_dwords(const int8_t *zero, __m512i *lo,
                                                              __m512i *hi) {
  const __m128i z0 = _mm_loadu_si128((const __m128i *)zero);
  const __m128i z1 = _mm_loadu_si128((const __m128i *)(zero + 16));
  *lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(z0, z1));
  *hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(z0, z1));
}

/* the same, each byte repeated over its dword */
static inline __attribute__((always_inline)) void zero_lanes(const int8_t *zero, __m512i *lo,
                                                             __m512i *hi) {
  const __m512i spread = _mm512_set1_epi32(0x01010101);
  zero_dwords(zero, lo, hi);
  *lo = _mm512_mullo_epi32(*lo, spread);
  *hi = _mm512_mullo_epi32(*hi, spread);
}

/* the nibbles w of one packed k-quad as u8, in lo and hi lane order */
static inline __attribute__((always_inline)) void split_quad(const uint8_t *quad, __m512i *lo,
                                                             __m512i *hi) {
  const __m512i low_nibbles = _mm512_set1_epi8(15);
  const __m512i v = cm_load_once__avx512(quad);
  *lo = _mm512_and_si512(v, low_nibbles);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
}

/* w - zero of one packed k-quad, in lo and hi lane order */
static inline __attribute__((always_inline)) void expand_quad(const uint8_t *quad, __m512i zlo,
                                                              __m512i zhi, __m512i *lo,
                                                              __m512i *hi) {
  split_quad(quad, lo, hi);
  *lo = _mm512_sub_epi8(*lo, zlo);
  *hi = _mm512_sub_epi8(*hi, zhi);
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, const cm_int4_tile *w,
                                                            size_t kb0, size_t nb,
                                                            const uint8_t *restrict a, size_t as,
                                                            const int32_t *restrict q_sums,
                                                            float *restrict c, int accumulate) {
  const size_t bk = w->bk, block_bytes = cm_int4_block_bytes(bk);
  __m512 c_lo[MR_DECODE], c_hi[MR_DECODE];
  __m512i acc_lo[MR_DECODE], acc_hi[MR_DECODE];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    const __m512 c0 = accumulate ? _mm512_loadu_ps(c + r * CM_NR) : _mm512_setzero_ps();
    const __m512 c1 = accumulate ? _mm512_loadu_ps(c + r * CM_NR + 16) : _mm512_setzero_ps();
    c_lo[r] = _mm512_shuffle_f32x4(c0, c1, CM_SELECT_LOW_HALVES);
    c_hi[r] = _mm512_shuffle_f32x4(c0, c1, CM_SELECT_HIGH_HALVES);
  }
  /* read-ahead in whole blocks: the same k-quad that many blocks on, never a comp line */
  const size_t ahead_l1 = cm_int4_blocks_covering(CM_INT4_PREFETCH_L1_BYTES, bk);
  const size_t ahead_l2 = cm_int4_blocks_covering(CM_INT4_PREFETCH_L2_BYTES, bk);
  size_t group, group_left;
  cm_int4_group_of_block(kb0, w->group_blocks, &group, &group_left);
  const __m512i flip_sign = _mm512_set1_epi8((char)0x80); /* q + 128 -> q */
  for (size_t b = 0; b < nb; b++) {
    const uint8_t *block = w->blocks + (kb0 + b) * block_bytes;
    cm_int4_prefetch_group_meta(w, group, CM_INT4_META_GROUPS_AHEAD);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) acc_lo[r] = acc_hi[r] = _mm512_setzero_si512();
    const uint8_t *ab = a + b * bk * as;
    for (size_t kq = 0; kq < bk / 4; kq++) {
      _mm_prefetch((const char *)(block + ahead_l1 * block_bytes + kq * 64), _MM_HINT_T0);
      _mm_prefetch((const char *)(block + ahead_l2 * block_bytes + kq * 64), _MM_HINT_T1);
      __m512i w_lo, w_hi;
      split_quad(block + kq * 64, &w_lo, &w_hi);
      const uint8_t *ak = ab + kq * as * 4;
#pragma GCC unroll 4
      for (int r = 0; r < mr; r++) {
        const __m512i x = _mm512_xor_si512(cm_broadcast_dword__avx512(ak + 4 * r), flip_sign);
        acc_lo[r] = _mm512_dpbusd_epi32(acc_lo[r], w_lo, x);
        acc_hi[r] = _mm512_dpbusd_epi32(acc_hi[r], w_hi, x);
      }
    }
    /* sum q (w - zero) = sum q w - zero sum q */
    __m512i z_lo, z_hi;
    zero_dwords(w->zeros + group * CM_NR, &z_lo, &z_hi);
    const float *scale = w->scales + group * CM_NR;
    const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
    const __m512 s_lo = _mm512_shuffle_f32x4(s0, s1, CM_SELECT_LOW_HALVES);
    const __m512 s_hi = _mm512_shuffle_f32x4(s0, s1, CM_SELECT_HIGH_HALVES);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      const __m512i q_sum = _mm512_set1_epi32(q_sums[b * as + (size_t)r]);
      acc_lo[r] = _mm512_sub_epi32(acc_lo[r], _mm512_mullo_epi32(z_lo, q_sum));
      acc_hi[r] = _mm512_sub_epi32(acc_hi[r], _mm512_mullo_epi32(z_hi, q_sum));
      c_lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_lo[r]), s_lo, c_lo[r]);
      c_hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_hi[r]), s_hi, c_hi[r]);
    }
    if (--group_left == 0) group++, group_left = w->group_blocks;
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_ps(c + r * CM_NR, _mm512_shuffle_f32x4(c_lo[r], c_hi[r], CM_SELECT_LOW_HALVES));
    _mm512_storeu_ps(c + r * CM_NR + 16,
                     _mm512_shuffle_f32x4(c_lo[r], c_hi[r], CM_SELECT_HIGH_HALVES));
  }
}

void cm_int4_gemm_f32acc_mrx32__avx512(size_t mr, const cm_int4_tile *w, size_t kb0, size_t nb,
                                       const uint8_t *a, size_t as, const int32_t *q_sums, float *c,
                                       int accumulate) {
  CM_EXPECT(as >= mr);
  CM_MR_SWITCH4(gemm_body, w, kb0, nb, a, as, q_sums, c, accumulate)
}

void cm_int4_unpack__avx512(const cm_int4_tile *w, size_t kb0, size_t nb, int8_t *dst) {
  const size_t bk = w->bk;
  for (size_t b = 0; b < nb; b++) {
    const size_t kb = kb0 + b;
    const uint8_t *block = w->blocks + kb * cm_int4_block_bytes(bk);
    __m512i zlo, zhi;
    zero_lanes(w->zeros + (kb / w->group_blocks) * CM_NR, &zlo, &zhi);
    int8_t *out = dst + b * bk * CM_NR;
    for (size_t kq = 0; kq < bk / 4; kq++) {
      __m512i wlo, whi;
      /* into L2 by the pipeline's GEMM calls (schemes/int4/scheme.c), into L1 here */
      cm_prefetch_ahead(block + kq * 64, CM_INT4_UNPACK_PREFETCH_BYTES, 0, 1);
      expand_quad(block + kq * 64, zlo, zhi, &wlo, &whi);
      _mm512_storeu_si512(out + kq * 128, wlo); /* lane order: see the header */
      _mm512_storeu_si512(out + kq * 128 + 64, whi);
    }
  }
}

/* acc and C in lane order (lo in elements 0-15, hi in 16-31), C in column order after the
 * last block */
void cm_int4_dequant_mrx32__avx512(size_t mr, const int32_t *restrict acc, const uint8_t *comp,
                                   const float *restrict scale, float *restrict c, int accumulate,
                                   int last) {
  const __m512i n0 = _mm512_loadu_si512(comp), n1 = _mm512_loadu_si512(comp + 64);
  const __m512i comp_lo = _mm512_slli_epi32(_mm512_shuffle_i64x2(n0, n1, CM_SELECT_LOW_HALVES), 7);
  const __m512i comp_hi = _mm512_slli_epi32(_mm512_shuffle_i64x2(n0, n1, CM_SELECT_HIGH_HALVES), 7);
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  const __m512 s_lo = _mm512_shuffle_f32x4(s0, s1, CM_SELECT_LOW_HALVES);
  const __m512 s_hi = _mm512_shuffle_f32x4(s0, s1, CM_SELECT_HIGH_HALVES);
  for (size_t r = 0; r < mr; r++) {
    float *cr = c + r * CM_NR;
    const __m512i t_lo = _mm512_loadu_si512(acc + r * CM_NR);
    const __m512i t_hi = _mm512_loadu_si512(acc + r * CM_NR + 16);
    const __m512 p_lo = accumulate ? _mm512_loadu_ps(cr) : _mm512_setzero_ps();
    const __m512 p_hi = accumulate ? _mm512_loadu_ps(cr + 16) : _mm512_setzero_ps();
    const __m512 v_lo =
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t_lo, comp_lo)), s_lo, p_lo);
    const __m512 v_hi =
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t_hi, comp_hi)), s_hi, p_hi);
    if (last) {
      _mm512_storeu_ps(cr, _mm512_shuffle_f32x4(v_lo, v_hi, CM_SELECT_LOW_HALVES));
      _mm512_storeu_ps(cr + 16, _mm512_shuffle_f32x4(v_lo, v_hi, CM_SELECT_HIGH_HALVES));
    } else {
      _mm512_storeu_ps(cr, v_lo);
      _mm512_storeu_ps(cr + 16, v_hi);
    }
  }
}
