/* Elementwise kernels of the scalar tier: the generic loops of
 * elementwise/elementwise-impl.h compiled with this tier's flags. */
#define CM_TIER scalar
#include "elementwise/elementwise-impl.h"

/* The portable tier has no streaming stores: plain bias_scale (contract: common/ukernels.h). */
void cm_bias_scale_stream__scalar(size_t n, const float *c, const float *bias, float g, float *y) {
  cm_bias_scale__scalar(n, c, bias, g, y);
}
