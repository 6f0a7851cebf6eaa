/*
 * Scalar micro-kernels for INT4 W4A8 (contracts: common/ukernels.h, layout: common/int4.h):
 * unpack a run of packed blocks into s8 VNNI-4 tiles of w - zero (the pipeline then runs
 * the u8 x s8 integer GEMM on them), and fold one block's exact int32 sums into the fp32
 * tile with its compensation and group scale. The avx512 and avx2 tiers do the same
 * integer sums and the same single fmaf per block, so they agree with this one bit for bit.
 */
#include <math.h>
#include <string.h>

#include "common/int4.h"
#include "common/ukernels.h"

void cm_int4_unpack__scalar(const cm_int4_tile *w, size_t kb0, size_t nb, int8_t *dst) {
  const size_t bk = w->bk;
  for (size_t b = 0; b < nb; b++) {
    const size_t kb = kb0 + b;
    const uint8_t *block = w->blocks + kb * cm_int4_block_bytes(bk);
    const int8_t *zero = w->zeros + (kb / w->group_blocks) * CM_NR;
    int8_t *out = dst + b * bk * CM_NR;
    for (size_t k = 0; k < bk; k++)
      for (int n = 0; n < CM_NR; n++)
        out[(k / 4) * 4 * CM_NR + (size_t)n * 4 + (k & 3)] = cm_int4_weight(block, k, n, zero[n]);
  }
}

void cm_int4_dequant_mrx32__scalar(size_t mr, const int32_t *acc, const uint8_t *comp_bytes,
                                   const float *scale, float *c, int accumulate, int last) {
  (void)last; /* columns in order throughout */
  int32_t comp[CM_NR];
  memcpy(comp, comp_bytes, sizeof comp);
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++) {
      const float s = (float)(acc[r * CM_NR + n] - 128 * comp[n]);
      c[r * CM_NR + n] = fmaf(s, scale[n], accumulate ? c[r * CM_NR + n] : 0.0f);
    }
}
