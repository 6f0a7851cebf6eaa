/*
 * The INT4 decode GEMM of one or two rows on 256-bit vectors, which the tiers' kernels run
 * over a panel's rows, two at a time (contract: cm_gemm_int4_fn, common/
 * ukernels.h; layout: common/int4.h), written once for the tiers that differ only in how a
 * block's integer sums are formed: avx2 (vpmaddubsw into int16, int4/gemm-avx2.c) and
 * avx2vnni (vpdpbusd into int32, int4/gemm-avx2vnni.c). Include only from files compiled
 * with the avx2 tier's flags (or more).
 *
 * Per block of bk k: block_sums gives sum32[j] = sum_k q[k] w[k][n] for columns 8j..8j+7
 * (exact int32), then s = sum32 - zero q_sum (the row's block sum, moe/panels.c) and one fmaf
 * per column with the group scale: the exact block sum and the fold of the unpack path and the
 * avx512 decode, so every tier's bits. Read-ahead: nibble bytes ahead into L1 and L2 (tile-
 * avx2.h's decode distances) rounded up to whole blocks, and the zero points and scales
 * CM_INT4_META_GROUPS_AHEAD groups ahead, as int4/gemm-avx512.c.
 * Registers: 4 fp32 outputs, 4 int32 sums, the block-sum function's own.
 */
#ifndef CPUMOE_SCHEMES_INT4_DECODE_AVX2_H
#define CPUMOE_SCHEMES_INT4_DECODE_AVX2_H

#include <immintrin.h>
#include <string.h>

#include "common/int4.h"
#include "common/tile-avx2.h"
#include "common/ukernels.h"

#define CM_INT4_META_GROUPS_AHEAD 4

/* zero points of 8 columns as int32 lanes */
static inline __m256i cm_int4_zero_ints__avx2(const int8_t *zero) {
  int64_t z;
  memcpy(&z, zero, 8);
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z));
}

/* how far ahead of the block being summed its k-quads are prefetched, in block bytes */
typedef struct cm_int4_readahead {
  size_t l1_bytes, l2_bytes;
} cm_int4_readahead;

/* k-quad kq's 64 bytes, that far ahead of `block` */
static inline __attribute__((always_inline)) void cm_int4_readahead_quad(
    const cm_int4_readahead *ra, const uint8_t *block, size_t kq) {
  _mm_prefetch((const char *)(block + ra->l1_bytes + kq * 64), _MM_HINT_T0);
  _mm_prefetch((const char *)(block + ra->l2_bytes + kq * 64), _MM_HINT_T1);
}

/* The body of a cm_gemm_int4_fn for `rows` (1 or 2, a constant) rows from a, q_sums and c,
 * with block_sums(rows, block, quads, ab, as, &ra, sum32) adding one block's sums of each row
 * into sum32[rows][4] (a static always_inline function). */
#define CM_INT4_DECODE_ROWS_AVX2(rows, block_sums, w, kb0, nb, a, as, q_sums, c, accumulate)    \
  do {                                                                                          \
    const size_t bk_ = (w)->bk, block_bytes_ = cm_int4_block_bytes(bk_);                        \
    const cm_int4_readahead ra_ = {                                                             \
        cm_int4_blocks_covering(CM_DECODE_PF_L1_BYTES_AVX2, bk_) * block_bytes_,                \
        cm_int4_blocks_covering(CM_DECODE_PF_L2_BYTES_AVX2, bk_) * block_bytes_};               \
    __m256 out_[rows][4];                                                                       \
    for (int r_ = 0; r_ < (rows); r_++)                                                         \
      for (int j_ = 0; j_ < 4; j_++)                                                            \
        out_[r_][j_] =                                                                          \
            (accumulate) ? _mm256_loadu_ps((c) + r_ * CM_NR + 8 * j_) : _mm256_setzero_ps();    \
    size_t group_, group_left_;                                                                 \
    cm_int4_group_of_block((kb0), (w)->group_blocks, &group_, &group_left_);                    \
    for (size_t b_ = 0; b_ < (nb); b_++) {                                                      \
      const uint8_t *block_ = (w)->blocks + ((kb0) + b_) * block_bytes_;                        \
      cm_int4_prefetch_group_meta((w), group_, CM_INT4_META_GROUPS_AHEAD);                      \
      __m256i sum32_[rows][4];                                                                  \
      for (int r_ = 0; r_ < (rows); r_++)                                                       \
        for (int j_ = 0; j_ < 4; j_++) sum32_[r_][j_] = _mm256_setzero_si256();                 \
      block_sums((rows), block_, bk_ / 4, (a) + b_ * bk_ * (as), (as), &ra_, sum32_);           \
      /* sum q (w - zero) = sum q w - zero sum q, then one fmaf per column */                   \
      const int8_t *zero_ = (w)->zeros + group_ * CM_NR;                                        \
      const float *scale_ = (w)->scales + group_ * CM_NR;                                       \
      for (int r_ = 0; r_ < (rows); r_++) {                                                     \
        const __m256i q_sum_ = _mm256_set1_epi32((q_sums)[b_ * (as) + r_]);                     \
        for (int j_ = 0; j_ < 4; j_++) {                                                        \
          const __m256i exact_ = _mm256_sub_epi32(                                              \
              sum32_[r_][j_],                                                                   \
              _mm256_mullo_epi32(cm_int4_zero_ints__avx2(zero_ + 8 * j_), q_sum_));             \
          out_[r_][j_] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact_),                            \
                                         _mm256_loadu_ps(scale_ + 8 * j_), out_[r_][j_]);       \
        }                                                                                       \
      }                                                                                         \
      if (--group_left_ == 0) group_++, group_left_ = (w)->group_blocks;                        \
    }                                                                                           \
    for (int r_ = 0; r_ < (rows); r_++)                                                         \
      for (int j_ = 0; j_ < 4; j_++) _mm256_storeu_ps((c) + r_ * CM_NR + 8 * j_, out_[r_][j_]); \
  } while (0)

/* A panel of mr rows, two at a time (the block sums share each load and nibble split) and the
 * last alone when mr is odd: the body of the tiers' cm_gemm_int4_fn. */
#define CM_INT4_DECODE_PANEL_AVX2(block_sums, mr, w, kb0, nb, a, as, q_sums, c, accumulate)  \
  do {                                                                                       \
    size_t r0_ = 0;                                                                          \
    for (; r0_ + 2 <= (mr); r0_ += 2)                                                        \
      CM_INT4_DECODE_ROWS_AVX2(2, block_sums, w, kb0, nb, (a) + 4 * r0_, as, (q_sums) + r0_, \
                               (c) + r0_ * CM_NR, accumulate);                               \
    if (r0_ < (mr))                                                                          \
      CM_INT4_DECODE_ROWS_AVX2(1, block_sums, w, kb0, nb, (a) + 4 * r0_, as, (q_sums) + r0_, \
                               (c) + r0_ * CM_NR, accumulate);                               \
  } while (0)

#endif /* CPUMOE_SCHEMES_INT4_DECODE_AVX2_H */
