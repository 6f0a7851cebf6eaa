/*
 * The dense linear (cpumoe_linear): out = round16(W x + bias) for one packed weight, on the
 * fused MoE's own code path. The linear is the first GEMM of a one-expert MLP with no
 * routing (E = 1, topk = 1): the chunk's rows are routed by moe/route.c into panels and
 * blocks as a shared expert's are, packed by moe/panels.c, and each 32-column tile of W is
 * the scheme's gemm_block of stage 1, so every output element is computed by the same
 * kernel calls, in the same order, as fused_experts computes h = W1 x for that row. Then
 * bias and one rounding, where fused_experts goes on to its activation. One difference:
 * where the config asks for it (linear_block_panels), a block holds 8 panels instead of 4,
 * each weight chunk then serving twice the rows from L1 (Qwen3 q projection M = 512, amx:
 * bf16 0.90x, INT4 0.94x the time); route keeps the fused MoE's block boundary before a
 * tail short enough for the decode kernel, and the other panels give the same bits in a
 * block of either size (a reduction split into chunks reloads C exactly).
 *
 * SHAPES     x [M, K], W [N, K] packed (N output features), bias [N], out [M, N]
 * DEFINITION out[m, n] = round16(C[m, n] + bias[n]), C = gemm_block's fp32 tile (INT8/INT4:
 *            x[m] quantized per row first; docs/MATH.md)
 * STAGES per chunk of at most CM_CHUNK_TOKENS rows: route (serial), prep (quantized panel
 *            formats: each row quantized once), pack1 (task per panel), gemm (task per
 *            (block, 32 output columns)).
 * ORDER      gemm tasks go group by group, a group being consecutive blocks whose A panels
 *            fit CM_LINEAR_GROUP_PANEL_BYTES; within a group tile by tile, and the group's
 *            blocks one after another on each tile. A tile of W is thus read from memory
 *            once per group while the group's panels stay in cache. Workers own contiguous
 *            runs of tasks: decode (one block) splits over the tiles, prefill over groups
 *            and tiles. The order changes no result (each task is a fixed computation).
 * OUTPUT     a task writes 64 bytes of each of its rows, N * 2 bytes apart. Above
 *            CM_CACHED_RESULT_BYTES of output these go out with streaming stores: plain
 *            stores read every line first and, the rows of a task being a multiple of 4 KiB
 *            apart for N % 2048 == 0, all fall into one L1 set. Qwen3 q projection M = 512
 *            (4 MiB out), amx tier: bf16 0.87x, INT8 0.86x, INT4 0.78x the time.
 * EXAMPLE    Qwen3-30B-A3B attention: K=2048 -> N=4096 (q projection) and K=4096 -> N=2048
 *            (o projection); M=1 is 128 or 64 tasks of one row, each streaming a 32-row tile.
 */
#include <string.h>

#include "common/error.h"
#include "common/parallel.h"
#include "common/sizes.h"
#include "moe/pipeline.h"

/* A panels of one task group. With the tile of W being read (32 rows x K: 64 K bytes of
 * 16-bit weights) they fit a 2 MiB L2 (Sapphire Rapids); on a smaller L2 the panels come
 * from L3 instead. A design choice, not tuned by measurement. */
#define CM_LINEAR_GROUP_PANEL_BYTES ((size_t)1 << 20)

typedef struct cm_linear_run {
  cm_run run; /* the first-GEMM fields of a fused MoE chunk */
  const cpumoe_linear_problem *lp;
  int64_t group_blocks; /* blocks per task group */
  int stream_out;       /* out is written with streaming stores (CM_CACHED_RESULT_BYTES) */
} cm_linear_run;

/* The linear as the one-expert MLP whose first GEMM it is: w1 is the linear's weight, its
 * rows [32 t, 32 t + 32) the tile gemm_block(stage 1) computes, and the second GEMM never
 * runs. The scheme's validate checks both weights of an MLP, so w2 repeats w1 with N = K (a
 * K x K second weight): it then checks the linear's scales, zero points and block or group
 * sizes twice over. N enters gemm_block's first stage only through the expert stride, which
 * expert 0 never uses. */
static cpumoe_moe_problem as_mlp(const cpumoe_linear_problem *lp) {
  return (cpumoe_moe_problem){
      .M = lp->M,
      .K = lp->K,
      .N = lp->K,
      .E = 1,
      .topk = 1,
      .scheme = lp->scheme,
      .act_dtype = lp->act_dtype,
      .activation = CPUMOE_ACT_SILU_MUL,
      .x = lp->x,
      .w1 = lp->w,
      .w2 = lp->w,
      .w1_scale = lp->w_scale,
      .w2_scale = lp->w_scale,
      .block_n = lp->block_n,
      .block_k = lp->block_k,
      .w1_zero = lp->w_zero,
      .w2_zero = lp->w_zero,
      .w1_group = lp->w_group,
      .w2_group = lp->w_group,
      .out = lp->out,
  };
}

