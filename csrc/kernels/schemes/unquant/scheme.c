/*
 * Scheme UNQUANT (moe_comp_method 0): bf16 or fp16 weights in the activation dtype, packed
 * VNNI-2 (pack/pack-vnni2.c). One kernel call per panel over the whole reduction: the
 * config's kernel, or its decode kernel for a block of few rows (a tile kernel would
 * compute mostly empty rows there).
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
  const cm_gemm_fn gemm = r->panels[blk->first_panel].decode ? k->gemm_decode : k->gemm;
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    const uint16_t *w = (const uint16_t *)(stage == 1 ? p->w1 : p->w2) +
                        (size_t)pn->expert * (size_t)(out_rows * red) + (size_t)(row0 * red);
    size_t a_stride;
    const void *panel = cm_panel_operand(r, pn, stage, 0, &a_stride);
    gemm((size_t)pn->rows, (size_t)red, panel, a_stride, w, c, 0);
    c += (size_t)pn->rows * CM_NR;
  }
}

const cm_scheme_traits cm_scheme_unquant = {
    .name = "bf16/fp16",
    .validate = validate_unquant,
    .w1_row_bytes = w1_row_bytes_unquant,
    .gemm_block = gemm_block_unquant,
};
