/*
 * Scheme FP8_W8A16 (moe_comp_method 2): e4m3fn weights packed VNNI-2 (pack/pack-vnni2.c)
 * with one fp32 scale per 2-D block of block_n output rows x block_k reduction steps;
 * activations stay 16-bit and go into fp32 panels. e4m3 decodes exactly to fp16 bits
 * times 2^-8 (common/ukernels.h), so every tier sums the same products in the same order.
 */
#include "common/error.h"
#include "common/sizes.h"
#include "moe/pipeline.h"

#define CM_FP8_KC 256 /* reduction chunk decoded at once by the prefill path: 32 KiB of fp32 */

static cpumoe_status validate_fp8(const cpumoe_moe_problem *p) {
  if (!p->w1_scale || !p->w2_scale)
    return cm_fail(CPUMOE_EINVAL, "FP8 W8A16 needs w1_scale and w2_scale");
  if (p->block_n < 1 || p->block_k < 2 || p->block_k % 2 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "FP8 block_size [%lld, %lld]: block_n must be >= 1 and block_k an even "
                   "number >= 2 (the packed layout pairs consecutive k)",
                   (long long)p->block_n, (long long)p->block_k);
  return CPUMOE_OK;
}

static int64_t w1_row_bytes_fp8(const cpumoe_moe_problem *p) {
  return p->K;
}

/* The block scales: [E, ceil(rows / block_n), ceil(reduction / block_k)] fp32. Small
 * blocks make them larger than the weights. */
static int64_t scale_bytes_fp8(const cpumoe_moe_problem *p, int stage) {
  const int64_t rows = stage == 1 ? 2 * p->N : p->K, red = stage == 1 ? p->K : p->N;
  return cm_size_product(
      cm_size_product(p->E, cm_ceil_div(rows, p->block_n), cm_ceil_div(red, p->block_k)), 4, 1);
}

/* The reduction is walked K block by K block (one scale per column within a block): each
 * block's products are summed unscaled, then folded in with the block's scale
 * (common/ukernels.h). A block of few rows decodes in registers, one call per K block
 * (decode: weights are read once); a block with more converts each chunk of a K block
 * once into an L1-resident buffer (fp32 or bf16, the config's gemm_chunk kernel's B), runs
 * all its panels on it into per-panel block sums, and folds those at the K block's end (a
 * K block of one chunk: each panel's right after its tile calls). C holds the result times
 * 2^-8 (the decoded weights' scaling) until the last fold, or the decode path's pass after
 * it, takes it out. Within a numerics class both give the same bits. */
