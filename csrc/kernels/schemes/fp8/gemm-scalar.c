/*
 * Scalar kernels for FP8 (e4m3fn) W8A16: the ground truth of fp8/gemm-<tier>.c
 * (contracts: common/ukernels.h). Every weight is decoded exactly (common/numeric.h,
 * cm_e4m3_to_f32_scaled: the value times 2^-8); a K block's products enter one fmaf chain
 * per output element, and the block's sum is folded in with fmaf(P, scale, C).
 */
#include <math.h>

#include "common/numeric.h"
#include "common/ukernels.h"

static float decoded(const uint8_t *b, size_t k, size_t n) {
  return cm_e4m3_to_f32_scaled(b[(k / 2) * 2 * CM_NR + 2 * n + (k & 1)]);
}

void cm_fp8_gemm_f32acc_mrx32__scalar(size_t mr, size_t kc, const void *panel, size_t as,
                                      const uint8_t *b, const float *scale, float *c,
                                      int accumulate) {
  CM_EXPECT(kc % 2 == 0 && as >= mr && mr >= 1 && mr <= CM_MR_MAX);
  const float *a = (const float *)panel;
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      float p = 0.0f;
      for (size_t k = 0; k < kc; k++) p = fmaf(a[k * as + r], decoded(b, k, n), p);
      c[r * CM_NR + n] = fmaf(p, scale[n], accumulate ? c[r * CM_NR + n] : 0.0f);
    }
}

void cm_f32_gemm_f32acc_mrx32__scalar(size_t mr, size_t kc, const void *panel, size_t as,
                                      const void *chunk, float *c, int accumulate,
                                      cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(as >= mr && mr >= 1 && mr <= CM_MR_MAX);
  const float *a = (const float *)panel, *b = (const float *)chunk;
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      float acc = accumulate ? c[r * CM_NR + n] : 0.0f;
      for (size_t k = 0; k < kc; k++) acc = fmaf(a[k * as + r], b[k * CM_NR + n], acc);
      c[r * CM_NR + n] = acc;
    }
}

void cm_fp8_to_f32__scalar(size_t kc, const uint8_t *b, void *out) {
  float *dst = (float *)out;
  for (size_t k = 0; k < kc; k++)
    for (size_t n = 0; n < CM_NR; n++) dst[k * CM_NR + n] = decoded(b, k, n);
}
