/*
 * Fused MoE pipeline, ISA-agnostic: every kernel is reached through the active
 * tier's cm_ukernels table. See DESIGN.md §1 for the math, docs/FORMATS.md for
 * the packed weights, common/ukernels.h for the tile contract.
 *
 * SHAPES     x [M, K], w1 [E, 2N, K] packed, w2 [E, K, N] packed, ids/weights [M, topk]
 * DEFINITION for m, j: e = ids[m, j] (skip -1)
 *              h = W1[e] x[m] + b1[e]           fp32, one FMA chain per element
 *              a = round16(act(h))              act = silu(gate)*up or clamped swiglu
 *              y = (W2[e] a + b2[e]) * w[m, j]   fp32
 *            out[m] = round16(sum_j y + residual_scale * residual[m])
 * STAGES per chunk of at most CM_CHUNK_TOKENS tokens (bounds the workspace):
 *   route   serial: validate ids, counting-sort the M*topk slots by expert (stable),
 *           cut each expert's slots into panels of `mr` rows, panels into blocks.
 *   prep    INT8 only, task per token: quantize the x row once (u8 + scale); a token
 *           appears in topk slots, so this is not repeated per slot.
 *   pack1   task per panel: gather the x rows into the scheme's A panel (fp32 for
 *           16-bit weights, widened here; u8 dwords for INT8, and for INT4 decode the
 *           rows' sums per packed block).
 *   gemm1   task per (block, 32 intermediate columns): gate and up tiles of W1
 *           (dequantized by the scheme), bias, activation, rounding -> mid [slot, N].
 *   pack2   task per panel: mid rows into the scheme's A panel of gemm2.
 *   gemm2   task per (block, 32 output columns): tile of W2, bias, topk weight,
 *           written to y [slot, K] in the slots' original order.
 *   reduce  task per token: sum the slots in order j = 0..topk-1 (+ residual).
 *           prep..reduce run as one chain of stages (cm_parallel_stages): one request to
 *           the runner per chunk, the workers waiting for each other between stages.
 * SCHEMES   differ only in two hooks (cm_scheme_impl): how rows become an A panel,
 *           and how a weight tile times a panel becomes an fp32 C tile.
 * REGULARITIES each task is a fixed computation: outputs do not depend on the
 *           number of threads or on which thread ran what.
 * EXAMPLE   Qwen3-30B-A3B: E=128, topk=8, K=2048, N=768; decode M=1 reads 8 experts'
 *           weights once (gemm1: 8 blocks x 24 tasks); prefill M=512 has ~32 slots
 *           per expert, i.e. ~3 panels of 12 rows per block.
 */
#include <string.h>

#include "common/error.h"
#include "common/int4.h"
#include "common/numeric.h"
#include "common/parallel.h"
#include "common/sizes.h"
#include "common/ukernels.h"

#define CM_CHUNK_TOKENS 1024
#define CM_PANELS_PER_BLOCK 4     /* up to 4 x 12 rows share one pass over a weight tile */
#define CM_REDUCE_COLS 512        /* columns summed per step of the reduce stage */
#define CM_INT8_KC 256            /* reduction chunk of the INT8 block GEMM: 8 KiB of weights */
#define CM_FP8_KC 256             /* reduction chunk of the FP8 block GEMM: 32 KiB decoded */
#define CM_FP8_DECODE_MAX_ROWS 4  /* blocks up to this many rows decode weights in registers */
#define CM_INT4_KC 256            /* reduction chunk unpacked at once by INT4 prefill: 8 KiB */
#define CM_INT4_DECODE_MAX_ROWS 4 /* blocks up to this many rows expand nibbles in registers */
#define CM_PACK_COLS 64           /* columns widened per step when packing A panels */
#define CM_INT8_MIN_AMAX 1e-7f    /* floor of a row's absmax before quantizing (all-zero rows) */
/* The down projection's per-slot rows y (fp32 [mc * topk][K]) are read back by the reduce
 * stage. Up to this many bytes they are stored normally and stay in cache for it; above,
 * with streaming stores, which spare the cache and the read-for-ownership traffic. Qwen3
 * int4 M=1 (64 KiB of y), 8 weight copies cycled, one process alternating, 6 x 60 calls:
 * medians 0.90, 0.86, 0.80, 0.95, 1.02, 1.01 vs 0.92, 0.88, 0.81, 0.99, 1.03, 1.06 ms with
 * streaming stores; int8 M=1 within noise (1.43, 1.41, 1.27 vs 1.44, 1.41, 1.28 ms). At
 * M=16 (1 MiB) streaming was as fast or faster: int8 14.02, 13.72, 13.21 vs 14.44, 13.78,
 * 13.68 ms, int4 8.84, 8.71, 8.44 vs 9.04, 8.66, 8.26 ms (3 x 12 calls). */
#define CM_Y_CACHED_BYTES (256u << 10)
/* Stack tiles the micro-kernels read and write with 64-byte vectors start on a cache line,
 * so that no such access splits across two lines. */
#define CM_ALIGNED _Alignas(64)
/* Size limits (validate): slots of a chunk are indexed with int32 and experts stored as int32;
 * with at most 2^24 slots per chunk and K, N <= 2^30 no workspace region exceeds 2^56 bytes. */
#define CM_MAX_TOPK 16384
#define CM_MAX_DIM (INT64_C(1) << 30)

typedef struct cm_panel {
  int32_t expert;
  int32_t rows;
  int64_t first; /* position of its first slot in the sorted slot list */
} cm_panel;

typedef struct cm_block {
  int32_t first_panel;
  int32_t panels;
  int32_t expert_first_block; /* the blocks of one expert are consecutive */
  int32_t expert_blocks;
} cm_block;

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

/* Workspace regions for one chunk; all sizes derive from the problem and mr only. */
typedef struct cm_layout {
  size_t offsets, sorted, weights, panels, blocks, xq, xs, a1, as1, qs1, mid, midq, a2, as2, qs2, y,
      total;
  int64_t slots, max_panels;
} cm_layout;

