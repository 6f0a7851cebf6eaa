/* Elementwise kernels of the avx512 tier: the generic loops of
 * elementwise/elementwise-impl.h compiled with this tier's flags. */
#define CM_TIER avx512
#include "elementwise/elementwise-impl.h"
