/*
 * Scalar kernels for MXFP4: the ground truth of mxfp4/gemm-<tier>.c (contracts:
 * common/ukernels.h). Each group of 32 k is decoded exactly to bf16 (common/mxfp4.h,
 * cm_mxfp4_to_bf16), and each C element is one fp32 fmaf chain over k from +0 of the
 * activation times the decoded weight: the bf16 scheme's arithmetic on the decoded weights.
 */
#include <math.h>

#include "common/mxfp4.h"
#include "common/ukernels.h"

void cm_mxfp4_gemm_f32acc_mrx32__scalar(size_t mr, size_t k, const void *panel, size_t as,
                                        const uint8_t *b, const uint8_t *scales, float *c,
                                        int accumulate) {
  CM_EXPECT(k % CM_MXFP4_GROUP == 0 && as >= mr && mr >= 1 && mr <= CM_MR_MAX);
  const float *a = (const float *)panel;
  uint16_t w[CM_MXFP4_GROUP * CM_NR]; /* one group, bf16 [16][32][2] */
  if (!accumulate)
    for (size_t i = 0; i < mr * CM_NR; i++) c[i] = 0.0f;
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++) {
    cm_mxfp4_decode_group(b + g * CM_MXFP4_GROUP_BYTES, scales + g * CM_NR, w);
    const float *ag = a + g * CM_MXFP4_GROUP * as;
    for (size_t r = 0; r < mr; r++)
      for (size_t n = 0; n < CM_NR; n++) {
        float acc = c[r * CM_NR + n]; /* the chain goes on from the group before */
        for (size_t kk = 0; kk < CM_MXFP4_GROUP; kk++)
          acc = fmaf(ag[kk * as + r], cm_bf16_to_f32(w[(kk / 2) * 64 + 2 * n + (kk & 1)]), acc);
        c[r * CM_NR + n] = acc;
      }
  }
}

void cm_mxfp4_to_bf16__scalar(size_t k, const uint8_t *b, const uint8_t *scales, void *out) {
  CM_EXPECT(k % CM_MXFP4_GROUP == 0);
  uint16_t *dst = (uint16_t *)out;
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++)
    cm_mxfp4_decode_group(b + g * CM_MXFP4_GROUP_BYTES, scales + g * CM_NR,
                          dst + g * CM_MXFP4_GROUP * CM_NR);
}
