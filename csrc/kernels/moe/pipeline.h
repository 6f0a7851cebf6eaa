/*
 * The fused MoE pipeline's internal interface: what the stages (moe/stages.c), the
 * routing (moe/route.c), the workspace plan (moe/layout.c), the panel packers
 * (moe/panels.c) and each scheme's hooks (schemes/<name>/scheme.c) share.
 *
 * SHAPES     x [M, K], w1 [E, 2N, K] packed, w2 [E, K, N] packed, ids/weights [M, topk]
 * DEFINITION for m, j: e = ids[m, j] (skip -1)
 *              h = W1[e] x[m] + b1[e]           fp32, one FMA chain per element
 *              a = round16(act(h))              act = silu(gate)*up, gelu(gate)*up,
 *                                               clamped swiglu or clamped silu
 *              y = (W2[e] a + b2[e]) * w[m, j]   fp32
 *            out[m] = round16(sum_j y + residual_scale * residual[m])
 *            (docs/MATH.md states it in full.)
 * STAGES per chunk of at most CM_CHUNK_TOKENS tokens (bounds the workspace):
 *   route   serial: validate ids, counting-sort the M*topk slots by expert (stable),
 *           cut each expert's slots into panels of `mr` rows, panels into blocks.
 *   prep    quantized panel formats only, task per token: quantize the x row once (u8 +
 *           scale); a token appears in topk slots, so this is not repeated per slot.
 *   pack1   task per panel: gather the x rows into the A panel format of the scheme's
 *           config (fp32, widened here; u8 quads, and the rows' sums per reduction block).
 *   gemm1   task per (block, 32 intermediate columns): gate and up tiles of W1
 *           (the scheme's gemm_block hook), bias, activation, rounding -> mid [slot, N];
 *           a 16-bit panel format takes the values straight into gemm2's A panel instead
 *           (store_mid), sparing the fp32 round trip.
 *   pack2   task per panel: mid rows into the A panel of gemm2 (the other formats).
 *   gemm2   task per (block, 32 output columns): tile of W2, bias, topk weight,
 *           written to y [slot, K] in the slots' original order.
 *   reduce  task per token: sum the slots in order j = 0..topk-1 (+ residual).
 *           prep..reduce run as one chain of stages (cm_parallel_stages): one request to
 *           the runner per chunk, the workers waiting for each other between stages.
 * SCHEMES   are looked up, never switched on: a scheme's traits (cm_scheme_traits) check
 *           its arguments and compute a block's fp32 C tile from a weight tile; its
 *           (scheme, tier) config (cm_gemm_config) names the kernels, mr and the A panel
 *           format, whose packer lives in moe/panels.c.
 * REGULARITIES each task is a fixed computation: outputs do not depend on the
 *           number of threads or on which thread ran what.
 * EXAMPLE   Qwen3-30B-A3B: E=128, topk=8, K=2048, N=768; decode M=1 reads 8 experts'
 *           weights once (gemm1: 8 blocks x 24 tasks); prefill M=512 has ~32 slots
 *           per expert, i.e. ~3 panels of 12 rows per block.
 */
#ifndef CPUMOE_MOE_PIPELINE_H
#define CPUMOE_MOE_PIPELINE_H

#include <stddef.h>
#include <stdint.h>

#include "common/numeric.h"
#include "common/ukernels.h"
#include "cpumoe/cpumoe.h"

#define CM_CHUNK_TOKENS 1024
#define CM_PANELS_PER_BLOCK 4  /* up to 4 x mr rows share one pass over a weight tile */
#define CM_PACK_COLS 64        /* columns widened per step when packing A panels */
#define CM_INT8_MIN_AMAX 1e-7f /* floor of a row's absmax before quantizing (all-zero rows) */
/* Results a later stage (or the caller) reads back: the intermediate (written by gemm1, read
 * by pack2 or the down projection), the down projection's per-slot rows y (fp32
 * [mc * topk][K], read by the reduce stage) and the dense linear's output. Up to this many
 * bytes (fp32 size for the MoE's, the output's own size for the linear's) they are stored
 * normally and stay in cache; above, with streaming stores, which spare the cache and the
 * read-for-ownership traffic. Measured for y at Qwen3 M <= 16, for the intermediate at Qwen3
 * M = 512 (2-4 % faster with every scheme) and for the linear's output at M = 512
 * (docs/PERFORMANCE-HISTORY.md). */
