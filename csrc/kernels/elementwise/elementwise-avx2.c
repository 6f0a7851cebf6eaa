/* Elementwise kernels of the avx2 tier: the generic loops of
 * elementwise/elementwise-impl.h compiled with this tier's flags, and the one that needs
 * intrinsics, bias_scale with streaming stores. */
#define CM_TIER avx2
#include "elementwise/elementwise-impl.h"

/* Streaming stores: 8 floats per vmovntps (contract: common/ukernels.h). */
#include <immintrin.h>
#include <stdint.h>

void cm_bias_scale_stream__avx2(size_t n, const float *restrict c, const float *restrict bias,
                                float g, float *restrict y) {
  if (n % 16 != 0 || (uintptr_t)y % 64 != 0) {
    cm_bias_scale__avx2(n, c, bias, g, y);
    return;
  }
  const __m256 gv = _mm256_set1_ps(g);
  for (size_t i = 0; i < n; i += 8) {
    __m256 v = _mm256_loadu_ps(c + i);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
    _mm256_stream_ps(y + i, _mm256_mul_ps(v, gv));
  }
}