static size_t align64(size_t x) {
  return (x + 63) & ~(size_t)63;
}

/* INT4: packed blocks along the reduction of gemm `stage` (0 for other schemes). */
static int64_t int4_blocks(const cpumoe_moe_problem *p, int stage) {
  if (p->scheme != CPUMOE_SCHEME_INT4_W4A8) return 0;
  const int64_t red = stage == 1 ? p->K : p->N;
  return red / cm_int4_block_k_of_group(stage == 1 ? p->w1_group : p->w2_group);
}

/* validate() bounds slots by 2^24 and K, N by 2^30 (CM_MAX_*): nothing here can overflow. */
static cm_layout plan_layout(const cpumoe_moe_problem *p, size_t mr) {
  cm_layout l;
  const int64_t chunk = p->M < CM_CHUNK_TOKENS ? p->M : CM_CHUNK_TOKENS;
  l.slots = chunk * p->topk;
  l.max_panels = (l.slots + (int64_t)mr - 1) / (int64_t)mr + (p->E < l.slots ? p->E : l.slots);
  size_t at = 0;
  l.offsets = at, at = align64(at + sizeof(int64_t) * (size_t)(p->E + 1));
  l.sorted = at, at = align64(at + sizeof(int32_t) * (size_t)l.slots);
  l.weights = at, at = align64(at + sizeof(float) * (size_t)l.slots);
  l.panels = at, at = align64(at + sizeof(cm_panel) * (size_t)l.max_panels);
  l.blocks = at, at = align64(at + sizeof(cm_block) * (size_t)l.max_panels);
  /* INT8/INT4 rows quantized once per token (xq, xs) and once per mid row (midq); A panels
   * hold at most 4 bytes per element (fp32), scales one float per row */
  const int int8 = p->scheme == CPUMOE_SCHEME_INT8_W8A8 || p->scheme == CPUMOE_SCHEME_INT4_W4A8;
  l.xq = at, at = align64(at + (int8 ? (size_t)(chunk * p->K) : 0));
  l.xs = at, at = align64(at + (int8 ? sizeof(float) * (size_t)chunk : 0));
  l.midq = at, at = align64(at + (int8 ? (size_t)(l.slots * p->N) : 0));
  l.a1 = at, at = align64(at + sizeof(float) * (size_t)(l.slots * p->K));
  l.as1 = at, at = align64(at + sizeof(float) * (size_t)l.slots);
  l.qs1 = at, at = align64(at + sizeof(int32_t) * (size_t)(l.slots * int4_blocks(p, 1)));
  l.mid = at, at = align64(at + sizeof(float) * (size_t)(l.slots * p->N));
  l.a2 = at, at = align64(at + sizeof(float) * (size_t)(l.slots * p->N));
  l.as2 = at, at = align64(at + sizeof(float) * (size_t)l.slots);
  l.qs2 = at, at = align64(at + sizeof(int32_t) * (size_t)(l.slots * int4_blocks(p, 2)));
  l.y = at, at = align64(at + sizeof(float) * (size_t)(l.slots * p->K));
  l.total = at + 64; /* room to align the base pointer */
  return l;
}

