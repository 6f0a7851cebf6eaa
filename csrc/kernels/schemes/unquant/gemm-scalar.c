/*
 * Scalar GEMM micro-kernels for 16-bit weights: the ground truth every SIMD tier
 * must reproduce bit for bit, and the last-resort tier on any x86-64 CPU.
 *
 * C[mr][32] = A_panel[k][a_stride] x B_tile[k/2][32][2] (layouts: common/ukernels.h).
 * Each C element is one fp32 fmaf chain over k in order 0..k-1, starting from +0.
 * No register blocking: this tier is for correctness, not speed.
 */
#include <math.h>

#include "common/numeric.h"
#include "common/ukernels.h"

typedef float (*cm_widen_one_fn)(uint16_t);

static inline void gemm_16bit_scalar(size_t mr, size_t k, const float *restrict a, size_t a_stride,
                                     const uint16_t *restrict b, float *restrict c, int accumulate,
                                     cm_widen_one_fn widen) {
  for (size_t r = 0; r < mr; r++) {
    for (size_t n = 0; n < CM_NR; n++) {
      float acc = accumulate ? c[r * CM_NR + n] : 0.0f;
      for (size_t kk = 0; kk < k; kk++) {
        const float w = widen(b[(kk / 2) * (2 * CM_NR) + 2 * n + (kk & 1)]);
        acc = fmaf(a[kk * a_stride + r], w, acc);
      }
      c[r * CM_NR + n] = acc;
    }
  }
}

void cm_bf16_gemm_f32acc_mrx32__scalar(size_t mr, size_t k, const void *a, size_t a_stride,
                                       const void *b, float *c, int accumulate,
                                       cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(k % 2 == 0 && a_stride >= mr && mr >= 1 && mr <= CM_MR_MAX);
  gemm_16bit_scalar(mr, k, a, a_stride, b, c, accumulate, cm_bf16_to_f32);
}

void cm_f16_gemm_f32acc_mrx32__scalar(size_t mr, size_t k, const void *a, size_t a_stride,
                                      const void *b, float *c, int accumulate,
                                      cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(k % 2 == 0 && a_stride >= mr && mr >= 1 && mr <= CM_MR_MAX);
  gemm_16bit_scalar(mr, k, a, a_stride, b, c, accumulate, cm_f16_to_f32);
}
