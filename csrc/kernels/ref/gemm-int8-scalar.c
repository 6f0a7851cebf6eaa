/*
 * Scalar GEMM micro-kernel for INT8 W8A8: u8 activations x s8 weights -> exact int32.
 * C[mr][32] = A_panel (u8 [k/4][a_stride][4]) x B_tile (s8 VNNI-4 [k/4][32][4]).
 * Integer sums are exact in any order, so every tier agrees with this one bit for bit.
 */
#include "common/ukernels.h"

void cm_u8s8_gemm_s32acc_mrx32__scalar(size_t mr, size_t k, const uint8_t *a, size_t as,
                                       const int8_t *b, int32_t *c) {
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      int32_t acc = 0;
      for (size_t kk = 0; kk < k; kk++)
        acc += (int32_t)a[(kk / 4) * as * 4 + r * 4 + (kk & 3)] *
               (int32_t)b[(kk / 4) * 4 * CM_NR + n * 4 + (kk & 3)];
      c[r * CM_NR + n] = acc;
    }
}
