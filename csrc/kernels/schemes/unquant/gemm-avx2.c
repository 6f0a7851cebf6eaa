/*
 * AVX2 + FMA + F16C GEMM micro-kernels for 16-bit (bf16 / fp16) weights.
 *
 * C[mr][32] = A_panel[k][a_stride] x B_tile[k/2][32][2], mr <= 6 (layouts:
 * common/ukernels.h). The 32 columns are done as two passes of 16, each over
 * the whole k, so each C element is still one sequential FMA chain from +0.
 *
 * Tile 4 x 16 and why: per k pair two 32-byte B loads (8 columns x 2 k each)
 * widen to 4 ymm (even/odd k x two column groups); each row needs 2
 * accumulators; AVX2 has no embedded broadcast, so 2 ymm hold broadcast A.
 * 4 x 2 + 4 + 2 = 14 of 16 ymm registers; 16 FMAs per 4 widening ops.
 * Blocks of 5 and 6 rows take 6 x 16 (CM_TILE_MR_AVX2_16BIT): with 8 accumulators each FMA
 * chain gets exactly the 4-cycle latency x 2 ports it needs and no slack. 12 accumulators fit
 * when even and odd k are widened apart: 12 + 2 + 1 = 15 ymm, so nothing else may hold a
 * register across the loop. bf16 widens each k from its own load of the pair: a shift for even
 * k, an and with a mask read from memory each step (no register held) for odd k, 24 FMAs per 4
 * widening ops, of which only the 2 shifts take an FMA port (against a shift down and up for
 * odd k: Qwen3 M = 512 0.935, MXFP4's bf16 chunks 0.877, M = 64 even). fp16 gathers both
 * 8-column groups' even and odd halves (f16_halves) into an L1 buffer, from which vcvtph2ps
 * converts each half just before its FMAs (no lane extract); the gather's byte shuffle
 * control, like bf16's mask, is read from memory each step (step_constant). Against 4
 * rows, Qwen3 on the AMX Xeon capped to avx2: bf16 M = 512 0.954, M = 64 0.927; fp16 M = 512
 * 0.882, M = 64 0.942. The chains and their order are the same, so the bits are.
 *
 * Widening: bf16 is a shift / mask of each dword; fp16 gathers the even and odd
 * halves of each dword with one byte shuffle and a lane permute, then vcvtph2ps.
 *
 * Decode kernel (blocks of up to MR_DECODE = 2 rows, where the weights stream from memory
 * once and are the whole cost): all 32 columns in one pass, so the stream is read in memory
 * order, 128 bytes per k pair, both lines prefetched ahead (CM_DECODE_PF_*_AVX2). Per row 4
 * accumulators of 8 columns: 4 independent FMA chains, where the two-pass tile has 2 and
 * its 4-cycle FMA latency bounds a one-row block below the memory stream. Each 16-byte
 * quarter of the k pair is widened just before its FMAs: 2 rows x 4 accumulators + 4
 * broadcasts + 2 widened = 14 ymm. Same chains, same bits as the tile.
 */
#include <immintrin.h>

#include "common/tile-avx2.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX2_16BIT
#define CM_PREFETCH_KPAIRS 32
#define MR_DECODE 2

typedef enum { W_BF16, W_F16 } weight_kind;

/* the byte shuffle of f16_halves: per 128-bit lane, the even halves of the 4 dwords into the low
 * 8 bytes, the odd halves into the high 8 */
static const uint8_t cm_f16_split[32]
    __attribute__((aligned(32))) = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};

/* the odd-k halves of 8 bf16 dwords */
static const uint32_t cm_bf16_odd_mask[8]
    __attribute__((aligned(32))) = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                    0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};

/* A 32-byte constant read from memory at each use (a volatile load), for the 6-row tiles:
 * their 12 accumulators, 2 B vectors and a broadcast fill 15 of the 16 ymm, and a constant
 * hoisted out of the loop into the last one made GCC spill accumulators. */
static inline __attribute__((always_inline)) __m256i step_constant(const void *p) {
  return *(const volatile __m256i *)p;
}

/* 8 columns' fp16 k pairs (one dword each) -> their even-k words in the low 128 bits and their
 * odd-k words in the high 128, columns in order: the byte shuffle `split`, then a lane permute */
static inline __attribute__((always_inline)) __m256i f16_halves(__m256i w, __m256i split) {
  return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, split), 0xd8);
}