static void gemm_block_fp8(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                           float *c) {
  const cpumoe_moe_problem *p = r->p;
  const cm_fp8_kernels *k = &r->gemm->kernels.fp8;
  const int64_t red = cm_stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const int64_t k_blocks = cm_ceil_div(red, p->block_k);
  const int64_t n_blocks = cm_ceil_div(out_rows, p->block_n);
  const int64_t expert = r->panels[blk->first_panel].expert;
  const uint8_t *w = (const uint8_t *)(stage == 1 ? p->w1 : p->w2) +
                     (size_t)expert * (size_t)(out_rows * red) + (size_t)(row0 * red);
  const float *scales =
      (stage == 1 ? p->w1_scale : p->w2_scale) + (size_t)(expert * n_blocks * k_blocks);
  const int convert = !r->panels[blk->first_panel].decode;
  float col_scale[CM_NR];
  CM_ALIGNED float decoded[CM_FP8_KC * CM_NR]; /* room for fp32 values */
  /* per panel, the K block's P in a slot of CM_MR_MAX rows (the gemm_chunk contract); the
   * first slot alone when the K block is one chunk */
  CM_ALIGNED float sums[CM_PANELS_PER_BLOCK_MAX * CM_MR_MAX * CM_NR];
  const float *scale_row[CM_NR]; /* each column's row of block scales, found once */
  /* stepped from column to column, not divided per column */
  int64_t n_block = row0 / p->block_n, next_block_row = (n_block + 1) * p->block_n;
  for (int j = 0; j < CM_NR; j++) {
    if (row0 + j == next_block_row) n_block++, next_block_row += p->block_n;
    scale_row[j] = scales + n_block * k_blocks;
  }
  /* all 32 columns in one scale block (block_n = 128 in the checkpoints): one load per K
   * block instead of 32 */
  const int one_scale = scale_row[0] == scale_row[CM_NR - 1];
  for (int64_t kb = 0; kb < k_blocks; kb++) {
    const int64_t k_begin = kb * p->block_k;
    const int64_t k_end = k_begin + p->block_k < red ? k_begin + p->block_k : red;
    if (one_scale) {
      const float s = scale_row[0][kb];
      for (int j = 0; j < CM_NR; j++) col_scale[j] = s;
    } else {
      for (int j = 0; j < CM_NR; j++) col_scale[j] = scale_row[j][kb];
    }
    if (!convert) {
      float *cq = c;
      for (int32_t q = 0; q < blk->panels; q++) {
        const cm_panel *pn = &r->panels[blk->first_panel + q];
        const size_t rows = (size_t)pn->rows;
        size_t a_stride;
        const void *panel = cm_panel_operand(r, pn, stage, k_begin, &a_stride);
        k->gemm_decode(rows, (size_t)(k_end - k_begin), panel, a_stride, w + k_begin * CM_NR,
                       col_scale, cq, kb > 0);
        cq += rows * CM_NR;
      }
      continue;
    }
    /* C holds the result times 2^-8; the last fold scales it back */
    const float post = kb + 1 == k_blocks ? 256.0f : 1.0f;
    /* a K block of one chunk (block_k <= CM_FP8_KC, 128 in the checkpoints) folds each panel's
     * sums right after its tile calls, through one panel's buffer that stays in L1 */
    const int one_chunk = k_end - k_begin <= CM_FP8_KC;
    for (int64_t k0 = k_begin; k0 < k_end; k0 += CM_FP8_KC) {
      const int64_t kc = k_end - k0 < CM_FP8_KC ? k_end - k0 : CM_FP8_KC;
      k->decode_chunk((size_t)kc, w + k0 * CM_NR, decoded);
      float *sq = sums, *cq = c;
      for (int32_t q = 0; q < blk->panels; q++) {
        const cm_panel *pn = &r->panels[blk->first_panel + q];
        const size_t rows = (size_t)pn->rows;
        size_t a_stride;
        const void *panel = cm_panel_operand(r, pn, stage, k0, &a_stride);
        /* the chunk is in L1; a tile kernel requests a share of the next chunk's weights
         * meanwhile, so the memory stream goes on while the tiles compute */
        k->gemm_chunk(rows, (size_t)kc, panel, a_stride, decoded, sq, k0 > k_begin,
                      cm_prefetch_share(w + (k0 + kc) * CM_NR, (size_t)kc * CM_NR, q, blk->panels));
        if (one_chunk)
          k->fold(rows, sq, col_scale, cq, kb > 0, post);
        else
          sq += CM_MR_MAX * CM_NR;
        cq += rows * CM_NR;
      }
    }
    if (one_chunk) continue;
    float *cq = c, *sq = sums;
    for (int32_t q = 0; q < blk->panels; q++) {
      const size_t rows = (size_t)r->panels[blk->first_panel + q].rows;
      k->fold(rows, sq, col_scale, cq, kb > 0, post);
      cq += rows * CM_NR, sq += CM_MR_MAX * CM_NR;
    }
  }
  if (convert) return;
  const size_t tile_values = (size_t)cm_block_rows(r, blk) * CM_NR;
  for (size_t i = 0; i < tile_values; i++) c[i] *= 256.0f; /* C held the result times 2^-8 */
}

const cm_scheme_traits cm_scheme_fp8 = {
    .name = "FP8 W8A16",
    .validate = validate_fp8,
    .w1_row_bytes = w1_row_bytes_fp8,
    .scale_bytes = scale_bytes_fp8,
    .gemm_block = gemm_block_fp8,
};
