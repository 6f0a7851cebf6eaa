/*
 * The fused MoE op: its entry points and the tasks of its stages (moe/pipeline.h has the
 * loop nest they implement and the stage list). Every kernel is reached through the
 * active tier's config, every scheme-specific step through the scheme's traits and its
 * panel format's packer: nothing here tests an ISA or a scheme.
 */
#include <string.h>

#include "common/error.h"
#include "common/parallel.h"
#include "moe/pipeline.h"

/* Columns summed per step of the reduce stage: a token's topk rows of y are consecutive, and
 * whole rows of 2048 (Qwen3's K) read them in one pass each rather than four. A timing build
 * (bf16 Qwen3 M = 512, worker 0): the stage 1.55 -> 1.38 ms per call against 512 columns. */
#define CM_REDUCE_COLS 2048

/* Task t of a gemm stage with `tiles` column tiles per block -> (block, tile).
 * Tasks are numbered expert by expert and, within an expert, tile-major: the blocks
 * of one expert that need the same weight tile run back to back, so the tile is
 * read from memory once and then hit in cache (e.g. Mixtral prefill, 3 blocks per
 * expert). The first task of an expert is expert_first_block * tiles. */
static const cm_block *task_block(const cm_block *blocks, int64_t t, int64_t tiles, int64_t *tile) {
  const cm_block *any = &blocks[t / tiles];
  const int64_t local = t - (int64_t)any->expert_first_block * tiles;
  *tile = local / any->expert_blocks;
  return &blocks[any->expert_first_block + local % any->expert_blocks];
}

static void prepare_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  r->prepare_token(r, t);
}

static void pack_panel(const cm_run *r, const cm_panel *pn, int stage) {
  cm_panel_packer_of(r, pn)->pack(r, pn, stage);
}

static void pack1_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  pack_panel(r, &r->panels[t], 1);
}

static void pack2_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  pack_panel(r, &r->panels[t], 2);
}

/* out = the problem's activation of (gate, up): the one place that maps an activation to
 * its kernel, for gemm1_task and cpumoe_activation_values (validated activations only). */
static void apply_activation(const cm_elementwise_kernels *ew, cpumoe_activation activation,
                             float alpha, float limit, size_t n, const float *gate, const float *up,
                             float *out) {
  switch (activation) {
    case CPUMOE_ACT_SILU_MUL: ew->silu_mul(n, gate, up, out); return;
    case CPUMOE_ACT_GELU_MUL: ew->gelu_mul(n, gate, up, out); return;
    case CPUMOE_ACT_SWIGLU_CLAMP: ew->swiglu(n, gate, up, alpha, limit, out); return;
    case CPUMOE_ACT_SILU_CLAMP: ew->silu_clamp(n, gate, up, limit, out); return;
  }
}

void cm_copy_cached(size_t bytes, const void *src, void *dst) {
  memcpy(dst, src, bytes);
}

