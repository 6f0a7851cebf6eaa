/*
 * Scheme UNQUANT (moe_comp_method 0): bf16 or fp16 weights in the activation dtype, packed
 * VNNI-2 (pack/pack-vnni2.c), multiplied by the config's kernel, or by its decode kernel
 * for a block of few rows (a tile kernel would compute mostly empty rows there).
 */
#include "moe/pipeline.h"

/* Reduction chunk of a block of several panels: 16 KiB of bf16 weights, which stay in L1
 * while every panel runs over them. */
#define CM_UNQUANT_KC 256

static cpumoe_status validate_unquant(const cpumoe_moe_problem *p) {
  (void)p; /* the weights need nothing beyond the common checks */
  return CPUMOE_OK;
}

static int64_t w1_row_bytes_unquant(const cpumoe_moe_problem *p) {
  return 2 * p->K;
}

/* A block of one panel: one call over the whole reduction, the kernel reading ahead on its
 * own. Several panels: the reduction is walked in chunks, each chunk applied to every panel
 * (accumulating in C) before the next, and each call requests its share of the next chunk
 * (cm_prefetch_share), as INT8 does: the weights come from memory once and the memory
 * stream keeps going while the later panels compute. Splitting a reduction this way
 * changes no bits (C is reloaded exactly as it was left). A block of up to the config's
 * panel_major_panels goes panel by panel instead (cm_block_chunk, cm_block_prefetch), and
 * one of up to its block_rows_max rows in one call (cm_block_one_call): the same bits,
 * each row's products and sums being its own whatever rows share its tiles. */
static void gemm_block_unquant(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                               float *c) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = cm_stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const cm_unquant_kernels *k = &r->gemm->kernels.unquant;
  const cm_gemm_fn gemm = r->panels[blk->first_panel].decode ? k->gemm_decode : k->gemm;
  const int64_t expert = r->panels[blk->first_panel].expert;
  const uint16_t *w = (const uint16_t *)(stage == 1 ? p->w1 : p->w2) +
                      (size_t)expert * (size_t)(out_rows * red) + (size_t)(row0 * red);
  if (cm_block_one_call(r, blk)) {
    size_t a_stride;
    const void *panel = cm_panel_operand(r, &r->panels[blk->first_panel], stage, 0, &a_stride);
    gemm((size_t)cm_block_rows(r, blk), (size_t)red, panel, a_stride, w, c, 0, CM_PREFETCH_SELF);
    return;
  }
  const int64_t kc = cm_block_chunk(r, blk, red, CM_UNQUANT_KC);
  for (int64_t k0 = 0; k0 < red; k0 += kc) {
    const int64_t n = red - k0 < kc ? red - k0 : kc;
    float *cq = c;
    for (int32_t q = 0; q < blk->panels; q++) {
      const cm_panel *pn = &r->panels[blk->first_panel + q];
      size_t a_stride;
      const void *panel = cm_panel_operand(r, pn, stage, k0, &a_stride);
      /* VNNI-2: k0 / 2 pairs of 32 columns x 2 */
      gemm((size_t)pn->rows, (size_t)n, panel, a_stride, w + k0 * CM_NR, cq, k0 > 0,
           cm_block_prefetch(r, blk, q, w + (k0 + kc) * CM_NR, (size_t)kc * CM_NR * 2));
      cq += (size_t)pn->rows * CM_NR;
    }
  }
}

const cm_scheme_traits cm_scheme_unquant = {
    .name = "bf16/fp16",
    .validate = validate_unquant,
    .w1_row_bytes = w1_row_bytes_unquant,
    .gemm_block = gemm_block_unquant,
};
