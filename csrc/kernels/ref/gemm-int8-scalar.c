/*
 * Scalar GEMM micro-kernel for INT8 W8A8: u8 activations x s8 weights, exact int32 sums,
 * then the fused dequantization of common/ukernels.h (cm_gemm_u8s8_fn).
 * A_panel u8 [k/4][a_stride][4]; B_tile s8 VNNI-4 [k/4][32][4] followed by int32 comp[32].
 * Integer sums are exact in any order, and the dequantization is the same three fp32
 * operations everywhere, so every tier agrees with this one bit for bit.
 */
#include <string.h>

#include "common/ukernels.h"

void cm_u8s8_gemm_dq_mrx32__scalar(size_t mr, size_t k, const uint8_t *a, size_t as,
                                   const int8_t *b, const float *a_scale, const float *w_scale,
                                   float *c) {
  int32_t comp[CM_NR];
  memcpy(comp, b + CM_NR * k, sizeof comp);
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      int32_t acc = 0;
      for (size_t kk = 0; kk < k; kk++)
        acc += (int32_t)a[(kk / 4) * as * 4 + r * 4 + (kk & 3)] *
               (int32_t)b[(kk / 4) * 4 * CM_NR + n * 4 + (kk & 3)];
      c[r * CM_NR + n] = ((float)(acc - comp[n]) * a_scale[r]) * w_scale[n];
    }
}