static cpumoe_status validate(const cpumoe_moe_problem *p) {
  if (!p) return cm_fail(CPUMOE_EINVAL, "problem is NULL");
  if (p->M < 0) return cm_fail(CPUMOE_EINVAL, "M must be >= 0, got %lld", (long long)p->M);
  if (p->K <= 0 || p->N <= 0 || p->E <= 0 || p->topk <= 0)
    return cm_fail(CPUMOE_EINVAL,
                   "K, N, E and topk must be positive (K=%lld N=%lld E=%lld topk=%lld)",
                   (long long)p->K, (long long)p->N, (long long)p->E, (long long)p->topk);
  if (p->scheme != CPUMOE_SCHEME_UNQUANT && p->scheme != CPUMOE_SCHEME_INT8_W8A8 &&
      p->scheme != CPUMOE_SCHEME_FP8_W8A16 && p->scheme != CPUMOE_SCHEME_INT4_W4A8)
    return cm_fail(CPUMOE_EUNSUPPORTED, "moe_comp_method %d is not implemented in this build",
                   (int)p->scheme);
  if (p->scheme == CPUMOE_SCHEME_FP8_W8A16) {
    if (!p->w1_scale || !p->w2_scale)
      return cm_fail(CPUMOE_EINVAL, "FP8 W8A16 needs w1_scale and w2_scale");
    if (p->block_n < 1 || p->block_k < 2 || p->block_k % 2 != 0)
      return cm_fail(CPUMOE_EUNSUPPORTED,
                     "FP8 block_size [%lld, %lld]: block_n must be >= 1 and block_k an even "
                     "number >= 2 (the packed layout pairs consecutive k)",
                     (long long)p->block_n, (long long)p->block_k);
  }
  if (p->scheme == CPUMOE_SCHEME_INT8_W8A8) {
    if (!p->w1_scale || !p->w2_scale)
      return cm_fail(CPUMOE_EINVAL, "INT8 W8A8 needs w1_scale and w2_scale");
    if (p->K > CM_INT8_MAX_REDUCTION || p->N > CM_INT8_MAX_REDUCTION)
      return cm_fail(CPUMOE_EUNSUPPORTED,
                     "INT8 W8A8 sums K=%lld and N=%lld products exactly in int32 only up to %d",
                     (long long)p->K, (long long)p->N, CM_INT8_MAX_REDUCTION);
  }
  if (p->scheme == CPUMOE_SCHEME_INT4_W4A8) {
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
  }
  if (p->act_dtype != CPUMOE_DTYPE_BF16 && p->act_dtype != CPUMOE_DTYPE_F16)
    return cm_fail(CPUMOE_EINVAL, "activations must be bf16 or fp16");
  if (p->K % 32 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "hidden size K=%lld must be a multiple of 32 (pad the weights with zeros)",
                   (long long)p->K);
  if (p->N % 32 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "intermediate size N=%lld must be a multiple of 32 (pad w1 rows and w2 "
                   "columns with zeros)",
                   (long long)p->N);
  if (p->K > CM_MAX_DIM || p->N > CM_MAX_DIM || p->E > INT32_MAX || p->topk > CM_MAX_TOPK)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "sizes K=%lld N=%lld E=%lld topk=%lld exceed the supported K, N <= 2^30, "
                   "E < 2^31, topk <= %d",
                   (long long)p->K, (long long)p->N, (long long)p->E, (long long)p->topk,
                   CM_MAX_TOPK);
  /* Byte counts of the caller's tensors; a product beyond PTRDIFF_MAX describes no tensor
   * that can exist. w1_row bounds the bytes of one w1 row (INT4: nibbles and block sums take
   * at most 1.5 K, group scales at most K); w2, biases, per-channel scales and INT4 zero
   * points take no more than w1 does (K, N >= 32); FP8 block scales can, so they count. */
  const int64_t w1_row = p->scheme == CPUMOE_SCHEME_INT8_W8A8   ? p->K + 4
                         : p->scheme == CPUMOE_SCHEME_FP8_W8A16 ? p->K
                                                                : 2 * p->K;
  const int fp8 = p->scheme == CPUMOE_SCHEME_FP8_W8A16;
  const struct {
    const char *name;
    int64_t bytes;
  } tensors[] = {
      {"x and out [M, K]", cm_size_product(p->M, p->K, 2)},
      {"topk_ids and topk_weights [M, topk]", cm_size_product(p->M, p->topk, 8)},
      {"w1 [E, 2N, K]", cm_size_product(p->E, 2 * p->N, w1_row)},
      {"w1_scale", fp8 ? cm_size_product(cm_size_product(p->E, cm_ceil_div(2 * p->N, p->block_n),
                                                         cm_ceil_div(p->K, p->block_k)),
                                         4, 1)
                       : 0},
      {"w2_scale", fp8 ? cm_size_product(cm_size_product(p->E, cm_ceil_div(p->K, p->block_n),
                                                         cm_ceil_div(p->N, p->block_k)),
                                         4, 1)
                       : 0},
  };
  for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++)
    if (tensors[i].bytes < 0)
      return cm_fail(CPUMOE_EINVAL,
                     "%s: sizes M=%lld K=%lld N=%lld E=%lld topk=%lld give more bytes than a "
                     "tensor can hold",
                     tensors[i].name, (long long)p->M, (long long)p->K, (long long)p->N,
                     (long long)p->E, (long long)p->topk);
  if (p->activation != CPUMOE_ACT_SILU_MUL && p->activation != CPUMOE_ACT_SWIGLU_CLAMP)
    return cm_fail(CPUMOE_EINVAL, "unknown activation %d", (int)p->activation);
  if ((p->w1_bias == NULL) != (p->w2_bias == NULL))
    return cm_fail(CPUMOE_EINVAL, "w1_bias and w2_bias must be given together");
  if (p->topk_ids && p->topk_ids_dtype != CPUMOE_DTYPE_I32 && p->topk_ids_dtype != CPUMOE_DTYPE_I64)
    return cm_fail(CPUMOE_EINVAL, "topk_ids must be int32 or int64");
  if (p->topk_weights && p->topk_weights_dtype != CPUMOE_DTYPE_F32 &&
      p->topk_weights_dtype != CPUMOE_DTYPE_F64 && p->topk_weights_dtype != CPUMOE_DTYPE_BF16 &&
      p->topk_weights_dtype != CPUMOE_DTYPE_F16)
    return cm_fail(CPUMOE_EINVAL, "topk_weights must be float32, float64, bfloat16 or float16");
  if (p->M > 0 && (!p->x || !p->w1 || !p->w2 || !p->out))
    return cm_fail(CPUMOE_EINVAL, "x, w1, w2 and out must not be NULL");
  return CPUMOE_OK;
}

static int64_t slot_expert(const cpumoe_moe_problem *p, int64_t slot) {
  if (!p->topk_ids) return 0;
  return p->topk_ids_dtype == CPUMOE_DTYPE_I32 ? ((const int32_t *)p->topk_ids)[slot]
                                               : ((const int64_t *)p->topk_ids)[slot];
}

static float slot_weight(const cpumoe_moe_problem *p, int64_t slot) {
  if (!p->topk_weights) return 1.0f;
  switch (p->topk_weights_dtype) {
    case CPUMOE_DTYPE_F32: return ((const float *)p->topk_weights)[slot];
    case CPUMOE_DTYPE_F64: return (float)((const double *)p->topk_weights)[slot];
    case CPUMOE_DTYPE_BF16: return cm_bf16_to_f32(((const uint16_t *)p->topk_weights)[slot]);
    default: return cm_f16_to_f32(((const uint16_t *)p->topk_weights)[slot]);
  }
}

static cpumoe_status validate_ids(const cpumoe_moe_problem *p) {
  const int64_t slots = p->M * p->topk;
  for (int64_t s = 0; s < slots; s++) {
    const int64_t e = slot_expert(p, s);
    if (e != -1 && (e < 0 || e >= p->E))
      return cm_fail(CPUMOE_EINVAL,
                     "topk_ids[%lld, %lld] = %lld is outside [0, %lld) (only -1, meaning "
                     "'skip this slot', may lie outside)",
                     (long long)(s / p->topk), (long long)(s % p->topk), (long long)e,
                     (long long)p->E);
  }
  return CPUMOE_OK;
}

size_t cpumoe_fused_experts_workspace_size(const cpumoe_moe_problem *p) {
  if (validate(p) != CPUMOE_OK) return 0;
  return plan_layout(p, cm_active_ukernels()->mr).total;
}

/* Everything a task needs, for one chunk of tokens [m0, m0 + mc). */
typedef struct cm_run cm_run;

