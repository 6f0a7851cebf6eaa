/*
 * Scheme MXFP4 (moe_comp_method 4, gpt-oss): e2m1 weights two per byte, packed in blocks of
 * 32 rows (schemes/mxfp4/pack.c), with an e8m0 scale per row and group of 32 consecutive k
 * (common/mxfp4.h has the numbers and the layout). Activations stay 16-bit. Every weight
 * decodes exactly to bf16, so the scheme computes what the bf16 scheme computes on the
 * decoded weights: the same fp32 chains, the same bf16 kernels on the chunk path.
 */
#include "common/error.h"
#include "common/mxfp4.h"
#include "moe/pipeline.h"

/* Reduction chunk decoded at once by the prefill path: 16 KiB of bf16, which stays in L1
 * while every panel of the block runs over it (as the bf16 scheme's chunk). */
#define CM_MXFP4_KC 256

static cpumoe_status validate_mxfp4(const cpumoe_moe_problem *p) {
  if (!p->w1_scale_e8m0 || !p->w2_scale_e8m0)
    return cm_fail(CPUMOE_EINVAL, "MXFP4 needs w1_scale_e8m0 and w2_scale_e8m0");
  return CPUMOE_OK; /* K and N multiples of 32 (checked for every scheme) make whole groups */
}

/* K/2 bytes of codes and K/32 of scales per w1 row */
static int64_t w1_row_bytes_mxfp4(const cpumoe_moe_problem *p) {
  return p->K / 2 + p->K / CM_MXFP4_GROUP;
}

/* Few rows: the codes are decoded in registers, one call over the whole reduction per panel
 * (the weights are read once, the kernel reads ahead on its own). More rows: each chunk of
 * the reduction is decoded once into an L1-resident bf16 B tile and every panel runs the
 * config's bf16 kernel on it, accumulating in C; each call requests its share of the next
 * chunk's codes (cm_prefetch_share). Within a numerics class both give the bits of the bf16
 * kernels on the decoded weights. */
static void gemm_block_mxfp4(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                             float *c) {
  const cpumoe_moe_problem *p = r->p;
  const cm_mxfp4_kernels *k = &r->gemm->kernels.mxfp4;
  const int64_t red = cm_stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const int64_t expert = r->panels[blk->first_panel].expert;
  /* the block of rows [row0, row0 + 32): red / 2 bytes of codes and red / 32 scales a row */
  const uint8_t *w = (const uint8_t *)(stage == 1 ? p->w1 : p->w2) +
                     (size_t)(expert * out_rows + row0) * (size_t)(red / 2);
  const uint8_t *scales = (stage == 1 ? p->w1_scale_e8m0 : p->w2_scale_e8m0) +
                          (size_t)(expert * out_rows + row0) * (size_t)(red / CM_MXFP4_GROUP);
  if (r->panels[blk->first_panel].decode) {
    float *cq = c;
    for (int32_t q = 0; q < blk->panels; q++) {
      const cm_panel *pn = &r->panels[blk->first_panel + q];
      size_t a_stride;
      const void *panel = cm_panel_operand(r, pn, stage, 0, &a_stride);
      k->gemm_decode((size_t)pn->rows, (size_t)red, panel, a_stride, w, scales, cq, 0);
      cq += (size_t)pn->rows * CM_NR;
    }
    return;
  }
  CM_ALIGNED uint16_t decoded[CM_MXFP4_KC * CM_NR];
  for (int64_t k0 = 0; k0 < red; k0 += CM_MXFP4_KC) {
    const int64_t kc = red - k0 < CM_MXFP4_KC ? red - k0 : CM_MXFP4_KC;
    /* k pair k0 / 2 of the block, group k0 / 32 */
    k->decode_chunk((size_t)kc, w + (size_t)k0 * (CM_MXFP4_KP_BYTES / 2),
                    scales + (size_t)(k0 / CM_MXFP4_GROUP) * CM_NR, decoded);
    const uint8_t *next = w + (size_t)(k0 + kc) * (CM_MXFP4_KP_BYTES / 2);
    float *cq = c;
    for (int32_t q = 0; q < blk->panels; q++) {
      const cm_panel *pn = &r->panels[blk->first_panel + q];
      size_t a_stride;
      const void *panel = cm_panel_operand(r, pn, stage, k0, &a_stride);
      k->gemm_chunk((size_t)pn->rows, (size_t)kc, panel, a_stride, decoded, cq, k0 > 0,
                    cm_prefetch_share(next, (size_t)kc * (CM_MXFP4_KP_BYTES / 2), q, blk->panels));
      cq += (size_t)pn->rows * CM_NR;
    }
  }
}

const cm_scheme_traits cm_scheme_mxfp4 = {
    .name = "MXFP4",
    .validate = validate_mxfp4,
    .w1_row_bytes = w1_row_bytes_mxfp4,
    .gemm_block = gemm_block_mxfp4,
};