#define CM_CACHED_RESULT_BYTES (256u << 10)

/* memcpy as a cm_copy_fn (moe/stages.c): the plain stores of a result that stays in cache */
void cm_copy_cached(size_t bytes, const void *src, void *dst);

/* How a result of `bytes` bytes is written: plain stores up to CM_CACHED_RESULT_BYTES,
 * streaming stores above. */
static inline cm_copy_fn cm_result_copy(const cm_elementwise_kernels *ew, size_t bytes) {
  return bytes <= CM_CACHED_RESULT_BYTES ? cm_copy_cached : ew->copy_stream;
}
/* Stack tiles the micro-kernels read and write with 64-byte vectors start on a cache line,
 * so that no such access splits across two lines. */
#define CM_ALIGNED _Alignas(64)
/* the dense linear's blocks of CM_PANELS_PER_BLOCK_MAX panels keep the fused MoE's block
 * boundaries (moe/route.c) */
_Static_assert(CM_PANELS_PER_BLOCK_MAX % CM_PANELS_PER_BLOCK == 0, "blocks of the linear");
/* Size limits (validate): slots of a chunk are indexed with int32 and experts stored as int32;
 * with at most 2^24 slots per chunk and K, N <= 2^30 no workspace region exceeds 2^56 bytes. */
#define CM_MAX_TOPK 16384
#define CM_MAX_DIM (INT64_C(1) << 30)

typedef struct cm_panel {
  int32_t expert;
  int32_t rows;
  int64_t first;  /* position of its first slot in the sorted slot list */
  int32_t decode; /* its block takes the decode kernel (at most decode_max_rows rows): the
                   * panel is packed in decode_a_format */
  int32_t in_run; /* index of its first row in its expert's run of slots */
} cm_panel;

typedef struct cm_block {
  int32_t first_panel;
  int32_t panels;
  int32_t expert_first_block; /* the blocks of one expert are consecutive */
  int32_t expert_blocks;
} cm_block;

typedef struct cm_run cm_run;

/* What a weight scheme is, stated once (schemes/<name>/scheme.c; the table: moe/schemes.c). */
typedef struct cm_scheme_traits {
  const char *name;
  /* Checks the scheme's own fields of the problem (scales, zeros, block or group sizes). */
  cpumoe_status (*validate)(const cpumoe_moe_problem *p);
  /* Bytes of one packed w1 row (an upper bound), for the tensor size checks. */
  int64_t (*w1_row_bytes)(const cpumoe_moe_problem *p);
  /* Bytes of the w1 (stage 1) or w2 (stage 2) scale tensor where it can exceed w1's own
     bytes; NULL when it cannot. -1 when the count overflows. */
  int64_t (*scale_bytes)(const cpumoe_moe_problem *p, int stage);
  /* Reduction blocks per row of gemm `stage`, for panels with block sums
     (CM_PANEL_U8_QUADS_BLOCK_SUMS); NULL for a scheme whose configs never ask for them. */
  int64_t (*reduction_blocks)(const cpumoe_moe_problem *p, int stage);
  /* c[rows of the block][32] = fp32 product of the block's panels (in order) with the 32
   * weight rows [row0, row0 + 32) of W1[e] (stage 1) or W2[e] (stage 2), dequantized;
   * bias and activation are not in. */
  void (*gemm_block)(const cm_run *r, const cm_block *blk, int stage, int64_t row0, float *c);
} cm_scheme_traits;

/* The traits of a scheme, or NULL if this build has none. */
const cm_scheme_traits *cm_scheme_traits_of(cpumoe_scheme scheme);

