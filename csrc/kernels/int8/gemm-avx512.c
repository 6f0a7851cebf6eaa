/*
 * AVX-512 VNNI GEMM micro-kernel for INT8 W8A8: u8 activations x s8 weights -> s32.
 *
 * C[mr][32] = A_panel x B_tile, mr <= 12, exact int32 (no saturation: vpdpbusd adds
 * four u8*s8 products, |each| <= 255*128, straight into the int32 lane).
 *   A panel: u8 [k/4][a_stride][4]: per k-quad, 4 consecutive k of each row in one dword.
 *   B tile:  s8 VNNI-4 [k/4][32][4] (docs/FORMATS.md): per k-quad 128 bytes, columns
 *            0..15 in bytes 0..63, 16..31 in 64..127; one dword = 4 k of one column.
 *   C tile:  fp32 [mr][32] = ((float)(acc - comp) * a_scale[r]) * w_scale[n], with comp the
 *            int32[32] stored after the tile (fused dequantization, common/ukernels.h).
 *
 * Tile 12 x 32 and why: per k-quad, 2 B vectors; each row needs 2 int32 accumulators
 * and one broadcast dword of A (vpdpbusd takes the u8 operand only from a register).
 * 12 x 2 + 2 + 1 = 27 of 32 zmm, leaving room for the compiler; 24 vpdpbusd per 2 B
 * loads and 12 broadcast loads, so the dot-product port, not the loads, is the limit.
 */
#include <immintrin.h>
#include <string.h>

#include "common/ukernels.h"

#define MR 12
/* 4 KiB ahead, as the 16-bit kernels (unquant/gemm-avx512.c) */
#define CM_PREFETCH_KQUADS 32

static inline __attribute__((always_inline)) __m512i broadcast_dword(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* C[r][n] = ((float)(tile[r][n] - comp[n]) * a_scale[r]) * w_scale[n] */
static void dequantize_tile(int mr, const int32_t *restrict tile, const int8_t *comp_bytes,
                            const float *restrict a_scale, const float *restrict w_scale,
                            float *restrict c) {
  const __m512i comp0 = _mm512_loadu_si512(comp_bytes);
  const __m512i comp1 = _mm512_loadu_si512(comp_bytes + 64);
  const __m512 ws0 = _mm512_loadu_ps(w_scale), ws1 = _mm512_loadu_ps(w_scale + 16);
  for (int r = 0; r < mr; r++) {
    const __m512 as_r = _mm512_set1_ps(a_scale[r]);
    const __m512i t0 = _mm512_loadu_si512(tile + r * CM_NR);
    const __m512i t1 = _mm512_loadu_si512(tile + r * CM_NR + 16);
    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(t0, comp0));
    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(t1, comp1));
    _mm512_storeu_ps(c + r * CM_NR, _mm512_mul_ps(_mm512_mul_ps(v0, as_r), ws0));
    _mm512_storeu_ps(c + r * CM_NR + 16, _mm512_mul_ps(_mm512_mul_ps(v1, as_r), ws1));
  }
}

static inline __attribute__((always_inline)) void gemm_body(
    const int mr, size_t k, const uint8_t *restrict a, size_t as, const int8_t *restrict b,
    const float *restrict a_scale, const float *restrict w_scale, float *restrict c) {
  __m512i acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    acc0[r] = _mm512_setzero_si512();
    acc1[r] = _mm512_setzero_si512();
  }
  for (size_t kq = 0; kq < k / 4; kq++) {
    const int8_t *bk = b + kq * 128;
    _mm_prefetch((const char *)(bk + CM_PREFETCH_KQUADS * 128), _MM_HINT_T0);
    _mm_prefetch((const char *)(bk + CM_PREFETCH_KQUADS * 128 + 64), _MM_HINT_T0);
    const __m512i b0 = _mm512_loadu_si512(bk);
    const __m512i b1 = _mm512_loadu_si512(bk + 64);
    const uint8_t *ak = a + kq * as * 4;
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      const __m512i x = broadcast_dword(ak + 4 * r);
      acc0[r] = _mm512_dpbusd_epi32(acc0[r], x, b0);
      acc1[r] = _mm512_dpbusd_epi32(acc1[r], x, b1);
    }
  }
  /* The int32 tile goes through L1 before dequantization: with the dequantization
   * operands live across the loop, GCC shuffled the accumulators through the stack
   * inside it (half speed). */
  int32_t tile[MR * CM_NR];
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    _mm512_storeu_si512(tile + r * CM_NR, acc0[r]);
    _mm512_storeu_si512(tile + r * CM_NR + 16, acc1[r]);
  }
  dequantize_tile(mr, tile, b + CM_NR * k, a_scale, w_scale, c);
}

void cm_u8s8_gemm_dq_mrx32__avx512(size_t mr, size_t k, const uint8_t *a, size_t as,
                                   const int8_t *b, const float *a_scale, const float *w_scale,
                                   float *c) {
  switch (mr) {
    case 1: gemm_body(1, k, a, as, b, a_scale, w_scale, c); break;
    case 2: gemm_body(2, k, a, as, b, a_scale, w_scale, c); break;
    case 3: gemm_body(3, k, a, as, b, a_scale, w_scale, c); break;
    case 4: gemm_body(4, k, a, as, b, a_scale, w_scale, c); break;
    case 5: gemm_body(5, k, a, as, b, a_scale, w_scale, c); break;
    case 6: gemm_body(6, k, a, as, b, a_scale, w_scale, c); break;
    case 7: gemm_body(7, k, a, as, b, a_scale, w_scale, c); break;
    case 8: gemm_body(8, k, a, as, b, a_scale, w_scale, c); break;
    case 9: gemm_body(9, k, a, as, b, a_scale, w_scale, c); break;
    case 10: gemm_body(10, k, a, as, b, a_scale, w_scale, c); break;
    case 11: gemm_body(11, k, a, as, b, a_scale, w_scale, c); break;
    default: gemm_body(12, k, a, as, b, a_scale, w_scale, c); break;
  }
}