static cpumoe_status validate_linear(const cpumoe_linear_problem *p) {
  if (!p) return cm_fail(CPUMOE_EINVAL, "problem is NULL");
  if (p->M < 0) return cm_fail(CPUMOE_EINVAL, "M must be >= 0, got %lld", (long long)p->M);
  if (p->K <= 0 || p->N <= 0)
    return cm_fail(CPUMOE_EINVAL, "K and N must be positive (K=%lld N=%lld)", (long long)p->K,
                   (long long)p->N);
  const cm_scheme_traits *traits = cm_scheme_traits_of(p->scheme);
  if (!traits)
    return cm_fail(CPUMOE_EUNSUPPORTED, "scheme %d is not implemented in this build",
                   (int)p->scheme);
  if (p->act_dtype != CPUMOE_DTYPE_BF16 && p->act_dtype != CPUMOE_DTYPE_F16)
    return cm_fail(CPUMOE_EINVAL, "activations must be bf16 or fp16");
  if (p->K % 32 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "input features K=%lld must be a multiple of 32 (pad x and W with zeros)",
                   (long long)p->K);
  if (p->N % 32 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "output features N=%lld must be a multiple of 32 (pad W's rows with zeros)",
                   (long long)p->N);
  if (p->K > CM_MAX_DIM || p->N > CM_MAX_DIM)
    return cm_fail(CPUMOE_EUNSUPPORTED, "sizes K=%lld N=%lld exceed the supported K, N <= 2^30",
                   (long long)p->K, (long long)p->N);
  /* x and out take 2 bytes an element; every weight, scale and zero tensor of a scheme at
   * most 4 N K bytes (INT4 blocks 0.5 + 4 / bk bytes a weight, FP8 scales 4 bytes per block
   * of at least 2) */
  if (cm_size_product(p->M, p->K, 2) < 0 || cm_size_product(p->M, p->N, 2) < 0 ||
      cm_size_product(p->N, p->K, 4) < 0)
    return cm_fail(CPUMOE_EINVAL,
                   "sizes M=%lld K=%lld N=%lld give more bytes than a tensor can hold",
                   (long long)p->M, (long long)p->K, (long long)p->N);
  const cpumoe_moe_problem mlp = as_mlp(p);
  const cpumoe_status st = traits->validate(&mlp);
  if (st != CPUMOE_OK) { /* its message names w1 and w2: say what they stand for */
    char why[256];
    strncpy(why, cpumoe_last_error(), sizeof why - 1);
    why[sizeof why - 1] = '\0';
    return cm_fail(st, "the weight, checked as w1 and w2 of a one-expert MLP: %s", why);
  }
  if (p->M > 0 && (!p->x || !p->w || !p->out))
    return cm_fail(CPUMOE_EINVAL, "x, w and out must not be NULL");
  return CPUMOE_OK;
}

static const cm_gemm_config *gemm_config(const cpumoe_linear_problem *p) {
  return &cm_active_config()->gemm[p->scheme][p->act_dtype];
}

size_t cpumoe_linear_workspace_size(const cpumoe_linear_problem *p) {
  if (validate_linear(p) != CPUMOE_OK) return 0;
  const cpumoe_moe_problem mlp = as_mlp(p);
  return cm_plan_layout_gemm1(&mlp, gemm_config(p)).total;
}

static void prepare_task(void *ctx, int64_t t) {
  const cm_run *r = &((const cm_linear_run *)ctx)->run;
  r->prepare_token(r, t);
}

static void pack_task(void *ctx, int64_t t) {
  const cm_run *r = &((const cm_linear_run *)ctx)->run;
  const cm_panel *pn = &r->panels[t];
  cm_panel_packer_of(r, pn)->pack(r, pn, 1);
}

/* Task t -> (block, tile) in the order of the header (ORDER). */
static const cm_block *task_block(const cm_linear_run *lr, int64_t t, int64_t *tile) {
  const cm_run *r = &lr->run;
  const int64_t tiles = r->n_tiles1, group_tasks = lr->group_blocks * tiles;
  const int64_t first = t / group_tasks * lr->group_blocks; /* the group's first block */
  const int64_t blocks =
      r->n_blocks - first < lr->group_blocks ? r->n_blocks - first : lr->group_blocks;
  const int64_t local = t - first * tiles;
  *tile = local / blocks;
  return &r->blocks[first + local % blocks];
}