/* How rows become an A panel of one format (moe/panels.c). */
typedef struct cm_panel_packer {
  /* Per token of the chunk, before any packing (quantizing its x row once); NULL: none. */
  void (*prepare_token)(const cm_run *r, int64_t t);
  /* Writes the panel's rows into its A panel of `stage` (1: x rows of the panel's tokens,
   * reduction K; 2: mid rows, reduction N), with per-row scales and sums if the format
   * has them. */
  void (*pack)(const cm_run *r, const cm_panel *pn, int stage);
  /* Formats that hold the intermediate's own 16-bit values: writes row i of panel pn's
   * stage-2 operand, columns [col0, col0 + 32), from `mid` (fp32 values already rounded to
   * the activation dtype), as the gate/up GEMM makes them; pack then has nothing to do for
   * stage 2. NULL: the values go through the 16-bit intermediate (cm_run.mid) and pack
   * (quantized rows need their whole row first). */
  void (*store_mid)(const cm_run *r, const cm_panel *pn, size_t i, int64_t col0, const float *mid);
  int quantized;     /* rows quantized to u8 (x once per token, mid rows per slot) */
  int block_sums;    /* per row and reduction block, the sum of q */
  size_t elem_bytes; /* bytes per element */
  /* elements of one row per k step (1 fp32, 2 bf16 pairs, 4 u8 quads: the panel is
   * [red / group][rows][group]), or 0: rows one after another ([rows][red]) */
  size_t k_group;
} cm_panel_packer;

extern const cm_panel_packer cm_panel_packers[CM_PANEL_FORMAT_COUNT];

/* The packer of the panels a config's decode kernel takes; NULL when it has none. */
static inline const cm_panel_packer *cm_decode_packer_of(const cm_gemm_config *g) {
  return g->decode_max_rows ? &cm_panel_packers[g->decode_a_format] : NULL;
}

/* Everything a task needs, for one chunk of tokens [m0, m0 + mc). */
struct cm_run {
  const cpumoe_moe_problem *p;
  const cm_elementwise_kernels *ew;
  const cm_gemm_config *gemm; /* the (scheme, tier) config */
  const cm_scheme_traits *traits;
  const cm_panel_packer *packer;        /* panels of the main kernels ... */
  const cm_panel_packer *decode_packer; /* ... and of the decode kernel (NULL: none) */
  /* the per-token step of those formats (quantizing x once), or NULL; formats that have
   * one share it (prepare_token_u8) */
  void (*prepare_token)(const cm_run *r, int64_t t);
  cm_widen_fn widen;
  cm_narrow_fn narrow;
  cm_round_fn round16;
  size_t mr;
  /* route cuts an expert's panels into blocks of this many: CM_PANELS_PER_BLOCK, or a
   * multiple of it (moe/route.c) */
  int64_t panels_per_block;
  int64_t m0, mc, n_blocks, n_tiles1, n_tiles2;
  const int32_t *sorted; /* chunk-local slot indices, grouped by expert */
  const float *weights;  /* [mc * topk] topk weights as fp32 */
  const cm_panel *panels;
  const cm_block *blocks;
  void *a[2];            /* A panels of gemm1 and gemm2 */
  float *a_scale[2];     /* per-row activation scales (quantized formats), by sorted position */
  int32_t *q_sums[2];    /* block-sum formats: per row and reduction block, sum of q */
  int64_t sum_blocks[2]; /* reduction blocks per row of q_sums, per stage */
  /* [slots, N] the intermediate, by sorted position: the activation's output rounded to the
   * activation dtype, so its 16-bit bits hold it exactly (formats without store_mid) */
  uint16_t *mid;
  uint8_t *xq;   /* quantized formats: [mc, K] x rows (u8 = q + 128) ... */
  float *xs;     /* ... and their scales */
  uint8_t *midq; /* quantized formats: [slots, N] mid rows */
  float *y;      /* [slots, K] weighted expert outputs, by chunk-local slot */
  /* write the y rows and the intermediate's values (16-bit mid rows or stage-2 panel rows):
   * plain or streaming stores, per chunk (moe/stages.c, CM_CACHED_RESULT_BYTES) */
  cm_bias_scale_fn store_y;
  cm_copy_fn put_mid;
  /* copies the x rows into the row-major stage-1 panels (pack1): plain or streaming stores,
   * per chunk, by the panels' 16-bit size (moe/stages.c, moe/linear.c) */
  cm_copy_fn put_a;
};

