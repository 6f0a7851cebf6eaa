/*
 * AVX-512 VNNI micro-kernels for INT8 W8A8: u8 activations x s8 weights -> s32, and the
 * dequantization of a finished int32 tile (contracts: common/ukernels.h).
 *
 *   A panel: u8 [kc/4][a_stride][4]: per k-quad, 4 consecutive k of each row in one dword.
 *   B:       s8 VNNI-4 [kc/4][32][4] (docs/FORMATS.md): per k-quad 128 bytes, columns
 *            0..15 in bytes 0..63, 16..31 in 64..127; one dword = 4 k of one column.
 *   acc:     int32 [mr][32], exact (vpdpbusd adds four u8*s8 products, each at most
 *            255*128, straight into the int32 lane: no saturation).
 *
 * Tile 12 x 32 and why: per k-quad, 2 B vectors; each row needs 2 int32 accumulators
 * and one broadcast dword of A (vpdpbusd takes the u8 operand only from a register).
 * 12 x 2 + 2 + 1 = 27 of 32 zmm; 24 vpdpbusd per 2 B loads and 12 broadcast loads, so
 * the dot-product port, not the loads, is the limit (with operands in cache it runs at
 * the probe's peak).
 * Dequantization is a separate function on the stored tile: with its operands live
 * across the k loop, GCC shuffled the accumulators through the stack (half speed).
 * Memory: the caller's share of the next weight chunk is prefetched a line at a time across
 * the k loop (cm_prefetch, common/ukernels.h), so streaming overlaps the dot products. The
 * lines just ahead are requested into L1 as well (CM_INT8_PREFETCH_L1_BYTES). A caller with
 * nothing to share (CM_PREFETCH_SELF) gets a fixed read-ahead into L2 instead
 * (CM_INT8_PREFETCH_L2_BYTES).
 */
#include <immintrin.h>
#include <string.h>

#include "common/tile-avx512.h" /* the mr switch, cm_broadcast_dword__avx512 */
#include "common/ukernels.h"

#define MR 12
/* Both lines of a k-quad this far ahead go to L1 (prefetcht0), on top of the caller's share
 * of the next chunk, which goes to L2: faster at decode, no change at prefill, and 1 KiB
 * gained nothing (docs/PERFORMANCE-HISTORY.md). */
#define CM_INT8_PREFETCH_L1_BYTES 2048
/* Read-ahead into L2 for CM_PREFETCH_SELF (decode, and blocks of one panel): 2 lines per
 * k-quad, 4 KiB ahead. With the weights on huge pages 4 KiB streams faster than the 8 KiB a
 * whole-chunk share would request: Qwen3 M=1 1.31-1.36 -> 1.26-1.29 ms, prefill unchanged
 * (docs/PERFORMANCE-HISTORY.md, "Decode read-ahead on huge pages"). */
#define CM_INT8_PREFETCH_L2_BYTES 4096

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const uint8_t *restrict a, size_t as,
                                                            const int8_t *restrict b,
                                                            int32_t *restrict acc, int accumulate,
                                                            cm_prefetch prefetch) {
  __m512i acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    acc0[r] = accumulate ? _mm512_loadu_si512(acc + r * CM_NR) : _mm512_setzero_si512();
    acc1[r] = accumulate ? _mm512_loadu_si512(acc + r * CM_NR + 16) : _mm512_setzero_si512();
  }
  cm_prefetch_cursor pf = cm_prefetch_begin(prefetch);
  const size_t far = prefetch.lines ? 0 : CM_INT8_PREFETCH_L2_BYTES; /* else: the share */
  for (size_t kq = 0; kq < kc / 4; kq++) {
    cm_prefetch_step(&pf, kc / 4);
    const int8_t *bk = b + kq * 128;
    cm_prefetch_ahead(bk, CM_INT8_PREFETCH_L1_BYTES, far, 2);
    const __m512i b0 = _mm512_loadu_si512(bk);
    const __m512i b1 = _mm512_loadu_si512(bk + 64);
    const uint8_t *ak = a + kq * as * 4;
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      const __m512i x = cm_broadcast_dword__avx512(ak + 4 * r);
      acc0[r] = _mm512_dpbusd_epi32(acc0[r], x, b0);
      acc1[r] = _mm512_dpbusd_epi32(acc1[r], x, b1);
    }
  }
  cm_prefetch_finish(&pf);
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_si512(acc + r * CM_NR, acc0[r]);
    _mm512_storeu_si512(acc + r * CM_NR + 16, acc1[r]);
  }
}

void cm_u8s8_gemm_s32acc_mrx32__avx512(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                       const int8_t *b, int32_t *acc, int accumulate,
                                       cm_prefetch prefetch) {
  CM_EXPECT(kc % 4 == 0 && as >= mr);
  CM_MR_SWITCH12(gemm_body, kc, a, as, b, acc, accumulate, prefetch)
}

void cm_u8s8_dequant_mrx32__avx512(size_t mr, const int32_t *restrict acc, const int8_t *comp,
                                   const float *restrict a_scale, const float *restrict w_scale,
                                   float *restrict c) {
  const __m512i comp0 = _mm512_loadu_si512(comp), comp1 = _mm512_loadu_si512(comp + 64);
  const __m512 ws0 = _mm512_loadu_ps(w_scale), ws1 = _mm512_loadu_ps(w_scale + 16);
  for (size_t r = 0; r < mr; r++) {
    const __m512 as_r = _mm512_set1_ps(a_scale[r]);
    const __m512i t0 = _mm512_loadu_si512(acc + r * CM_NR);
    const __m512i t1 = _mm512_loadu_si512(acc + r * CM_NR + 16);
    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(t0, comp0));
    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(t1, comp1));
    _mm512_storeu_ps(c + r * CM_NR, _mm512_mul_ps(_mm512_mul_ps(v0, as_r), ws0));
    _mm512_storeu_ps(c + r * CM_NR + 16, _mm512_mul_ps(_mm512_mul_ps(v1, as_r), ws1));
  }
}