static inline __attribute__((always_inline)) void widen_pair(weight_kind kind, __m256i w,
                                                             __m256 *even, __m256 *odd) {
  if (kind == W_BF16) {
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *odd = _mm256_castsi256_ps(
        _mm256_and_si256(w, _mm256_load_si256((const __m256i *)cm_bf16_odd_mask)));
  } else {
    const __m256i t = f16_halves(w, _mm256_load_si256((const __m256i *)cm_f16_split));
    *even = _mm256_cvtph_ps(_mm256_castsi256_si128(t));
    *odd = _mm256_cvtph_ps(_mm256_extracti128_si256(t, 1));
  }
}

/* 16 columns starting at column `col0` of the 32-wide tile. */
static inline __attribute__((always_inline)) void gemm_half(const int mr, weight_kind kind,
                                                            size_t k, const float *restrict a,
                                                            size_t as, const uint16_t *restrict b,
                                                            float *restrict c, int accumulate,
                                                            int col0) {
  __m256 acc0[MR], acc1[MR];
  cm_tile_load__avx2(mr, acc0, acc1, c, col0, accumulate);
  for (size_t kp = 0; kp < k / 2; kp++) {
    const uint16_t *bk = b + kp * 64 + col0 * 2;
    /* software prefetch for the DRAM stream of decode (see gemm-avx512.c) */
    _mm_prefetch((const char *)(bk + CM_PREFETCH_KPAIRS * 64), _MM_HINT_T0);
    if (kind == W_BF16 && mr > CM_TILE_MR_AVX2) {
      /* even k, then odd k, each widened on its own from L1: 2 B registers live, not 4 */
      const __m256i w0 = _mm256_loadu_si256((const __m256i *)bk);
      const __m256i w1 = _mm256_loadu_si256((const __m256i *)(bk + 16));
      cm_tile_fma_k__avx2(mr, acc0, acc1, _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)),
                          _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), a + 2 * kp * as);
      /* odd k: the mask and-ed with each half from L1 (no FMA-port shift) */
      const __m256i odd_mask = step_constant(cm_bf16_odd_mask);
      cm_tile_fma_k__avx2(
          mr, acc0, acc1,
          _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)bk), odd_mask)),
          _mm256_castsi256_ps(
              _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(bk + 16)), odd_mask)),
          a + (2 * kp + 1) * as);
      continue;
    }
    if (kind == W_F16 && mr > CM_TILE_MR_AVX2) {
      /* the even and odd halves of both 8-column groups through L1, where vcvtph2ps converts
       * each half straight from memory (no lane extract) just before its FMAs: 2 B registers
       * live, not 4 */
      _Alignas(32) uint16_t halves[32];
      const __m256i split = step_constant(cm_f16_split);
      _mm256_store_si256((__m256i *)halves,
                         f16_halves(_mm256_loadu_si256((const __m256i *)bk), split));
      _mm256_store_si256((__m256i *)(halves + 16),
                         f16_halves(_mm256_loadu_si256((const __m256i *)(bk + 16)), split));
      __asm__("" : "+m"(halves)); /* keep the round trip through memory */
      cm_tile_fma_k__avx2(mr, acc0, acc1, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)halves)),
                          _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(halves + 16))),
                          a + 2 * kp * as);
      cm_tile_fma_k__avx2(
          mr, acc0, acc1, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(halves + 8))),
          _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(halves + 24))), a + (2 * kp + 1) * as);
      continue;
    }
    __m256 e0, o0, e1, o1;
    widen_pair(kind, _mm256_loadu_si256((const __m256i *)bk), &e0, &o0);
    widen_pair(kind, _mm256_loadu_si256((const __m256i *)(bk + 16)), &e1, &o1);
    cm_tile_fma_k__avx2(mr, acc0, acc1, e0, e1, a + 2 * kp * as);
    cm_tile_fma_k__avx2(mr, acc0, acc1, o0, o1, a + (2 * kp + 1) * as);
  }
  cm_tile_store__avx2(mr, acc0, acc1, c, col0);
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, weight_kind kind,
                                                            size_t k, const float *a, size_t as,
                                                            const uint16_t *b, float *c,
                                                            int accumulate) {
  gemm_half(mr, kind, k, a, as, b, c, accumulate, 0);
  gemm_half(mr, kind, k, a, as, b, c, accumulate, 16);
}