typedef struct cm_scheme_impl {
  /* Optional per-token preparation of the chunk's token t (e.g. quantizing its x row). */
  void (*prepare_token)(const cm_run *r, int64_t t);
  /* Writes the panel's rows into its A panel of `stage` (1: x rows of the panel's
   * tokens, reduction K; 2: mid rows, reduction N), with per-row scales if any. */
  void (*pack_panel)(const cm_run *r, const cm_panel *pn, int stage);
  /* c[rows of the block][32] = fp32 product of the block's panels (in order) with the 32
   * weight rows [row0, row0 + 32) of W1[e] (stage 1) or W2[e] (stage 2), dequantized;
   * bias and activation are not in. */
  void (*gemm_block)(const cm_run *r, const cm_block *blk, int stage, int64_t row0, float *c);
} cm_scheme_impl;

struct cm_run {
  const cpumoe_moe_problem *p;
  const cm_ukernels *uk;
  const cm_scheme_impl *impl;
  cm_widen_fn widen;
  cm_narrow_fn narrow;
  cm_round_fn round16;
  size_t mr;
  int64_t m0, mc, n_blocks, n_tiles1, n_tiles2;
  const int32_t *sorted; /* chunk-local slot indices, grouped by expert */
  const float *weights;  /* [mc * topk] topk weights as fp32 */
  const cm_panel *panels;
  const cm_block *blocks;
  void *a[2];         /* A panels of gemm1 and gemm2 */
  float *a_scale[2];  /* per-row activation scales (INT8), by sorted position */
  int32_t *q_sums[2]; /* INT4 decode: per row and packed block, sum of q (see gemm_int4) */
  float *mid;         /* [slots, N] rounded intermediate, by sorted position */
  uint8_t *xq;        /* INT8: [mc, K] quantized x rows (u8 = q + 128) ... */
  float *xs;          /* ... and their scales */
  uint8_t *midq;      /* INT8: [slots, N] quantized mid rows */
  float *y;           /* [slots, K] weighted expert outputs, by chunk-local slot */
  /* writes the y rows: plain or streaming stores, per chunk (CM_Y_CACHED_BYTES) */
  cm_bias_scale_fn store_y;
};

/* Rows of a block: its panels are consecutive runs of the same expert's sorted slots. */
static int64_t block_rows(const cm_run *r, const cm_block *blk) {
  const cm_panel *last = &r->panels[blk->first_panel + blk->panels - 1];
  return last->first + last->rows - r->panels[blk->first_panel].first;
}

static int64_t stage_reduction(const cm_run *r, int stage) {
  return stage == 1 ? r->p->K : r->p->N;
}

/* fp32 values of columns [k0, k0 + n) of panel row i: widened x (stage 1) or mid (stage 2) */
static const float *row_chunk(const cm_run *r, const cm_panel *pn, int stage, size_t i, int64_t k0,
                              size_t n, float *tmp) {
  const cpumoe_moe_problem *p = r->p;
  if (stage == 2) return r->mid + (size_t)(pn->first + (int64_t)i) * (size_t)p->N + (size_t)k0;
  const int64_t token = r->m0 + r->sorted[pn->first + (int64_t)i] / p->topk;
  r->widen(n, (const uint16_t *)p->x + token * p->K + k0, tmp);
  return tmp;
}

/* ---- 16-bit weights: fp32 panels [red][rows], fp32 FMA micro-kernels ---- */

static void pack_panel_f32(const cm_run *r, const cm_panel *pn, int stage) {
  const int64_t red = stage_reduction(r, stage);
  const size_t rows = (size_t)pn->rows;
  float *panel = (float *)r->a[stage - 1] + (size_t)pn->first * (size_t)red;
  float tmp[CM_MR_MAX][CM_PACK_COLS];
  const float *src[CM_MR_MAX];
  for (int64_t k0 = 0; k0 < red; k0 += CM_PACK_COLS) {
    const size_t n = (size_t)(red - k0 < CM_PACK_COLS ? red - k0 : CM_PACK_COLS);
    for (size_t i = 0; i < rows; i++) src[i] = row_chunk(r, pn, stage, i, k0, n, tmp[i]);
    float *dst = panel + (size_t)k0 * rows;
    for (size_t k = 0; k < n; k++)
      for (size_t i = 0; i < rows; i++) dst[k * rows + i] = src[i][k];
  }
}

static void gemm_block_16bit(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                             float *c) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const cm_gemm_f32acc_fn gemm =
      p->act_dtype == CPUMOE_DTYPE_BF16 ? r->uk->gemm_bf16 : r->uk->gemm_f16;
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    const uint16_t *w = (const uint16_t *)(stage == 1 ? p->w1 : p->w2) +
                        (size_t)pn->expert * (size_t)(out_rows * red) + (size_t)(row0 * red);
    const float *panel = (const float *)r->a[stage - 1] + (size_t)pn->first * (size_t)red;
    gemm((size_t)pn->rows, (size_t)red, panel, (size_t)pn->rows, w, c);
    c += (size_t)pn->rows * CM_NR;
  }
}

static const cm_scheme_impl cm_scheme_16bit = {NULL, pack_panel_f32, gemm_block_16bit};

/* ---- INT8 W8A8: per-row u8 panels [red/4][rows][4] with scales, u8 x s8 micro-kernels ---- */

/* Scale of a row from its absmax (floored for all-zero rows; NaN stays NaN); returns 127/amax. */
static float int8_row_scale(float amax, float *scale) {
  if (!(amax >= CM_INT8_MIN_AMAX)) amax = amax != amax ? amax : CM_INT8_MIN_AMAX;
  *scale = amax / 127.0f;
  return 127.0f / amax;
}

static void prepare_token_int8(const cm_run *r, int64_t t) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t K = p->K;
  const uint16_t *x = (const uint16_t *)p->x + (r->m0 + t) * K;
  float tmp[CM_PACK_COLS], amax = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += CM_PACK_COLS) {
    const size_t n = (size_t)(K - k0 < CM_PACK_COLS ? K - k0 : CM_PACK_COLS);
    r->widen(n, x + k0, tmp);
    amax = r->uk->absmax(n, tmp, amax);
  }
  const float inv_scale = int8_row_scale(amax, &r->xs[t]);
  for (int64_t k0 = 0; k0 < K; k0 += CM_PACK_COLS) {
    const size_t n = (size_t)(K - k0 < CM_PACK_COLS ? K - k0 : CM_PACK_COLS);
    r->widen(n, x + k0, tmp);
    r->uk->quantize_u8(n, tmp, inv_scale, r->xq + (size_t)(t * K + k0));
  }
}