/* Workspace regions for one chunk; all sizes derive from the problem and its config. */
typedef struct cm_layout {
  size_t offsets, sorted, weights, panels, blocks, xq, xs, a1, as1, qs1, mid, midq, a2, as2, qs2, y,
      total;
  int64_t slots, max_panels;
  int64_t sum_blocks[2];
} cm_layout;

/* moe/validate.c: the problem's fields (CPUMOE_OK or a status with cm_fail's message) */
cpumoe_status cm_validate_problem(const cpumoe_moe_problem *p);
/* every topk id in [0, E) or -1 */
cpumoe_status cm_validate_ids(const cpumoe_moe_problem *p);
/* a known activation, and for SILU_CLAMP a limit >= 0 (not NaN) */
cpumoe_status cm_validate_activation(cpumoe_activation activation, float limit);

/* moe/layout.c; _gemm1: the regions of the first GEMM only (the dense linear, moe/linear.c) */
cm_layout cm_plan_layout(const cpumoe_moe_problem *p, const cm_gemm_config *gemm);
cm_layout cm_plan_layout_gemm1(const cpumoe_moe_problem *p, const cm_gemm_config *gemm);

/* A run of p on the tier's config `gemm` with its first GEMM's fields set (moe/stages.c): the
 * kernels and panel packers of the config, the activation dtype's conversions, and the
 * routing and stage-1 regions of the workspace `ws` (64-byte aligned) planned in `l`. The
 * chunk bounds and the second GEMM's fields are the caller's. */
cm_run cm_run_gemm1(const cpumoe_moe_problem *p, const cm_tier_config *tier,
                    const cm_gemm_config *gemm, const cm_layout *l, char *ws);

/* moe/route.c: counting sort of the chunk's slots by expert, then panels and blocks;
 * sets r->n_blocks */
void cm_route_chunk(cm_run *r, int64_t *offsets, int32_t *sorted, float *weights, cm_panel *panels,
                    cm_block *blocks);

/* Expert of a slot (an index into topk_ids): 0 for every slot without ids. */
static inline int64_t cm_slot_expert(const cpumoe_moe_problem *p, int64_t slot) {
  if (!p->topk_ids) return 0;
  return p->topk_ids_dtype == CPUMOE_DTYPE_I32 ? ((const int32_t *)p->topk_ids)[slot]
                                               : ((const int64_t *)p->topk_ids)[slot];
}

/* Rows of a block: its panels are consecutive runs of the same expert's sorted slots. */
static inline int64_t cm_block_rows(const cm_run *r, const cm_block *blk) {
  const cm_panel *last = &r->panels[blk->first_panel + blk->panels - 1];
  return last->first + last->rows - r->panels[blk->first_panel].first;
}

/* The reduction of gemm `stage`: K for the gate/up projection, N for the down one. */
static inline int64_t cm_stage_reduction(const cm_run *r, int stage) {
  return stage == 1 ? r->p->K : r->p->N;
}

/* Rows a tile kernel may read past a row-major panel's last row (AMX loads whole 16-row
 * tiles; the C rows made from them are dropped): the A regions end with this many rows of
 * slack, plus CM_PANEL_ROW_PAD bytes for each of the 32 rows a panel's tiles span. */
#define CM_PANEL_SLACK_ROWS 16

/* Bytes after each row of a row-major panel (k_group 0): with rows a multiple of 4 KiB apart
 * (K = 2048 bf16, K = 4096 u8) all 32 rows of a tile load fall into one L1 set of 12 ways,
 * and each k step's tile loads evict one another and the weight chunk. A test program of
 * the linear's loop (blocks of 8 panels, chunks of 256 k, K = 2048): 52.5 -> 48.5 ns per
 * k step with the pad. */
#define CM_PANEL_ROW_PAD 64

/* Elements from one row of a row-major panel to the next. Within the 4 bytes per element
 * each slot owns for every reduction of at least 32 (2 red + 64 <= 4 red). */
static inline size_t cm_panel_row_stride(size_t red, size_t elem_bytes) {
  return red + CM_PANEL_ROW_PAD / elem_bytes;
}

/* The packer of panel pn's format (its block's kernel: main or decode). */
static inline const cm_panel_packer *cm_panel_packer_of(const cm_run *r, const cm_panel *pn) {
  return pn->decode ? r->decode_packer : r->packer;
}

