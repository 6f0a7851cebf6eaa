/*
 * The table of weight schemes, indexed by moe_comp_method: the only place that lists them.
 * Adding a scheme is its folder schemes/<name>/ (kernels per tier, packer, scheme.c with
 * its traits), a row here, and its kernels in the tiers' tables (dispatch/config.c).
 */
#include "moe/pipeline.h"

extern const cm_scheme_traits cm_scheme_unquant, cm_scheme_int8, cm_scheme_fp8, cm_scheme_int4,
    cm_scheme_mxfp4;

/* clang-format off */
static const cm_scheme_traits *const cm_schemes[CM_SCHEME_COUNT] = {
    [CPUMOE_SCHEME_UNQUANT] = &cm_scheme_unquant,
    [CPUMOE_SCHEME_INT8_W8A8] = &cm_scheme_int8,
    [CPUMOE_SCHEME_FP8_W8A16] = &cm_scheme_fp8,
    [CPUMOE_SCHEME_INT4_W4A8] = &cm_scheme_int4,
    [CPUMOE_SCHEME_MXFP4] = &cm_scheme_mxfp4,
};
/* clang-format on */

const cm_scheme_traits *cm_scheme_traits_of(cpumoe_scheme scheme) {
  return (unsigned)scheme < CM_SCHEME_COUNT ? cm_schemes[scheme] : NULL;
}
