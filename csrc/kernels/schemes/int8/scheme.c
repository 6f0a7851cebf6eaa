/*
 * Scheme INT8_W8A8 (moe_comp_method 1): int8 weights with one fp32 scale per output
 * channel, packed VNNI-4 with a compensation row (schemes/int8/pack-vnni4.c); activations
 * quantized per row to u8 (q + 128) in the panels. The int32 dot products are exact, so the
 * reduction may be cut into chunks in any order; the dequantization is one fixed sequence
 * of fp32 operations per element (common/ukernels.h).
 */
#include "common/error.h"
#include "moe/pipeline.h"

#define CM_INT8_KC 256 /* reduction chunk of the block GEMM: 8 KiB of weights */

static cpumoe_status validate_int8(const cpumoe_moe_problem *p) {
  if (!p->w1_scale || !p->w2_scale)
    return cm_fail(CPUMOE_EINVAL, "INT8 W8A8 needs w1_scale and w2_scale");
  if (p->K > CM_INT8_MAX_REDUCTION || p->N > CM_INT8_MAX_REDUCTION)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "INT8 W8A8 sums K=%lld and N=%lld products exactly in int32 only up to %d",
                   (long long)p->K, (long long)p->N, CM_INT8_MAX_REDUCTION);
  return CPUMOE_OK;
}

static int64_t w1_row_bytes_int8(const cpumoe_moe_problem *p) {
  return p->K + 4; /* the weights, then the row's int32 compensation */
}

/* The reduction is walked in chunks of CM_INT8_KC, each chunk applied to every panel of
 * the block before the next: the chunk of weights comes from memory once and is reused
 * from L1 by the other panels, while each panel's call prefetches its share of the next
 * chunk, so streaming and dot products overlap (integer sums are exact in any order).
 * After the last chunk that is the head of the next tile, which the next task reads. A
 * block of one panel has nothing to share: its calls read ahead on their own; nor has a
 * block of up to the config's block_rows_max rows, which goes through one call. */
static void gemm_block_int8(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                            float *c) {
  const cpumoe_moe_problem *p = r->p;
  const cm_int8_kernels *k = &r->gemm->kernels.int8;
  const int64_t red = cm_stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const int64_t expert = r->panels[blk->first_panel].expert;
  const int8_t *w = (const int8_t *)(stage == 1 ? p->w1 : p->w2) +
                    (size_t)expert * (size_t)(out_rows * (red + 4)) + (size_t)(row0 * (red + 4));
  const float *w_scale =
      (stage == 1 ? p->w1_scale : p->w2_scale) + (size_t)expert * (size_t)out_rows + row0;
  const cm_gemm_u8s8_fn gemm = r->panels[blk->first_panel].decode ? k->gemm_decode : k->gemm;
  /* [panel][row][column]; a block in one call fills the panels' rows in turn */
  CM_ALIGNED int32_t acc[CM_PANELS_PER_BLOCK_MAX][CM_MR_MAX * CM_NR];
  _Static_assert(CM_PANELS_PER_BLOCK_MAX * CM_MR_MAX >= CM_AMX_CALL_ROWS, "one call's rows");
  if (cm_block_one_call(r, blk)) {
    /* a block of up to the config's block_rows_max rows (amx: 33-48, two panels at one row
     * stride) in one call that stages its own weights, as bf16's (unquant/scheme.c): Qwen3
     * M = 512 0.944-0.995x the time of the chunks (docs/PERFORMANCE-HISTORY.md) */
    size_t a_stride;
    const uint8_t *panel = cm_panel_operand(r, &r->panels[blk->first_panel], stage, 0, &a_stride);
    gemm((size_t)cm_block_rows(r, blk), (size_t)red, panel, a_stride, w, acc[0], 0,
         CM_PREFETCH_SELF);
  } else {
    /* one panel shares nothing: one call over the whole reduction (a tile kernel then loads
     * and stores its accumulators once), nor does a block the config runs panel by panel. The
     * dense linear's blocks of 8 panels take chunks of twice the size: a tile kernel's call is
     * then 8 k steps instead of 4 per load and store of its accumulators (Qwen3 q projection
     * M = 512, amx: 0.91x the time, o projection 0.93x); in the fused MoE's blocks of up to 4
     * panels, chunks of 512 took 1.03x the time at M = 512. */
    const int64_t chunk = cm_block_chunk(
        r, blk, red, blk->panels > CM_PANELS_PER_BLOCK ? 2 * CM_INT8_KC : CM_INT8_KC);
    for (int64_t k0 = 0; k0 < red; k0 += chunk) {
      const size_t kc = (size_t)(red - k0 < chunk ? red - k0 : chunk);
      for (int32_t q = 0; q < blk->panels; q++) {
        const cm_panel *pn = &r->panels[blk->first_panel + q];
        size_t a_stride;
        const uint8_t *panel = cm_panel_operand(r, pn, stage, k0, &a_stride);
        gemm((size_t)pn->rows, kc, panel, a_stride, w + k0 * CM_NR, acc[q], k0 > 0,
             cm_block_prefetch(r, blk, q, w + (k0 + chunk) * CM_NR, (size_t)chunk * CM_NR));
      }
    }
  }
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    k->dequant((size_t)pn->rows, acc[q], w + CM_NR * red, r->a_scale[stage - 1] + pn->first,
               w_scale, c);
    c += (size_t)pn->rows * CM_NR;
  }
}

const cm_scheme_traits cm_scheme_int8 = {
    .name = "INT8 W8A8",
    .validate = validate_int8,
    .w1_row_bytes = w1_row_bytes_int8,
    .gemm_block = gemm_block_int8,
};
