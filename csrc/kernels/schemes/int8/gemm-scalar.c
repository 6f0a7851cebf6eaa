/*
 * Scalar micro-kernels for INT8 W8A8: u8 activations x s8 weights -> exact int32 sums,
 * and the dequantization of a finished tile (contracts: common/ukernels.h).
 * A_panel u8 [kc/4][a_stride][4]; B s8 VNNI-4 [kc/4][32][4].
 * Integer sums are exact in any order, and the dequantization is the same three fp32
 * operations everywhere, so every tier agrees with this one bit for bit.
 */
#include <string.h>

#include "common/ukernels.h"

void cm_u8s8_gemm_s32acc_mrx32__scalar(size_t mr, size_t kc, const uint8_t *a, size_t as,
                                       const int8_t *b, int32_t *acc, int accumulate,
                                       cm_prefetch prefetch) {
  CM_EXPECT(kc % 4 == 0 && as >= mr && mr >= 1 && mr <= CM_MR_MAX);
  (void)prefetch; /* the portable reference leaves memory to the hardware */
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      int32_t sum = accumulate ? acc[r * CM_NR + n] : 0;
      for (size_t kk = 0; kk < kc; kk++)
        sum += (int32_t)a[(kk / 4) * as * 4 + r * 4 + (kk & 3)] *
               (int32_t)b[(kk / 4) * 4 * CM_NR + n * 4 + (kk & 3)];
      acc[r * CM_NR + n] = sum;
    }
}

void cm_u8s8_dequant_mrx32__scalar(size_t mr, const int32_t *acc, const int8_t *comp_bytes,
                                   const float *a_scale, const float *w_scale, float *c) {
  int32_t comp[CM_NR];
  memcpy(comp, comp_bytes, sizeof comp);
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++)
      c[r * CM_NR + n] = ((float)(acc[r * CM_NR + n] - comp[n]) * a_scale[r]) * w_scale[n];
}