static void pack_panel_u8(const cm_run *r, const cm_panel *pn, int stage) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = stage_reduction(r, stage);
  const size_t rows = (size_t)pn->rows;
  uint8_t *panel = (uint8_t *)r->a[stage - 1] + (size_t)pn->first * (size_t)red;
  float *scale = r->a_scale[stage - 1] + pn->first;
  const uint8_t *src[CM_MR_MAX];
  for (size_t i = 0; i < rows; i++) {
    const int64_t pos = pn->first + (int64_t)i;
    if (stage == 1) { /* the token's row, quantized once by prepare_token_int8 */
      const int64_t t = r->sorted[pos] / p->topk;
      src[i] = r->xq + (size_t)(t * red);
      scale[i] = r->xs[t];
    } else { /* this slot's own intermediate row */
      const float *m = r->mid + (size_t)(pos * red);
      uint8_t *q = r->midq + (size_t)(pos * red);
      const float inv_scale = int8_row_scale(r->uk->absmax((size_t)red, m, 0.0f), &scale[i]);
      r->uk->quantize_u8((size_t)red, m, inv_scale, q);
      src[i] = q;
    }
  }
  for (size_t kq = 0; kq < (size_t)red / 4; kq++)
    for (size_t i = 0; i < rows; i++) memcpy(panel + (kq * rows + i) * 4, src[i] + 4 * kq, 4);
}

/* Panel q's equal share of the `bytes` at `next` (see cm_prefetch, common/ukernels.h). */
static cm_prefetch prefetch_share(const void *next, size_t bytes, int32_t q, int32_t panels) {
  const size_t lines = bytes / 64, first = lines * (size_t)q / (size_t)panels;
  return (cm_prefetch){(const char *)next + 64 * first,
                       lines * (size_t)(q + 1) / (size_t)panels - first};
}

/* The reduction is walked in chunks of CM_INT8_KC, each chunk applied to every panel of
 * the block before the next: the chunk of weights comes from memory once and is reused
 * from L1 by the other panels, while each panel's call prefetches its share of the next
 * chunk, so streaming and dot products overlap (integer sums are exact in any order).
 * After the last chunk that is the head of the next tile, which the next task reads. A
 * block of one panel has nothing to share: its calls read ahead on their own. */
static void gemm_block_int8(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                            float *c) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const int64_t expert = r->panels[blk->first_panel].expert;
  const int8_t *w = (const int8_t *)(stage == 1 ? p->w1 : p->w2) +
                    (size_t)expert * (size_t)(out_rows * (red + 4)) + (size_t)(row0 * (red + 4));
  const float *w_scale =
      (stage == 1 ? p->w1_scale : p->w2_scale) + (size_t)expert * (size_t)out_rows + row0;
  CM_ALIGNED int32_t acc[CM_PANELS_PER_BLOCK][CM_MR_MAX * CM_NR];
  for (int64_t k0 = 0; k0 < red; k0 += CM_INT8_KC) {
    const size_t kc = (size_t)(red - k0 < CM_INT8_KC ? red - k0 : CM_INT8_KC);
    for (int32_t q = 0; q < blk->panels; q++) {
      const cm_panel *pn = &r->panels[blk->first_panel + q];
      const uint8_t *panel = (const uint8_t *)r->a[stage - 1] + (size_t)pn->first * (size_t)red;
      r->uk->gemm_u8s8((size_t)pn->rows, kc, panel + (size_t)k0 * (size_t)pn->rows,
                       (size_t)pn->rows, w + k0 * CM_NR, acc[q], k0 > 0,
                       blk->panels == 1 ? CM_PREFETCH_SELF
                                        : prefetch_share(w + (k0 + CM_INT8_KC) * CM_NR,
                                                         CM_INT8_KC * CM_NR, q, blk->panels));
    }
  }
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    r->uk->dequant_u8s8((size_t)pn->rows, acc[q], w + CM_NR * red,
                        r->a_scale[stage - 1] + pn->first, w_scale, c);
    c += (size_t)pn->rows * CM_NR;
  }
}

static const cm_scheme_impl cm_scheme_int8 = {prepare_token_int8, pack_panel_u8, gemm_block_int8};

/* ---- FP8 W8A16: fp32 panels; e4m3 weights decoded exactly, scaled per 2-D block ---- */

/* The reduction is walked K block by K block (one scale per column within a block): each
 * block's products are summed unscaled, then folded in with the block's scale
 * (common/ukernels.h). A block of few rows decodes in registers, one call per K block
 * (decode: weights are read once); a block with more converts each chunk of a K block
 * once into an L1-resident fp32 buffer, runs all its panels on it into per-panel block
 * sums, and folds those at the K block's end. Both give the same bits. */
