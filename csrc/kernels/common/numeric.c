/* Constants of common/numeric.h that its helpers read from memory (see cm_expf there). */
#include "common/numeric.h"

const float cm_expf_clamp[2] = {-87.0f, 88.0f};
