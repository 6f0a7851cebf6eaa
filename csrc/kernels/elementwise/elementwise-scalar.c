/* Elementwise kernels of the scalar tier: the generic loops of
 * elementwise/elementwise-impl.h compiled with this tier's flags. */
#define CM_TIER scalar
#include "elementwise/elementwise-impl.h"