static void gemm_task(void *ctx, int64_t t) {
  const cm_linear_run *lr = (const cm_linear_run *)ctx;
  const cm_run *r = &lr->run;
  const cpumoe_linear_problem *p = lr->lp;
  int64_t tile; /* output columns [32 tile, 32 tile + 32) */
  const cm_block *blk = task_block(lr, t, &tile);
  CM_ALIGNED float c[CM_PANELS_PER_BLOCK_MAX * CM_MR_MAX * CM_NR];
  float row[CM_NR];
  r->traits->gemm_block(r, blk, 1, 32 * tile, c);
  /* topk = 1 and one expert: sorted positions are the chunk's rows, in order */
  const int64_t first = r->panels[blk->first_panel].first, rows = cm_block_rows(r, blk);
  const float *bias = p->bias ? p->bias + 32 * tile : NULL;
  uint16_t *out = (uint16_t *)p->out + (size_t)(r->m0 + first) * (size_t)p->N + 32 * tile;
  for (int64_t i = 0; i < rows; i++, out += p->N) {
    const float *h = c + i * CM_NR;
    if (bias) { /* (h + bias) * 1: the fp32 sum fused_experts forms, exactly */
      r->ew->bias_scale(CM_NR, h, bias, 1.0f, row);
      h = row;
    }
    if (lr->stream_out) {
      CM_ALIGNED uint16_t narrowed[CM_NR];
      r->narrow(CM_NR, h, narrowed);
      r->ew->copy_stream(sizeof narrowed, narrowed, out);
    } else {
      r->narrow(CM_NR, h, out);
    }
  }
}

cpumoe_status cpumoe_linear(const cpumoe_linear_problem *p, void *workspace, size_t workspace_bytes,
                            const cpumoe_runner *runner) {
  cpumoe_status st = validate_linear(p);
  if (st != CPUMOE_OK) return st;
  if (p->M == 0) return CPUMOE_OK;
  const cm_tier_config *tier = cm_active_config();
  const cm_gemm_config *gemm = &tier->gemm[p->scheme][p->act_dtype];
  const cpumoe_moe_problem mlp = as_mlp(p);
  const cm_layout l = cm_plan_layout_gemm1(&mlp, gemm);
  if (!workspace || workspace_bytes < l.total)
    return cm_fail(CPUMOE_EWORKSPACE, "workspace of %zu bytes given, %zu needed", workspace_bytes,
                   l.total);
  char *ws = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
  const cm_panel_packer *packer = &cm_panel_packers[gemm->a_format];
  /* blocks of the config's linear_block_panels where their A panels fit the group's bytes */
  const size_t panel_bytes = gemm->mr * (size_t)p->K * packer->elem_bytes;
  const int64_t panels_per_block =
      gemm->linear_block_panels == CM_PANELS_PER_BLOCK_MAX &&
              panel_bytes * CM_PANELS_PER_BLOCK_MAX <= CM_LINEAR_GROUP_PANEL_BYTES
          ? CM_PANELS_PER_BLOCK_MAX
          : CM_PANELS_PER_BLOCK;
  const size_t block_panel_bytes = panel_bytes * (size_t)panels_per_block;
  cm_linear_run lr = {
      .run = cm_run_gemm1(&mlp, tier, gemm, &l, ws),
      .lp = p,
      .group_blocks = block_panel_bytes >= CM_LINEAR_GROUP_PANEL_BYTES
                          ? 1
                          : (int64_t)(CM_LINEAR_GROUP_PANEL_BYTES / block_panel_bytes),
      .stream_out = (size_t)p->M * (size_t)p->N * 2 > CM_CACHED_RESULT_BYTES,
  };
  cm_run *r = &lr.run;
  r->panels_per_block = panels_per_block;
  r->n_tiles1 = p->N / CM_NR; /* the linear's output tiles (as_mlp's N is K) */
  for (int64_t m0 = 0; m0 < p->M; m0 += CM_CHUNK_TOKENS) {
    r->m0 = m0;
    r->mc = p->M - m0 < CM_CHUNK_TOKENS ? p->M - m0 : CM_CHUNK_TOKENS;
    r->put_a = cm_result_copy(r->ew, (size_t)r->mc * (size_t)p->K * 2);
    cm_route_chunk(r, (int64_t *)(ws + l.offsets), (int32_t *)(ws + l.sorted),
                   (float *)(ws + l.weights), (cm_panel *)(ws + l.panels),
                   (cm_block *)(ws + l.blocks));
    int64_t n_panels = 0;
    for (int64_t b = 0; b < r->n_blocks; b++) n_panels += r->blocks[b].panels;
    const cm_stage stages[] = {
        {r->prepare_token ? r->mc : 0, prepare_task},
        {n_panels, pack_task},
        {r->n_blocks * r->n_tiles1, gemm_task},
    };
    cm_parallel_stages(runner, stages, (int)(sizeof stages / sizeof stages[0]), &lr, tier->end_op);
  }
  return CPUMOE_OK;
}
