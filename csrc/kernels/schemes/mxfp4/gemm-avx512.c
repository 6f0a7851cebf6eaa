/*
 * AVX-512 kernels for MXFP4: codes decoded exactly to bf16 in registers, widened to fp32,
 * FMA against fp32 activation panels (contracts: common/ukernels.h; numbers and layout:
 * common/mxfp4.h).
 *
 *   A panel: fp32 [k][a_stride];  C: fp32 [mr][32].
 *   B:       32 bytes per k pair of a 32-row block; byte j: low nibble row j/2, high nibble
 *            row 16 + j/2, k parity j%2.  scales: e8m0 [groups][32].
 *   Math:    each C element is one fp32 FMA chain over k from +0 (or C) of a * w, w the
 *            exact bf16 decoding: the bits of the bf16 kernels on the decoded weights.
 *
 * Decode of one k pair (fast route, common/mxfp4.h): the 32 bytes widened to words
 * (vpmovzxbw), so word j holds byte j, i.e. the low nibble of row j/2 at k parity j%2 in
 * bits 3..0: a vpermw looks up the code words (the 16 duplicated, as vpermw also reads bit
 * 4, the high nibble's lowest bit), a saturating subtraction from the scale words makes the
 * bf16 bits of rows 0..15 in VNNI-2 order; the same after a shift by 4 makes rows 16..31.
 * Widening is a shift (k even) and a mask (k odd) per 16 columns: 10 vector uops per
 * 64 weights before the FMAs (1 widen + 2 permutes on port 5). A group whose scales
 * leave the fast range is decoded exactly by common/mxfp4.h into an L1 buffer instead.
 *
 * Two ways to use the weights, chosen by the pipeline, with identical results:
 *   decode  (few rows): cm_mxfp4_gemm_f32acc_mrx32 decodes in registers, mr <= 4 (8
 *           accumulators; the decode is shared by the rows and is most of the work);
 *   prefill (many rows): cm_mxfp4_to_bf16 decodes a chunk once into bf16 VNNI-2, which
 *           the bf16 kernel (unquant/gemm-avx512.c) multiplies by every panel.
 */
#include <immintrin.h>

#include "common/mxfp4.h"
#include "common/tile-avx512.h"
#include "common/ukernels.h"
#include "schemes/mxfp4/decode-avx512.h"

#define MR_DECODE 4
/* Read-ahead, bytes of codes: prefetcht0 1 KiB and prefetcht1 3.5 KiB ahead, one line per
 * 64 bytes. 3.5 KiB into L2 against the FP8 kernels' 8: Qwen3 M=1 0.972x the time
 * (docs/PERFORMANCE-HISTORY.md, "Shorter read-ahead for bf16 and MXFP4 decode"). */
#define CM_MXFP4_PF_L1_BYTES 1024
#define CM_MXFP4_PF_L2_BYTES 3584

/* the two k of a pair of bf16 VNNI-2 rows lo (columns 0..15) and hi (16..31) into the
 * tile: k even is each dword's low half, k odd its high half */
static inline __attribute__((always_inline)) void fma_kpair(const int mr, __m512 *acc0,
                                                            __m512 *acc1, __m512i lo, __m512i hi,
                                                            const float *a_k, size_t as) {
  const __m512i odd_mask = _mm512_set1_epi32((int)0xffff0000u);
  cm_tile_fma_k__avx512(mr, acc0, acc1, _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                        _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)), a_k);
  cm_tile_fma_k__avx512(mr, acc0, acc1, _mm512_castsi512_ps(_mm512_and_si512(lo, odd_mask)),
                        _mm512_castsi512_ps(_mm512_and_si512(hi, odd_mask)), a_k + as);
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t k,
                                                            const float *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const uint8_t *restrict scales,
                                                            float *restrict c, int accumulate) {
  __m512 acc0[MR_DECODE], acc1[MR_DECODE];
  cm_tile_load__avx512(mr, acc0, acc1, c, accumulate);
  const __m512i table = cm_mxfp4_table__avx512();
  _Alignas(64) uint16_t exact[CM_MXFP4_GROUP * CM_NR]; /* a group outside the fast range */
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++) {
    const uint8_t *bg = b + g * CM_MXFP4_GROUP_BYTES, *sg = scales + g * CM_NR;
    const float *ag = a + g * CM_MXFP4_GROUP * as;
    cm_mxfp4_prefetch_scales(sg, CM_MXFP4_PF_L2_BYTES);
    if (cm_mxfp4_group_fast__avx512(sg)) {
      const __m512i a_lo = cm_mxfp4_scale_words__avx512(sg);
      const __m512i a_hi = cm_mxfp4_scale_words__avx512(sg + 16);
      for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp += 2) {
        const uint8_t *bk = bg + kp * CM_MXFP4_KP_BYTES;
        cm_prefetch_ahead(bk, CM_MXFP4_PF_L1_BYTES, CM_MXFP4_PF_L2_BYTES, 1);
        __m512i lo, hi;
        cm_mxfp4_decode_kpair__avx512(bk, table, a_lo, a_hi, &lo, &hi);
        fma_kpair(mr, acc0, acc1, lo, hi, ag + 2 * kp * as, as);
        cm_mxfp4_decode_kpair__avx512(bk + CM_MXFP4_KP_BYTES, table, a_lo, a_hi, &lo, &hi);
        fma_kpair(mr, acc0, acc1, lo, hi, ag + (2 * kp + 2) * as, as);
      }
    } else {
      cm_mxfp4_decode_group(bg, sg, exact);
      for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp++)
        fma_kpair(mr, acc0, acc1, _mm512_load_si512(exact + kp * 64),
                  _mm512_load_si512(exact + kp * 64 + 32), ag + 2 * kp * as, as);
    }
  }
  cm_tile_store__avx512(mr, acc0, acc1, c);
}

void cm_mxfp4_gemm_f32acc_mrx32__avx512(size_t mr, size_t k, const void *a, size_t as,
                                        const uint8_t *b, const uint8_t *scales, float *c,
                                        int accumulate) {
  CM_EXPECT(k % CM_MXFP4_GROUP == 0 && as >= mr && mr >= 1 && mr <= MR_DECODE);
  const float *af = (const float *)a;
  switch (mr) {
    case 1: gemm_body(1, k, af, as, b, scales, c, accumulate); break;
    case 2: gemm_body(2, k, af, as, b, scales, c, accumulate); break;
    case 3: gemm_body(3, k, af, as, b, scales, c, accumulate); break;
    default: gemm_body(4, k, af, as, b, scales, c, accumulate); break;
  }
}

void cm_mxfp4_to_bf16__avx512(size_t k, const uint8_t *b, const uint8_t *scales, void *out) {
  CM_EXPECT(k % CM_MXFP4_GROUP == 0);
  uint16_t *dst = (uint16_t *)out;
  const __m512i table = cm_mxfp4_table__avx512();
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++)
    cm_mxfp4_decode_group__avx512(b + g * CM_MXFP4_GROUP_BYTES, scales + g * CM_NR, table,
                                  dst + g * CM_MXFP4_GROUP * CM_NR);
}