/* Where panel pn's A operand starts. Every slot owns 4 bytes per reduction element in the
 * A region, whatever the format (fp32 is the widest), so that panels of the two formats of
 * one config (main and decode) never overlap. Row-major panels of one expert's run follow
 * one another at the row stride from the run's first slot on, so that the panels of a block
 * are one matrix of rows a kernel may take in one call (cm_gemm_config.block_rows_max); they
 * end within the run's bytes (stride <= 4 red), and decode panels, interleaved, come only
 * at a run's end (moe/route.c). */
static inline char *cm_panel_base(const cm_run *r, const cm_panel *pn, int stage) {
  const cm_panel_packer *f = cm_panel_packer_of(r, pn);
  const size_t red = (size_t)cm_stage_reduction(r, stage);
  char *region = (char *)r->a[stage - 1];
  if (f->k_group) return region + (size_t)pn->first * red * 4;
  return region + (size_t)(pn->first - pn->in_run) * red * 4 +
         (size_t)pn->in_run * cm_panel_row_stride(red, f->elem_bytes) * f->elem_bytes;
}

/* The A operand of panel pn for gemm `stage` from reduction step k0 on, and the a_stride its
 * kernels take (rows per k step for interleaved formats, elements per row for row-major). */
static inline const void *cm_panel_operand(const cm_run *r, const cm_panel *pn, int stage,
                                           int64_t k0, size_t *a_stride) {
  const cm_panel_packer *f = cm_panel_packer_of(r, pn);
  const size_t red = (size_t)cm_stage_reduction(r, stage), rows = (size_t)pn->rows;
  const char *panel = cm_panel_base(r, pn, stage);
  *a_stride = f->k_group ? rows : cm_panel_row_stride(red, f->elem_bytes);
  return panel + (size_t)k0 * (f->k_group ? rows : 1) * f->elem_bytes;
}

/* Panel q's equal share of the `bytes` at `next` (see cm_prefetch, common/ukernels.h). */
static inline cm_prefetch cm_prefetch_share(const void *next, size_t bytes, int32_t q,
                                            int32_t panels) {
  const size_t lines = bytes / 64, first = lines * (size_t)q / (size_t)panels;
  return (cm_prefetch){(const char *)next + 64 * first,
                       lines * (size_t)(q + 1) / (size_t)panels - first};
}

/* Whether a block goes panel by panel over the whole reduction (cm_gemm_config's
 * panel_major_panels); a block of one panel always does. */
static inline int cm_block_panel_major(const cm_run *r, const cm_block *blk) {
  return blk->panels == 1 || (size_t)blk->panels <= r->gemm->panel_major_panels;
}

/* Whether a block's panels go through the main kernel in one call over the whole reduction
 * (cm_gemm_config.block_rows_max), the call streaming the weights on its own. */
static inline int cm_block_one_call(const cm_run *r, const cm_block *blk) {
  return blk->panels > 1 && !r->panels[blk->first_panel].decode &&
         (size_t)cm_block_rows(r, blk) <= r->gemm->block_rows_max;
}

/* The reduction chunk a block's GEMM calls take: the whole reduction panel by panel, else
 * `chunk`. */
static inline int64_t cm_block_chunk(const cm_run *r, const cm_block *blk, int64_t red,
                                     int64_t chunk) {
  return cm_block_panel_major(r, blk) ? red : chunk;
}

/* The prefetch of panel q's call on a chunk of a block, the next chunk's `bytes` starting at
 * `next`. Panel by panel, the first call reads ahead on its own (CM_PREFETCH_SELF) and the
 * others, on weights it left in L2, request nothing; in chunks, each panel requests its share
 * of the next chunk. */
static inline cm_prefetch cm_block_prefetch(const cm_run *r, const cm_block *blk, int32_t q,
                                            const void *next, size_t bytes) {
  if (!cm_block_panel_major(r, blk)) return cm_prefetch_share(next, bytes, q, blk->panels);
  return q == 0 ? CM_PREFETCH_SELF : (cm_prefetch){next, 0};
}

#endif /* CPUMOE_MOE_PIPELINE_H */
