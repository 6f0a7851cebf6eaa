/*
 * Scalar kernels for FP8 (e4m3fn) W8A16: the ground truth of fp8/gemm-<tier>.c
 * (contracts: common/ukernels.h). Every weight is decoded exactly (common/numeric.h,
 * cm_e4m3_to_f32_scaled: the value times 2^-8), multiplied by its column's block scale
 * (which carries the 2^8), and enters one fmaf chain per output element.
 */
#include <math.h>

#include "common/numeric.h"
#include "common/ukernels.h"

static float weight(const uint8_t *b, size_t k, size_t n, const float *scale) {
  return cm_e4m3_to_f32(b[(k / 2) * 2 * CM_NR + 2 * n + (k & 1)]) * scale[n];
}

void cm_fp8_gemm_f32acc_mrx32__scalar(size_t mr, size_t kc, const float *a, size_t as,
                                      const uint8_t *b, const float *scale, float *c,
                                      int accumulate) {
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      float acc = accumulate ? c[r * CM_NR + n] : 0.0f;
      for (size_t k = 0; k < kc; k++) acc = fmaf(a[k * as + r], weight(b, k, n, scale), acc);
      c[r * CM_NR + n] = acc;
    }
}

void cm_f32_gemm_f32acc_mrx32__scalar(size_t mr, size_t kc, const float *a, size_t as,
                                      const float *b, float *c, int accumulate) {
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      float acc = accumulate ? c[r * CM_NR + n] : 0.0f;
      for (size_t k = 0; k < kc; k++) acc = fmaf(a[k * as + r], b[k * CM_NR + n], acc);
      c[r * CM_NR + n] = acc;
    }
}

void cm_fp8_to_f32__scalar(size_t kc, const uint8_t *b, const float *scale, float *dst) {
  for (size_t k = 0; k < kc; k++)
    for (size_t n = 0; n < CM_NR; n++) dst[k * CM_NR + n] = weight(b, k, n, scale);
}
