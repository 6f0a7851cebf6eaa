/*
 * Scheme INT4_W4A8 (moe_comp_method 3): AWQ/GPTQ 4-bit weights with a zero point and an
 * fp32 scale per group of reduction steps, packed by schemes/int4/pack.c (common/int4.h has
 * the geometry); activations quantized per row to u8 as for INT8. Each packed block's
 * integer sum of q (w - zero) is exact; it is folded into C with one fmaf per block and the
 * group scale, so the decode path (nibbles expanded in registers) and the unpack path give
 * the same bits.
 */
#include "common/error.h"
#include "common/int4.h"
#include "moe/pipeline.h"

#define CM_INT4_KC 256 /* reduction chunk unpacked at once by the prefill path: 8 KiB */

static cpumoe_status validate_int4(const cpumoe_moe_problem *p) {
  if (!p->w1_scale || !p->w2_scale || !p->w1_zero || !p->w2_zero)
    return cm_fail(CPUMOE_EINVAL, "INT4 W4A8 needs w1_scale, w2_scale, w1_zero and w2_zero");
  if (cm_int4_block_k_of_group(p->w1_group) == 0 || p->K % p->w1_group != 0 ||
      cm_int4_block_k_of_group(p->w2_group) == 0 || p->N % p->w2_group != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "INT4 W4A8 group sizes %lld (w1, over K=%lld) and %lld (w2, over N=%lld) "
                   "must divide their reductions and be multiples of 4 that are <= 128 or "
                   "multiples of 128",
                   (long long)p->w1_group, (long long)p->K, (long long)p->w2_group,
                   (long long)p->N);
  return CPUMOE_OK;
}

/* nibbles and block sums take at most 1.5 K bytes, group scales at most K */
static int64_t w1_row_bytes_int4(const cpumoe_moe_problem *p) {
  return 2 * p->K;
}

/* packed blocks along the reduction of gemm `stage` */
static int64_t reduction_blocks_int4(const cpumoe_moe_problem *p, int stage) {
  const int64_t red = stage == 1 ? p->K : p->N;
  return red / cm_int4_block_k_of_group(stage == 1 ? p->w1_group : p->w2_group);
}

/* The 32 weight rows [row0, row0 + 32) of the stage's matrix for one expert. */
static cm_int4_tile int4_tile(const cm_run *r, int stage, int64_t expert, int64_t row0) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = cm_stage_reduction(r, stage);
  const int64_t group = stage == 1 ? p->w1_group : p->w2_group;
  const int64_t bk = cm_int4_block_k_of_group(group);
  const int64_t tile = expert * ((stage == 1 ? 2 * p->N : p->K) / CM_NR) + row0 / CM_NR;
  const int64_t k_blocks = red / bk, groups = red / group;
  const uint8_t *w = (const uint8_t *)(stage == 1 ? p->w1 : p->w2);
  return (cm_int4_tile){
      .blocks = w + (size_t)(tile * k_blocks) * cm_int4_block_bytes((size_t)bk),
      .zeros = (stage == 1 ? p->w1_zero : p->w2_zero) + (size_t)(tile * groups * CM_NR),
      .scales = (stage == 1 ? p->w1_scale : p->w2_scale) + (size_t)(tile * groups * CM_NR),
      .bk = (size_t)bk,
      .group_blocks = (size_t)(group / bk),
  };
}

/* Few rows: nibbles expand in registers (decode: the weights are read once). More rows:
 * each chunk of blocks is unpacked once into an L1-resident s8 tile that every panel runs
 * the u8 x s8 GEMM on, while those GEMM calls prefetch the next chunk's packed blocks in
 * equal shares (a burst in the unpack loop stalls it on the memory system). Both paths give
 * the same bits (exact block sums, one fmaf per block). The per-row activation scale
 * multiplies the finished tile. */
static void gemm_block_int4(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                            float *c) {
  const cm_int4_kernels *k = &r->gemm->kernels.int4;
  const int64_t expert = r->panels[blk->first_panel].expert;
  const cm_int4_tile w = int4_tile(r, stage, expert, row0);
  const size_t bk = w.bk, k_blocks = (size_t)cm_stage_reduction(r, stage) / bk;
  if (r->panels[blk->first_panel].decode) {
    float *cq = c;
    for (int32_t q = 0; q < blk->panels; q++) {
      const cm_panel *pn = &r->panels[blk->first_panel + q];
      size_t a_stride;
      const uint8_t *panel = cm_panel_operand(r, pn, stage, 0, &a_stride);
      k->gemm_decode((size_t)pn->rows, &w, 0, k_blocks, panel, a_stride,
                     r->q_sums[stage - 1] + (size_t)pn->first * k_blocks, cq, 0);
      cq += (size_t)pn->rows * CM_NR;
    }
  } else {
    CM_ALIGNED int8_t unpacked[CM_INT4_KC * CM_NR];
    CM_ALIGNED int32_t acc[CM_MR_MAX * CM_NR];
    const size_t chunk = bk < CM_INT4_KC ? CM_INT4_KC / bk : 1;
    for (size_t kb0 = 0; kb0 < k_blocks; kb0 += chunk) {
      const size_t nb = k_blocks - kb0 < chunk ? k_blocks - kb0 : chunk;
      k->unpack(&w, kb0, nb, unpacked);
      /* the next chunk's packed blocks, requested a share per GEMM call (as for INT8) */
      const uint8_t *next_chunk = w.blocks + (kb0 + nb) * cm_int4_block_bytes(bk);
      const size_t next_bytes = nb * cm_int4_block_bytes(bk);
      const int32_t calls = blk->panels * (int32_t)nb;
      float *cq = c;
      for (int32_t q = 0; q < blk->panels; q++) {
        const cm_panel *pn = &r->panels[blk->first_panel + q];
        const size_t rows = (size_t)pn->rows;
        for (size_t b = 0; b < nb; b++) {
          const size_t kb = kb0 + b;
          size_t a_stride;
          const uint8_t *panel = cm_panel_operand(r, pn, stage, (int64_t)(kb * bk), &a_stride);
          k->gemm_u8s8(
              rows, bk, panel, a_stride, unpacked + b * bk * CM_NR, acc, 0,
              cm_prefetch_share(next_chunk, next_bytes, q * (int32_t)nb + (int32_t)b, calls));
          k->dequant(rows, acc, w.blocks + kb * cm_int4_block_bytes(bk) + 16 * bk,
                     w.scales + (kb / w.group_blocks) * CM_NR, cq, kb > 0, kb + 1 == k_blocks);
        }
        cq += rows * CM_NR;
      }
    }
  }
  /* a call per panel, in place: row by row into a buffer and back, the dense INT4 linear (q,
   * M = 512) took 1.03-1.04x the time (docs/PERFORMANCE-HISTORY.md, "INT4's activation
   * scales per panel") */
  float *cq = c;
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    r->ew->scale_rows((size_t)pn->rows, CM_NR, cq, r->a_scale[stage - 1] + pn->first);
    cq += (size_t)pn->rows * CM_NR;
  }
}

const cm_scheme_traits cm_scheme_int4 = {
    .name = "INT4 W4A8",
    .validate = validate_int4,
    .w1_row_bytes = w1_row_bytes_int4,
    .reduction_blocks = reduction_blocks_int4,
    .gemm_block = gemm_block_int4,
};