static void gemm_block_fp8(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                           float *c) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = stage_reduction(r, stage);
  const int64_t out_rows = stage == 1 ? 2 * p->N : p->K;
  const int64_t k_blocks = cm_ceil_div(red, p->block_k);
  const int64_t n_blocks = cm_ceil_div(out_rows, p->block_n);
  const int64_t expert = r->panels[blk->first_panel].expert;
  const uint8_t *w = (const uint8_t *)(stage == 1 ? p->w1 : p->w2) +
                     (size_t)expert * (size_t)(out_rows * red) + (size_t)(row0 * red);
  const float *scales =
      (stage == 1 ? p->w1_scale : p->w2_scale) + (size_t)(expert * n_blocks * k_blocks);
  const int convert = block_rows(r, blk) > CM_FP8_DECODE_MAX_ROWS;
  float col_scale[CM_NR];
  CM_ALIGNED float decoded[CM_FP8_KC * CM_NR];
  CM_ALIGNED float sums[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR]; /* per panel, the K block's P */
  const float *scale_row[CM_NR]; /* each column's row of block scales, found once */
  /* stepped from column to column: 32 divides per task made Qwen3 fp8 M=1 ~1% slower (5
   * weight copies cycled, one process alternating, 6 x 60 calls: medians 1.58, 1.54, 1.57,
   * 1.72, 1.69, 1.77 vs 1.60, 1.55, 1.59, 1.75, 1.71, 1.78 ms) */
  int64_t n_block = row0 / p->block_n, next_block_row = (n_block + 1) * p->block_n;
  for (int j = 0; j < CM_NR; j++) {
    if (row0 + j == next_block_row) n_block++, next_block_row += p->block_n;
    scale_row[j] = scales + n_block * k_blocks;
  }
  for (int64_t kb = 0; kb < k_blocks; kb++) {
    const int64_t k_begin = kb * p->block_k;
    const int64_t k_end = k_begin + p->block_k < red ? k_begin + p->block_k : red;
    for (int j = 0; j < CM_NR; j++) col_scale[j] = scale_row[j][kb];
    if (!convert) {
      float *cq = c;
      for (int32_t q = 0; q < blk->panels; q++) {
        const cm_panel *pn = &r->panels[blk->first_panel + q];
        const size_t rows = (size_t)pn->rows;
        const float *panel = (const float *)r->a[stage - 1] + (size_t)pn->first * (size_t)red +
                             (size_t)k_begin * rows;
        r->uk->gemm_fp8(rows, (size_t)(k_end - k_begin), panel, rows, w + k_begin * CM_NR,
                        col_scale, cq, kb > 0);
        cq += rows * CM_NR;
      }
      continue;
    }
    for (int64_t k0 = k_begin; k0 < k_end; k0 += CM_FP8_KC) {
      const int64_t kc = k_end - k0 < CM_FP8_KC ? k_end - k0 : CM_FP8_KC;
      r->uk->fp8_to_f32((size_t)kc, w + k0 * CM_NR, decoded);
      float *sq = sums;
      for (int32_t q = 0; q < blk->panels; q++) {
        const cm_panel *pn = &r->panels[blk->first_panel + q];
        const size_t rows = (size_t)pn->rows;
        const float *panel =
            (const float *)r->a[stage - 1] + (size_t)pn->first * (size_t)red + (size_t)k0 * rows;
        r->uk->gemm_f32b(rows, (size_t)kc, panel, rows, decoded, sq, k0 > k_begin);
        sq += rows * CM_NR;
      }
    }
    float *cq = c, *sq = sums;
    for (int32_t q = 0; q < blk->panels; q++) {
      const size_t rows = (size_t)r->panels[blk->first_panel + q].rows;
      r->uk->fp8_fold(rows, sq, col_scale, cq, kb > 0);
      cq += rows * CM_NR, sq += rows * CM_NR;
    }
  }
  const size_t tile_values = (size_t)block_rows(r, blk) * CM_NR;
  for (size_t i = 0; i < tile_values; i++) c[i] *= 256.0f; /* C held the result times 2^-8 */
}

static const cm_scheme_impl cm_scheme_fp8 = {NULL, pack_panel_f32, gemm_block_fp8};

/* ---- INT4 W4A8: u8 panels as for INT8; nibble weights with group zero points and scales ---- */

/* The 32 weight rows [row0, row0 + 32) of the stage's matrix for one expert. */
static cm_int4_tile int4_tile(const cm_run *r, int stage, int64_t expert, int64_t row0) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = stage_reduction(r, stage);
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

/* The u8 panel, and for panels the decode path may take (gemm_block_int4), each row's sum
 * of q = u8 - 128 over every packed block: the decode GEMM multiplies the nibbles as they
 * are and subtracts zero x that sum once per block. */
static void pack_panel_int4(const cm_run *r, const cm_panel *pn, int stage) {
  pack_panel_u8(r, pn, stage);
  if (!r->uk->gemm_int4 || pn->rows > CM_INT4_DECODE_MAX_ROWS) return;
  const int64_t red = stage_reduction(r, stage), blocks = int4_blocks(r->p, stage);
  const size_t bk = (size_t)(red / blocks), rows = (size_t)pn->rows;
  const uint8_t *panel = (const uint8_t *)r->a[stage - 1] + (size_t)pn->first * (size_t)red;
  int32_t *sums = r->q_sums[stage - 1] + (size_t)(pn->first * blocks);
  for (size_t b = 0; b < (size_t)blocks; b++)
    for (size_t i = 0; i < rows; i++) {
      const uint8_t *q = panel + b * bk * rows + 4 * i; /* k-quads of row i, stride 4 rows */
      int32_t sum = 0;
      for (size_t kq = 0; kq < bk / 4; kq++, q += 4 * rows) sum += q[0] + q[1] + q[2] + q[3];
      sums[b * rows + i] = sum - 128 * (int32_t)bk;
    }
}

/* Few rows: nibbles expand in registers (decode: the weights are read once). More rows:
 * each chunk of blocks is unpacked once into an L1-resident s8 tile that every panel runs
 * the u8 x s8 GEMM on, while those GEMM calls prefetch the next chunk's packed blocks in
 * equal shares (a burst in the unpack loop was 5-8% slower at Qwen3 M=512). Both paths give
 * the same bits (exact block sums, one fmaf per block). The per-row activation scale
 * multiplies the finished tile. */
