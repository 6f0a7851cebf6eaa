/*
 * Scheme UNQUANT (moe_comp_method 0): bf16 or fp16 weights in the activation dtype, packed
 * VNNI-2 (pack/pack-vnni2.c). Panels are fp32; each C element is one fp32 FMA chain over
 * the whole reduction, one kernel call per panel.
 */
#include "moe/pipeline.h"

static cpumoe_status validate_unquant(const cpumoe_moe_problem *p) {
  (void)p; /* the weights need nothing beyond the common checks */
  return CPUMOE_OK;
}

static int64_t w1_row_bytes_unquant(const cpumoe_moe_problem *p) {
  return 2 * p->K;
}

static void gemm_block_unquant(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                               float *c) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = cm_stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const cm_unquant_kernels *k = &r->gemm->kernels.unquant;
  const cm_gemm_f32acc_fn gemm = p->act_dtype == CPUMOE_DTYPE_BF16 ? k->gemm_bf16 : k->gemm_f16;
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    const uint16_t *w = (const uint16_t *)(stage == 1 ? p->w1 : p->w2) +
                        (size_t)pn->expert * (size_t)(out_rows * red) + (size_t)(row0 * red);
    const float *panel = (const float *)r->a[stage - 1] + (size_t)pn->first * (size_t)red;
    gemm((size_t)pn->rows, (size_t)red, panel, (size_t)pn->rows, w, c);
    c += (size_t)pn->rows * CM_NR;
  }
}

const cm_scheme_traits cm_scheme_unquant = {
    .name = "bf16/fp16",
    .validate = validate_unquant,
    .w1_row_bytes = w1_row_bytes_unquant,
    .gemm_block = gemm_block_unquant,
};