static void gemm1_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  const cpumoe_moe_problem *p = r->p;
  const int64_t N = p->N;
  int64_t tile; /* intermediate columns [32 tile, 32 tile + 32) */
  const cm_block *blk = task_block(r->blocks, t, r->n_tiles1, &tile);
  const int interleaved = p->activation == CPUMOE_ACT_SWIGLU_CLAMP;
  /* [gate; up] activations: gate rows [32 tile..), up rows [N + 32 tile..); swiglu: rows
   * [64 tile, +64) interleave gate/up. Either way two 32-row weight blocks. */
  const int64_t row0 = interleaved ? 64 * tile : 32 * tile;
  const int64_t row1 = interleaved ? 64 * tile + 32 : N + 32 * tile;
  CM_ALIGNED float c0[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  CM_ALIGNED float c1[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  float gate[CM_NR], up[CM_NR];
  r->traits->gemm_block(r, blk, 1, row0, c0);
  r->traits->gemm_block(r, blk, 1, row1, c1);
  const int64_t expert = r->panels[blk->first_panel].expert;
  const int64_t first = r->panels[blk->first_panel].first; /* the block's rows are consecutive */
  const float *bias = p->w1_bias ? p->w1_bias + (size_t)expert * (size_t)(2 * N) : NULL;
  const int64_t rows = cm_block_rows(r, blk);
  /* gate into c0 and up into c1 as the activation takes them, row by row (each row reads only
   * its own row of both): swiglu's columns de-interleaved, the bias added */
  for (int64_t i = 0; i < rows && (interleaved || bias); i++) {
    float *h0 = c0 + i * CM_NR, *h1 = c1 + i * CM_NR;
    if (interleaved) { /* column j: h rows 64 tile + 2j (gate) and 64 tile + 2j + 1 (up) */
      for (int j = 0; j < CM_NR; j++) {
        const float *h = j < 16 ? h0 : h1;
        const int jj = 2 * (j & 15);
        gate[j] = h[jj] + (bias ? bias[row0 + 2 * j] : 0.0f);
        up[j] = h[jj + 1] + (bias ? bias[row0 + 2 * j + 1] : 0.0f);
      }
      memcpy(h0, gate, sizeof gate);
      memcpy(h1, up, sizeof up);
    } else {
      for (int j = 0; j < CM_NR; j++) h0[j] += bias[row0 + j], h1[j] += bias[row1 + j];
    }
  }
  /* the activation and its rounding over the block at once, then each row to where the down
   * projection reads it (put_mid) */
  CM_ALIGNED float act[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  const size_t values = (size_t)rows * CM_NR;
  apply_activation(r->ew, p->activation, p->alpha, p->limit, values, c0, c1, act);
  r->round16(values, act);
  const cm_panel *pn = &r->panels[blk->first_panel];
  const cm_panel_packer *stage2 = cm_panel_packer_of(r, pn);
  for (int64_t i = 0, in_panel = 0; i < rows; i++, in_panel++) {
    if (in_panel == pn->rows) pn++, in_panel = 0;
    const float *v = act + i * CM_NR;
    if (stage2->store_mid) {
      stage2->store_mid(r, pn, (size_t)in_panel, 32 * tile, v);
    } else { /* exact: the values were rounded to the activation dtype */
      CM_ALIGNED uint16_t v16[CM_NR];
      r->narrow(CM_NR, v, v16);
      r->put_mid(sizeof v16, v16, r->mid + (size_t)(first + i) * (size_t)N + (size_t)(32 * tile));
    }
  }
}

static void gemm2_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  const cpumoe_moe_problem *p = r->p;
  const int64_t K = p->K;
  int64_t tile; /* output columns [32 tile, 32 tile + 32) */
  const cm_block *blk = task_block(r->blocks, t, r->n_tiles2, &tile);
  CM_ALIGNED float c[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  r->traits->gemm_block(r, blk, 2, 32 * tile, c);
  const int64_t expert = r->panels[blk->first_panel].expert;
  const int64_t first = r->panels[blk->first_panel].first;
  const float *bias = p->w2_bias ? p->w2_bias + (size_t)expert * (size_t)K + 32 * tile : NULL;
  const int64_t rows = cm_block_rows(r, blk);
  for (int64_t i = 0; i < rows; i++) {
    const int32_t slot = r->sorted[first + i];
    const float g = r->weights[slot];
    float *y = r->y + (size_t)slot * (size_t)K + (size_t)(32 * tile);
    r->store_y(CM_NR, c + i * CM_NR, bias, g, y); /* read back by reduce_task */
  }
}

static void reduce_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  const cpumoe_moe_problem *p = r->p;
  const int64_t K = p->K, m = r->m0 + t;
  CM_ALIGNED float acc[CM_REDUCE_COLS];
  CM_ALIGNED float res[CM_REDUCE_COLS];
  for (int64_t k0 = 0; k0 < K; k0 += CM_REDUCE_COLS) {
    const size_t n = (size_t)(K - k0 < CM_REDUCE_COLS ? K - k0 : CM_REDUCE_COLS);
    memset(acc, 0, n * sizeof(float));
    for (int64_t j = 0; j < p->topk; j++) {
      const int64_t slot = t * p->topk + j;
      if (cm_slot_expert(p, m * p->topk + j) < 0) continue;
      r->ew->axpy(n, 1.0f, r->y + (size_t)slot * (size_t)K + (size_t)k0, acc);
    }
    if (p->residual) {
      r->widen(n, (const uint16_t *)p->residual + m * K + k0, res);
      r->ew->axpy(n, p->residual_scale, res, acc);
    }
    if (p->out_f32) /* the sum as it stands: the caller adds other partials, then rounds */
      memcpy((float *)p->out + m * K + k0, acc, n * sizeof(float));
    else
      r->narrow(n, acc, (uint16_t *)p->out + m * K + k0);
  }
}

cpumoe_status cpumoe_activation_values(cpumoe_activation activation, float alpha, float limit,
                                       size_t n, const float *gate, const float *up, float *out) {
  if (n > 0 && (!gate || !up || !out))
    return cm_fail(CPUMOE_EINVAL, "gate, up and out must not be NULL");
  const cpumoe_status st = cm_validate_activation(activation, limit);
  if (st != CPUMOE_OK) return st;
  apply_activation(&cm_active_config()->elementwise, activation, alpha, limit, n, gate, up, out);
  return CPUMOE_OK;
}

/* The tier's config for the problem's scheme and activation dtype; NULL if the scheme is
 * unknown (validated problems have a bf16 or fp16 activation dtype). */
static const cm_gemm_config *gemm_config(const cm_tier_config *tier, const cpumoe_moe_problem *p) {
  return cm_scheme_traits_of(p->scheme) ? &tier->gemm[p->scheme][p->act_dtype] : NULL;
}

size_t cpumoe_fused_experts_workspace_size(const cpumoe_moe_problem *p) {
  if (cm_validate_problem(p) != CPUMOE_OK) return 0;
  return cm_plan_layout(p, gemm_config(cm_active_config(), p)).total;
}

cm_run cm_run_gemm1(const cpumoe_moe_problem *p, const cm_tier_config *tier,
                    const cm_gemm_config *gemm, const cm_layout *l, char *ws) {
  const int bf16 = p->act_dtype == CPUMOE_DTYPE_BF16;
  const cm_elementwise_kernels *ew = &tier->elementwise;
  const cm_panel_packer *packer = &cm_panel_packers[gemm->a_format];
  const cm_panel_packer *decode_packer = cm_decode_packer_of(gemm);
  return (cm_run){
      .p = p,
      .ew = ew,
      .gemm = gemm,
      .traits = cm_scheme_traits_of(p->scheme),
      .packer = packer,
      .decode_packer = decode_packer,
      .prepare_token = packer->prepare_token ? packer->prepare_token
                       : decode_packer       ? decode_packer->prepare_token
                                             : NULL,
      .widen = bf16 ? ew->widen_bf16 : ew->widen_f16,
      .narrow = bf16 ? ew->narrow_bf16 : ew->narrow_f16,
      .round16 = bf16 ? ew->round_bf16 : ew->round_f16,
      .put_mid = cm_copy_cached,
      .put_a = cm_copy_cached,
      .mr = gemm->mr,
      .panels_per_block = CM_PANELS_PER_BLOCK,
      .n_tiles1 = p->N / CM_NR,
      .sorted = (const int32_t *)(ws + l->sorted),
      .weights = (const float *)(ws + l->weights),
      .panels = (const cm_panel *)(ws + l->panels),
      .blocks = (const cm_block *)(ws + l->blocks),
      .a = {ws + l->a1, NULL},
      .a_scale = {(float *)(ws + l->as1), NULL},
      .q_sums = {(int32_t *)(ws + l->qs1), NULL},
      .sum_blocks = {l->sum_blocks[0], 0},
      .xq = (uint8_t *)(ws + l->xq),
      .xs = (float *)(ws + l->xs),
  };
}

cpumoe_status cpumoe_fused_experts(const cpumoe_moe_problem *p, void *workspace,
                                   size_t workspace_bytes, const cpumoe_runner *runner) {
  cpumoe_status st = cm_validate_problem(p);
  if (st != CPUMOE_OK) return st;
  if (p->M == 0) return CPUMOE_OK;
  st = cm_validate_ids(p);
  if (st != CPUMOE_OK) return st;
  const cm_tier_config *tier = cm_active_config();
  const cm_gemm_config *gemm = gemm_config(tier, p);
  const cm_layout l = cm_plan_layout(p, gemm);
  if (!workspace || workspace_bytes < l.total)
    return cm_fail(CPUMOE_EWORKSPACE, "workspace of %zu bytes given, %zu needed", workspace_bytes,
                   l.total);
  char *ws = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
  cm_run r = cm_run_gemm1(p, tier, gemm, &l, ws);
  const cm_elementwise_kernels *ew = r.ew;
  r.n_tiles2 = p->K / CM_NR;
  r.a[1] = ws + l.a2;
  r.a_scale[1] = (float *)(ws + l.as2);
  r.q_sums[1] = (int32_t *)(ws + l.qs2);
  r.sum_blocks[1] = l.sum_blocks[1];
  r.mid = (uint16_t *)(ws + l.mid);
  r.midq = (uint8_t *)(ws + l.midq);
  r.y = (float *)(ws + l.y);
  for (int64_t m0 = 0; m0 < p->M; m0 += CM_CHUNK_TOKENS) {
    r.m0 = m0;
    r.mc = p->M - m0 < CM_CHUNK_TOKENS ? p->M - m0 : CM_CHUNK_TOKENS;
    const size_t slots = (size_t)(r.mc * p->topk);
    const int cached_y = slots * (size_t)p->K * sizeof(float) <= CM_CACHED_RESULT_BYTES;
    r.store_y = cached_y ? ew->bias_scale : ew->bias_scale_stream;
    r.put_mid = cm_result_copy(ew, slots * (size_t)p->N * sizeof(uint16_t));
    r.put_a = cm_result_copy(ew, slots * (size_t)p->K * 2);
    cm_route_chunk(&r, (int64_t *)(ws + l.offsets), (int32_t *)(ws + l.sorted),
                   (float *)(ws + l.weights), (cm_panel *)(ws + l.panels),
                   (cm_block *)(ws + l.blocks));
    int64_t n_panels = 0;
    for (int64_t b = 0; b < r.n_blocks; b++) n_panels += r.blocks[b].panels;
    const cm_stage stages[] = {
        {r.prepare_token ? r.mc : 0, prepare_task}, {n_panels, pack1_task},
        {r.n_blocks * r.n_tiles1, gemm1_task},      {n_panels, pack2_task},
        {r.n_blocks * r.n_tiles2, gemm2_task},      {r.mc, reduce_task},
    };
    cm_parallel_stages(runner, stages, (int)(sizeof stages / sizeof stages[0]), &r, tier->end_op);
  }
  return CPUMOE_OK;
}