static void gemm_block_int4(const cm_run *r, const cm_block *blk, int stage, int64_t row0,
                            float *c) {
  const int64_t expert = r->panels[blk->first_panel].expert;
  const cm_int4_tile w = int4_tile(r, stage, expert, row0);
  const size_t bk = w.bk, k_blocks = (size_t)stage_reduction(r, stage) / bk;
  const uint8_t *panels = (const uint8_t *)r->a[stage - 1];
  const size_t red = (size_t)stage_reduction(r, stage);
  if (r->uk->gemm_int4 && block_rows(r, blk) <= CM_INT4_DECODE_MAX_ROWS) {
    float *cq = c;
    for (int32_t q = 0; q < blk->panels; q++) {
      const cm_panel *pn = &r->panels[blk->first_panel + q];
      r->uk->gemm_int4((size_t)pn->rows, &w, 0, k_blocks, panels + (size_t)pn->first * red,
                       (size_t)pn->rows, r->q_sums[stage - 1] + (size_t)pn->first * k_blocks, cq,
                       0);
      cq += (size_t)pn->rows * CM_NR;
    }
  } else {
    CM_ALIGNED int8_t unpacked[CM_INT4_KC * CM_NR];
    CM_ALIGNED int32_t acc[CM_MR_MAX * CM_NR];
    const size_t chunk = bk < CM_INT4_KC ? CM_INT4_KC / bk : 1;
    for (size_t kb0 = 0; kb0 < k_blocks; kb0 += chunk) {
      const size_t nb = k_blocks - kb0 < chunk ? k_blocks - kb0 : chunk;
      r->uk->int4_unpack(&w, kb0, nb, unpacked);
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
          r->uk->gemm_u8s8(
              rows, bk, panels + (size_t)pn->first * red + kb * bk * rows, rows,
              unpacked + b * bk * CM_NR, acc, 0,
              prefetch_share(next_chunk, next_bytes, q * (int32_t)nb + (int32_t)b, calls));
          r->uk->int4_dequant(rows, acc, w.blocks + kb * cm_int4_block_bytes(bk) + 16 * bk,
                              w.scales + (kb / w.group_blocks) * CM_NR, cq, kb > 0);
        }
        cq += rows * CM_NR;
      }
    }
  }
  float *cq = c, row[CM_NR];
  for (int32_t q = 0; q < blk->panels; q++) {
    const cm_panel *pn = &r->panels[blk->first_panel + q];
    for (int32_t i = 0; i < pn->rows; i++, cq += CM_NR) {
      r->uk->bias_scale(CM_NR, cq, NULL, r->a_scale[stage - 1][pn->first + i], row);
      memcpy(cq, row, sizeof row);
    }
  }
}

static const cm_scheme_impl cm_scheme_int4 = {prepare_token_int8, pack_panel_int4, gemm_block_int4};

/* Counting sort of the chunk's slots by expert, then panels and blocks. */
static void route_chunk(cm_run *r, int64_t *offsets, int32_t *sorted, float *weights,
                        cm_panel *panels, cm_block *blocks) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t slots = r->mc * p->topk, base = r->m0 * p->topk;
  memset(offsets, 0, sizeof(int64_t) * (size_t)(p->E + 1));
  for (int64_t s = 0; s < slots; s++) {
    const int64_t e = slot_expert(p, base + s);
    weights[s] = slot_weight(p, base + s);
    if (e >= 0) offsets[e + 1]++;
  }
  for (int64_t e = 0; e < p->E; e++) offsets[e + 1] += offsets[e];
  /* offsets[e] is the first position of expert e */
  int64_t n_panels = 0, n_blocks = 0;
  for (int64_t e = 0; e < p->E; e++) {
    const int64_t count = offsets[e + 1] - offsets[e];
    const int64_t expert_first_block = n_blocks;
    for (int64_t first = 0; first < count; first += (int64_t)r->mr) {
      const int64_t rows = count - first < (int64_t)r->mr ? count - first : (int64_t)r->mr;
      if (first % ((int64_t)r->mr * CM_PANELS_PER_BLOCK) == 0)
        blocks[n_blocks++] = (cm_block){.first_panel = (int32_t)n_panels};
      blocks[n_blocks - 1].panels++;
      panels[n_panels++] =
          (cm_panel){.expert = (int32_t)e, .rows = (int32_t)rows, .first = offsets[e] + first};
    }
    for (int64_t b = expert_first_block; b < n_blocks; b++) {
      blocks[b].expert_first_block = (int32_t)expert_first_block;
      blocks[b].expert_blocks = (int32_t)(n_blocks - expert_first_block);
    }
  }
  /* stable scatter: slots in increasing index order within each expert */
  for (int64_t s = 0; s < slots; s++) {
    const int64_t e = slot_expert(p, base + s);
    if (e >= 0) sorted[offsets[e]++] = (int32_t)s;
  }
  r->n_blocks = n_blocks;
}

static void prepare_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  r->impl->prepare_token(r, t);
}

static void pack1_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  r->impl->pack_panel(r, &r->panels[t], 1);
}

static void pack2_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  r->impl->pack_panel(r, &r->panels[t], 2);
}