void cm_bf16_gemm_f32acc_mrx32__avx2(size_t mr, size_t k, const void *a, size_t as, const void *b,
                                     float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(k % 2 == 0 && as >= mr);
  CM_MR_SWITCH6(gemm_body, W_BF16, k, (const float *)a, as, (const uint16_t *)b, c, accumulate)
}

void cm_f16_gemm_f32acc_mrx32__avx2(size_t mr, size_t k, const void *a, size_t as, const void *b,
                                    float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(k % 2 == 0 && as >= mr);
  CM_MR_SWITCH6(gemm_body, W_F16, k, (const float *)a, as, (const uint16_t *)b, c, accumulate)
}

/* The decode kernel's widening of 8 columns' k pair at p. bf16 as the tile's. fp16 converts
 * straight from memory, 4 columns' pairs per vcvtph2ps (a load and a conversion, no
 * shuffle-port uop but the conversion's), then splits even and odd k with one vshufps each;
 * the 8 columns then come in the order 0, 1, 4, 5, 2, 3, 6, 7 (its own inverse), which the
 * accumulators keep and the load and store of C undo. */
static inline __attribute__((always_inline)) void widen_decode(weight_kind kind, const uint16_t *p,
                                                               __m256 *even, __m256 *odd) {
  if (kind == W_BF16) {
    widen_pair(kind, _mm256_loadu_si256((const __m256i *)p), even, odd);
  } else {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    *even = _mm256_shuffle_ps(lo, hi, 0x88);
    *odd = _mm256_shuffle_ps(lo, hi, 0xdd);
  }
}

/* C's 8 columns to and from the decode accumulators' order */
static inline __attribute__((always_inline)) __m256 decode_order(weight_kind kind, __m256 v) {
  return kind == W_BF16 ? v
                        : _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

/* All 32 columns of mr <= MR_DECODE rows in one pass (see the header). */
static inline __attribute__((always_inline)) void gemm_decode_body(const int mr, weight_kind kind,
                                                                   size_t k, const float *a,
                                                                   size_t as, const uint16_t *b,
                                                                   float *c, int accumulate) {
  __m256 acc[MR_DECODE][4];
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      acc[r][j] = accumulate ? decode_order(kind, _mm256_loadu_ps(c + r * CM_NR + 8 * j))
                             : _mm256_setzero_ps();
  for (size_t kp = 0; kp < k / 2; kp++) {
    const uint16_t *bk = b + kp * 64;
    cm_prefetch_ahead(bk, CM_DECODE_PF_L1_BYTES_AVX2, CM_DECODE_PF_L2_BYTES_AVX2, 2);
    __m256 x_even[MR_DECODE], x_odd[MR_DECODE];
#pragma GCC unroll 2
    for (int r = 0; r < mr; r++) {
      x_even[r] = _mm256_broadcast_ss(a + 2 * kp * as + r);
      x_odd[r] = _mm256_broadcast_ss(a + (2 * kp + 1) * as + r);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      __m256 even, odd;
      widen_decode(kind, bk + 16 * j, &even, &odd);
#pragma GCC unroll 2
      for (int r = 0; r < mr; r++) {
        acc[r][j] = _mm256_fmadd_ps(x_even[r], even, acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(x_odd[r], odd, acc[r][j]);
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      _mm256_storeu_ps(c + r * CM_NR + 8 * j, decode_order(kind, acc[r][j]));
}

#define CM_DECODE_SWITCH(kind)                                                              \
  CM_EXPECT(k % 2 == 0 && as >= mr && mr >= 1 && mr <= MR_DECODE);                          \
  if (mr == 1)                                                                              \
    gemm_decode_body(1, kind, k, (const float *)a, as, (const uint16_t *)b, c, accumulate); \
  else                                                                                      \
    gemm_decode_body(2, kind, k, (const float *)a, as, (const uint16_t *)b, c, accumulate);

void cm_bf16_gemm_decode_mrx32__avx2(size_t mr, size_t k, const void *a, size_t as, const void *b,
                                     float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_DECODE_SWITCH(W_BF16)
}

void cm_f16_gemm_decode_mrx32__avx2(size_t mr, size_t k, const void *a, size_t as, const void *b,
                                    float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_DECODE_SWITCH(W_F16)
}
