/* Elementwise kernels of the avx2 tier: the generic loops of
 * elementwise/elementwise-impl.h compiled with this tier's flags. */
#define CM_TIER avx2
#include "elementwise/elementwise-impl.h"