static void gemm1_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  const cpumoe_moe_problem *p = r->p;
  const int64_t N = p->N;
  int64_t tile; /* intermediate columns [32 tile, 32 tile + 32) */
  const cm_block *blk = task_block(r->blocks, t, r->n_tiles1, &tile);
  const int swiglu = p->activation == CPUMOE_ACT_SWIGLU_CLAMP;
  /* silu: gate rows [32 tile..), up rows [N + 32 tile..); swiglu: rows [64 tile, +64)
   * interleave gate/up. Either way two 32-row weight blocks. */
  const int64_t row0 = swiglu ? 64 * tile : 32 * tile;
  const int64_t row1 = swiglu ? 64 * tile + 32 : N + 32 * tile;
  CM_ALIGNED float c0[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  CM_ALIGNED float c1[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  float gate[CM_NR], up[CM_NR];
  r->impl->gemm_block(r, blk, 1, row0, c0);
  r->impl->gemm_block(r, blk, 1, row1, c1);
  const int64_t expert = r->panels[blk->first_panel].expert;
  const int64_t first = r->panels[blk->first_panel].first; /* the block's rows are consecutive */
  const float *bias = p->w1_bias ? p->w1_bias + (size_t)expert * (size_t)(2 * N) : NULL;
  const int64_t rows = block_rows(r, blk);
  for (int64_t i = 0; i < rows; i++) {
    float *h0 = c0 + i * CM_NR, *h1 = c1 + i * CM_NR;
    float *out = r->mid + (size_t)(first + i) * (size_t)N + (size_t)(32 * tile);
    if (swiglu) { /* column j: h rows 64 tile + 2j (gate) and 64 tile + 2j + 1 (up) */
      for (int j = 0; j < CM_NR; j++) {
        const float *h = j < 16 ? h0 : h1;
        const int jj = 2 * (j & 15);
        gate[j] = h[jj] + (bias ? bias[row0 + 2 * j] : 0.0f);
        up[j] = h[jj + 1] + (bias ? bias[row0 + 2 * j + 1] : 0.0f);
      }
      r->uk->swiglu(CM_NR, gate, up, p->alpha, p->limit, out);
    } else {
      if (bias)
        for (int j = 0; j < CM_NR; j++) h0[j] += bias[row0 + j], h1[j] += bias[row1 + j];
      r->uk->silu_mul(CM_NR, h0, h1, out);
    }
    r->round16(CM_NR, out);
  }
}

static void gemm2_task(void *ctx, int64_t t) {
  const cm_run *r = (const cm_run *)ctx;
  const cpumoe_moe_problem *p = r->p;
  const int64_t K = p->K;
  int64_t tile; /* output columns [32 tile, 32 tile + 32) */
  const cm_block *blk = task_block(r->blocks, t, r->n_tiles2, &tile);
  CM_ALIGNED float c[CM_PANELS_PER_BLOCK * CM_MR_MAX * CM_NR];
  r->impl->gemm_block(r, blk, 2, 32 * tile, c);
  const int64_t expert = r->panels[blk->first_panel].expert;
  const int64_t first = r->panels[blk->first_panel].first;
  const float *bias = p->w2_bias ? p->w2_bias + (size_t)expert * (size_t)K + 32 * tile : NULL;
  const int64_t rows = block_rows(r, blk);
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
      if (slot_expert(p, m * p->topk + j) < 0) continue;
      r->uk->axpy(n, 1.0f, r->y + (size_t)slot * (size_t)K + (size_t)k0, acc);
    }
    if (p->residual) {
      r->widen(n, (const uint16_t *)p->residual + m * K + k0, res);
      r->uk->axpy(n, p->residual_scale, res, acc);
    }
    r->narrow(n, acc, (uint16_t *)p->out + m * K + k0);
  }
}

cpumoe_status cpumoe_fused_experts(const cpumoe_moe_problem *p, void *workspace,
                                   size_t workspace_bytes, const cpumoe_runner *runner) {
  cpumoe_status st = validate(p);
  if (st != CPUMOE_OK) return st;
  if (p->M == 0) return CPUMOE_OK;
  st = validate_ids(p);
  if (st != CPUMOE_OK) return st;
  const cm_ukernels *uk = cm_active_ukernels();
  const cm_layout l = plan_layout(p, uk->mr);
  if (!workspace || workspace_bytes < l.total)
    return cm_fail(CPUMOE_EWORKSPACE, "workspace of %zu bytes given, %zu needed", workspace_bytes,
                   l.total);
  char *ws = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
  const int bf16 = p->act_dtype == CPUMOE_DTYPE_BF16;
  cm_run r = {
      .p = p,
      .uk = uk,
      .impl = p->scheme == CPUMOE_SCHEME_INT8_W8A8   ? &cm_scheme_int8
              : p->scheme == CPUMOE_SCHEME_FP8_W8A16 ? &cm_scheme_fp8
              : p->scheme == CPUMOE_SCHEME_INT4_W4A8 ? &cm_scheme_int4
                                                     : &cm_scheme_16bit,
      .widen = bf16 ? uk->widen_bf16 : uk->widen_f16,
      .narrow = bf16 ? uk->narrow_bf16 : uk->narrow_f16,
      .round16 = bf16 ? uk->round_bf16 : uk->round_f16,
      .mr = uk->mr,
      .n_tiles1 = p->N / CM_NR,
      .n_tiles2 = p->K / CM_NR,
      .sorted = (const int32_t *)(ws + l.sorted),
      .weights = (const float *)(ws + l.weights),
      .panels = (const cm_panel *)(ws + l.panels),
      .blocks = (const cm_block *)(ws + l.blocks),
      .a = {ws + l.a1, ws + l.a2},
      .a_scale = {(float *)(ws + l.as1), (float *)(ws + l.as2)},
      .q_sums = {(int32_t *)(ws + l.qs1), (int32_t *)(ws + l.qs2)},
      .mid = (float *)(ws + l.mid),
      .xq = (uint8_t *)(ws + l.xq),
      .xs = (float *)(ws + l.xs),
      .midq = (uint8_t *)(ws + l.midq),
      .y = (float *)(ws + l.y),
  };
  for (int64_t m0 = 0; m0 < p->M; m0 += CM_CHUNK_TOKENS) {
    r.m0 = m0;
    r.mc = p->M - m0 < CM_CHUNK_TOKENS ? p->M - m0 : CM_CHUNK_TOKENS;
    r.store_y = (size_t)(r.mc * p->topk * p->K) * sizeof(float) <= CM_Y_CACHED_BYTES
                    ? uk->bias_scale
                    : uk->bias_scale_stream;
    route_chunk(&r, (int64_t *)(ws + l.offsets), (int32_t *)(ws + l.sorted),
                (float *)(ws + l.weights), (cm_panel *)(ws + l.panels),
                (cm_block *)(ws + l.blocks));
    int64_t n_panels = 0;
    for (int64_t b = 0; b < r.n_blocks; b++) n_panels += r.blocks[b].panels;
    const cm_stage stages[] = {
        {r.impl->prepare_token ? r.mc : 0, prepare_task},
        {n_panels, pack1_task},
        {r.n_blocks * r.n_tiles1, gemm1_task},
        {n_panels, pack2_task},
        {r.n_blocks * r.n_tiles2, gemm2_task},
        {r.mc, reduce_task},
    };
    cm_parallel_stages(runner, stages, (int)(sizeof stages / sizeof stages[0]), &r);
  }
  return CPUMOE_OK;
}
