/*
 * AVX-512 GEMM micro-kernels for 16-bit (bf16 / fp16) weights, fp32 FMA.
 *
 * C[mr][32] = A_panel[k][a_stride] x B_tile[k/2][32][2], mr <= 12.
 *   A panel: fp32, one strip of a_stride floats per k (token rows interleaved).
 *   B tile:  VNNI-2, 128 bytes per k pair: columns 0..15 in bytes 0..63, 16..31 in
 *            64..127, each dword holding (k even, k odd) of one column.
 *   C tile:  fp32 [mr][32].
 *
 * Tile 12 x 32 and why: per k pair the two 64-byte B loads widen to 4 fp32
 * vectors (even/odd k x two column halves); each row needs 2 accumulators.
 * 12 rows x 2 + 4 B vectors + 1 mask = 29 of 32 zmm registers. Per k pair that is
 * 48 FMAs (A broadcast from memory, folded into the FMA) against 4 widening ops,
 * so at most ~8% of the FMA ports go to conversion; 24 independent accumulators
 * cover the 4-cycle FMA latency on two ports.
 *
 * Widening: bf16 -> fp32 is a shift (even k) or a mask (odd k) of each dword.
 * fp16 -> fp32 narrows each half of the dwords with vpmovdw, then vcvtph2ps.
 * Both are exact. Every C element is one sequential FMA chain over k, starting
 * from +0: the same bits as the scalar tier.
 */
#include <immintrin.h>

#include "common/tile-avx512.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX512
/* Decode prefetch, bytes of weights ahead: both lines of a k pair 2 KiB ahead into L1
 * (prefetcht0) and 3.5 KiB ahead into L2 (prefetcht1): faster at decode than 4 KiB into L1
 * only, the best single distance. Into L2, 3.5 KiB against the 8 that were here: Qwen3 bf16
 * M=1 0.893x the time (3 KiB 0.905x), both settings in one process
 * (docs/PERFORMANCE-HISTORY.md, "Shorter read-ahead for bf16 and MXFP4 decode"). */
#define CM_PREFETCH_L1_BYTES 2048
#define CM_PREFETCH_L2_BYTES 3584

typedef enum { W_BF16, W_F16 } weight_kind;

static inline __attribute__((always_inline)) void widen_pair(weight_kind kind, __m512i w,
                                                             __m512 *even, __m512 *odd) {
  if (kind == W_BF16) {
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
  } else {
    *even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    *odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
  }
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, weight_kind kind,
                                                            size_t k, const float *restrict a,
                                                            size_t as, const uint16_t *restrict b,
                                                            float *restrict c, int accumulate) {
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, accumulate);
  for (size_t kp = 0; kp < k / 2; kp++) {
    const uint16_t *bk = b + kp * 64;
    /* Weights stream from DRAM once per call (decode): ask for them ahead so that more
     * cache misses are in flight than the L2 streamer alone keeps. Prefetches past the
     * tile's end are harmless hints. */
    cm_prefetch_ahead(bk, CM_PREFETCH_L1_BYTES, CM_PREFETCH_L2_BYTES, 2);
    __m512 e0, o0, e1, o1;
    widen_pair(kind, _mm512_loadu_si512(bk), &e0, &o0);
    widen_pair(kind, _mm512_loadu_si512(bk + 32), &e1, &o1);
    cm_tile_fma_k__avx512(mr, acc0, acc1, e0, e1, a + 2 * kp * as);
    cm_tile_fma_k__avx512(mr, acc0, acc1, o0, o1, a + (2 * kp + 1) * as);
  }
  cm_tile_store__avx512(mr, acc0, acc1, c);
}

void cm_bf16_gemm_f32acc_mrx32__avx512(size_t mr, size_t k, const void *a, size_t as, const void *b,
                                       float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(k % 2 == 0 && as >= mr);
  CM_MR_SWITCH12(gemm_body, W_BF16, k, (const float *)a, as, (const uint16_t *)b, c, accumulate)
}

void cm_f16_gemm_f32acc_mrx32__avx512(size_t mr, size_t k, const void *a, size_t as, const void *b,
                                      float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(k % 2 == 0 && as >= mr);
  CM_MR_SWITCH12(gemm_body, W_F16, k, (const float *)a, as, (const uint16_t *)b, c, accumulate)
}
