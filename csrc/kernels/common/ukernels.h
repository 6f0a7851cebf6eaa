/*
 * The contract between the ISA-agnostic MoE pipeline (moe/) and the per-tier
 * micro-kernels. The pipeline only ever calls through a `cm_ukernels` table,
 * chosen once at load (dispatch/config.c); it never tests the ISA itself.
 *
 * Adding a tier: write its kernel files (suffix -<tier>.c, compiled with that
 * tier's flags only), declare its functions below, add a table row in
 * dispatch/config.c. Adding a scheme: new micro-kernel kinds here plus a packer.
 *
 * Shared operand layouts
 *   A panel  the token rows of a panel in the config's panel format (cm_panel_format): fp32
 *            or bf16 interleaved per k (a_stride = rows per k step), u8 quads, or rows one
 *            after another for tile loads (a_stride = elements per row).
 *   B tile   VNNI-2 16-bit [k/2][32][2]: one 32-column block of a packed weight
 *            (docs/FORMATS.md), i.e. 32 output channels over the whole reduction.
 *   C tile   fp32 [mr][32], row stride 32.
 * Every C element of the fp32-chain numerics class is one sequential fp32 FMA chain over
 * k = 0..k-1 starting from +0; other classes are stated in docs/NUMERICS.md.
 */
#ifndef CPUMOE_COMMON_UKERNELS_H
#define CPUMOE_COMMON_UKERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "cpumoe/cpumoe.h"

#define CM_NR 32     /* output channels per packed weight block and per C tile */
#define CM_MR_MAX 32 /* rows of the widest panel: two AMX tiles of 16 */
/* panels of the largest block (the dense linear's; the fused MoE's have 4, moe/pipeline.h) */
#define CM_PANELS_PER_BLOCK_MAX 8
/* Longest int8 reduction with exact int32 sums: k * 255 * 128 < 2^31 (and 128 * 127 * k
 * for the compensation). */
#define CM_INT8_MAX_REDUCTION 65536

/* Cache lines [start, start + 64 lines) that a micro-kernel prefetches while it runs, spread
 * evenly over its reduction loop: the weights that the calls after it will read. The
 * pipeline hands each panel of a block an equal share of the next weight chunk, so the
 * requests trickle out over the whole chunk instead of bursting in the first panel's pass
 * (a burst fills the core's miss buffers and stalls the loads of the dot products).
 * The lines go to L2 (prefetcht1), where the next chunk waits until its pass without
 * evicting the chunk in use from L1. A hint only: prefetching never faults, and a tier may
 * ignore it. (Measurements: docs/PERFORMANCE-HISTORY.md.) */
typedef struct cm_prefetch {
  const char *start;
  size_t lines;
} cm_prefetch;

/* No share: a caller whose call is the only one on its weights (a block of one panel)
 * lets the kernel read ahead on its own, as the decode kernels of the other schemes do:
 * its own distance ahead of the loads streams faster than the same lines requested as a
 * share. */
#define CM_PREFETCH_SELF ((cm_prefetch){NULL, 0})

/* C[mr][32] (+)= A_panel (rows 0..mr-1, the config's panel format) x B: the 16-bit weights
 * of a B tile (VNNI-2 [k/2][32][2]), or a chunk of quantized weights decoded once (its
 * kernels' own decoded format). `accumulate` = 0 starts C from +0. `prefetch`: lines to
 * request while the kernel runs (cm_prefetch); CM_PREFETCH_SELF lets it read ahead on its
 * own (vector kernels always do). */
typedef void (*cm_gemm_fn)(size_t mr, size_t k, const void *a_panel, size_t a_stride, const void *b,
                           float *c, int accumulate, cm_prefetch prefetch);

/* A spread in progress: the next line to request, the end, and the credit toward the next
 * line. Each loop step earns `lines` credit and a line costs `steps`, so `steps` calls of
 * cm_prefetch_step request exactly `lines` lines, evenly, with no division in the loop. */
typedef struct cm_prefetch_cursor {
  const char *next, *end;
  size_t lines, credit;
} cm_prefetch_cursor;

static inline __attribute__((always_inline)) cm_prefetch_cursor cm_prefetch_begin(cm_prefetch pf) {
  return (cm_prefetch_cursor){pf.start, pf.start + 64 * pf.lines, pf.lines, 0};
}

static inline __attribute__((always_inline)) void cm_prefetch_step(cm_prefetch_cursor *c,
                                                                   size_t steps) {
  for (c->credit += c->lines; c->credit >= steps && c->next < c->end; c->credit -= steps) {
    __builtin_prefetch(c->next, 0, 2); /* prefetcht1: see above */
    c->next += 64;
  }
}

/* The decode kernels' read-ahead: `lines` cache lines from `near` bytes past p into L1
 * (prefetcht0) and, if `far` is not 0, from `far` bytes past p into L2 (prefetcht1). */
static inline __attribute__((always_inline)) void cm_prefetch_ahead(const void *p, size_t near,
                                                                    size_t far, int lines) {
  const char *q = (const char *)p;
  for (int l = 0; l < lines; l++) __builtin_prefetch(q + near + 64 * l, 0, 3);
  if (far)
    for (int l = 0; l < lines; l++) __builtin_prefetch(q + far + 64 * l, 0, 2);
}

/* Requests what is left (a loop that ran fewer steps than planned, e.g. kc < 4). */
static inline __attribute__((always_inline)) void cm_prefetch_finish(cm_prefetch_cursor *c) {
  for (; c->next < c->end; c->next += 64) __builtin_prefetch(c->next, 0, 2);
}

/* INT8 W8A8 tile, exact integer part:
 *   acc[r][n] (+)= sum_{k<kc} A_panel[r][k] * B[k][n]    int32; A u8 in the config's format
 *                                                        (U8_QUADS: [kc/4][a_stride][4];
 *                                                        U8_ROWS: [rows][a_stride]),
 *                                                        B s8 VNNI-4 [kc/4][32][4]
 * `accumulate` = 0 starts from zero. Integer sums are exact, so a reduction may be split
 * into chunks (the pipeline does, to reuse each weight chunk across panels in cache).
 * `prefetch`: see cm_prefetch. acc has room for CM_MR_MAX rows, or for CM_AMX_CALL_ROWS where
 * mr is above CM_MR_MAX (a block in one call, cm_gemm_config.block_rows_max): a kernel may
 * write rows past mr (the tile kernel stores whole 16-row tiles). */
typedef void (*cm_gemm_u8s8_fn)(size_t mr, size_t kc, const uint8_t *a_panel, size_t a_stride,
                                const int8_t *b, int32_t *acc, int accumulate,
                                cm_prefetch prefetch);
/* C[r][n] = ((float)(acc[r][n] - comp[n]) * a_scale[r]) * w_scale[n]   (fp32, this order);
 * comp = the int32[32] stored after a packed int8 tile. */
typedef void (*cm_dequant_u8s8_fn)(size_t mr, const int32_t *acc, const int8_t *comp,
                                   const float *a_scale, const float *w_scale, float *c);

/* FP8 W8A16. A K block (block_k reduction steps sharing one scale per column) is summed
 * unscaled, then folded in with its scale, as SGLang's decode path does:
 *   P[r][n] = fp32 FMA chain over the block's k, from +0, of A[r][k] * d[k][n],
 *             d = e4m3(B[k][n]) * 2^-8 (exact: every e4m3 value times 2^-8 is an fp16 number)
 *   C[r][n] = fmaf(P[r][n], scale[n], C[r][n])           (C from +0 at the first block)
 * so C holds the result times 2^-8; the pipeline multiplies the finished tile by 256
 * (exact). Keeping the 2^-8 in C, not in the scale, keeps every finite scale usable.
 * Decode path: one call per K block (or the part of it inside the reduction), B fp8 VNNI-2
 * [kc/2][32][2], scale the columns' block scales; `accumulate` = 0 starts C from +0. */
typedef void (*cm_gemm_fp8_fn)(size_t mr, size_t kc, const void *a_panel, size_t a_stride,
                               const uint8_t *b, const float *scale, float *c, int accumulate);
/* FP8 prefill path: dst = d of a chunk (a chunk never spans two K blocks), decoded once into
 * the format of the config's gemm_chunk kernel (fp32 [kc][32], or bf16 VNNI-2 [kc/2][32][2]),
 * then P[mr][32] (+)= A_panel x that chunk (cm_gemm_fn) over the block's chunks, P with
 * room for CM_MR_MAX rows (a kernel may write rows past mr, as cm_gemm_u8s8_fn's acc) ... */
typedef void (*cm_fp8_decode_fn)(size_t kc, const uint8_t *b, void *dst);
/* ... and at the block's end C[r][n] = fmaf(P[r][n], scale[n], accumulate ? C : +0) * post,
 * two roundings (post = 1: the fmaf alone); the last block passes post = 2^8, which takes C
 * out of its 2^-8 scaling in the same pass. */
typedef void (*cm_fp8_fold_fn)(size_t mr, const float *p, const float *scale, float *c,
                               int accumulate, float post);

/* INT4 W4A8: one 32-column tile of packed weights (layout: common/int4.h). */
typedef struct cm_int4_tile {
  const uint8_t *blocks; /* [k_blocks][16 bk + 128] the tile's packed blocks */
  const int8_t *zeros;   /* [groups][32] zero points */
  const float *scales;   /* [groups][32] */
  size_t bk;             /* k per block */
  size_t group_blocks;   /* blocks per group: block b uses group b / group_blocks */
} cm_int4_tile;

/* The zero points and scales of group `group + ahead_groups` into L1: they live in arrays of
 * their own, which the nibble read-ahead does not cover (past the tile's last group they are
 * the next tile's; a prefetch never faults). */
static inline __attribute__((always_inline)) void cm_int4_prefetch_group_meta(const cm_int4_tile *w,
                                                                              size_t group,
                                                                              size_t ahead_groups) {
  const size_t at = (group + ahead_groups) * CM_NR;
  __builtin_prefetch(w->zeros + at, 0, 3);
  __builtin_prefetch(w->scales + at, 0, 3);
  __builtin_prefetch(w->scales + at + 16, 0, 3);
}
/* INT4 decode path, weights decoded in registers. For each block b of [kb0, kb0 + nb), in
 * order, with A u8 [nb bk/4][a_stride][4] starting at block kb0, holding q + 128, and
 * q_sums int32 [nb][a_stride], q_sums[b][r] = sum_{k in b} q[r][k]:
 *   s[r][n] = sum_{k in b} q[r][k] w[k][n] - zero[n] q_sums[b][r]   = sum q (w - zero), exact
 *   C[r][n] = fmaf((float)s[r][n], scale[n], C[r][n])      C starts at +0 unless accumulate
 * (the same integer as the prefill path's, so both give the same bits). mr <= 4. */
typedef void (*cm_gemm_int4_fn)(size_t mr, const cm_int4_tile *w, size_t kb0, size_t nb,
                                const uint8_t *a_panel, size_t a_stride, const int32_t *q_sums,
                                float *c, int accumulate);
/* INT4 prefill path: dst s8 VNNI-4 [nb][bk/4][32][4] = w - zero of blocks [kb0, kb0 + nb),
 * decoded once and reused by every panel through gemm_u8s8, then per block ... */
typedef void (*cm_int4_unpack_fn)(const cm_int4_tile *w, size_t kb0, size_t nb, int8_t *dst);
/* ... C[r][n] = fmaf((float)(acc[r][n] - 128 comp[n]), scale[n], accumulate ? C[r][n] : +0),
 * comp = the int32[32] after the block's nibbles: the same operations as cm_gemm_int4_fn.
 * The 32 columns of dst, acc and C (until `last`) may be in an order of the tier's own, the
 * same for its unpack and dequant; the call with `last` (the reduction's final block) leaves
 * C in column order. */
typedef void (*cm_int4_dequant_fn)(size_t mr, const int32_t *acc, const uint8_t *comp,
                                   const float *scale, float *c, int accumulate, int last);

/* MXFP4: e2m1 codes of a 32-row block, 32 bytes per k pair (layout: common/mxfp4.h), with
 * the block's e8m0 scales [groups][32]; each weight decodes exactly to bf16 (the value times
 * 2^(scale - 127), common/mxfp4.h), and the products enter the fp32 chain of the 16-bit
 * weights: MXFP4 computes what bf16 weights equal to the decoded ones compute.
 * Decode path (few rows): C[r][n] (+)= sum over the call's k of A[r][k] * w[k][n], the codes
 * decoded in registers; b and scales start at k = 0 of the call, k a multiple of 32 (whole
 * groups); `accumulate` = 0 starts C from +0. */
typedef void (*cm_gemm_mxfp4_fn)(size_t mr, size_t k, const void *a_panel, size_t a_stride,
                                 const uint8_t *b, const uint8_t *scales, float *c, int accumulate);
/* MXFP4 prefill path: dst = a chunk of k (a multiple of 32) decoded once into bf16 VNNI-2
 * [k/2][32][2], the 16-bit B tile, which the config's gemm_chunk (a cm_gemm_fn for bf16
 * weights) multiplies by every panel. */
typedef void (*cm_mxfp4_decode_fn)(size_t k, const uint8_t *b, const uint8_t *scales, void *dst);

/* out[i] = act(gate[i]) * up[i], act = silu or erf-gelu (see common/numeric.h) */
typedef void (*cm_gated_fn)(size_t n, const float *gate, const float *up, float *out);
/* out[i] = swiglu_clamp(gate[i], up[i]) (see common/numeric.h) */
typedef void (*cm_swiglu_fn)(size_t n, const float *gate, const float *up, float alpha, float limit,
                             float *out);
/* out[i] = silu_clamp(gate[i], up[i]) (see common/numeric.h), limit >= 0 */
typedef void (*cm_silu_clamp_fn)(size_t n, const float *gate, const float *up, float limit,
                                 float *out);
/* Routing scores (gating/): out[i] = exp(x[i] - shift), sigmoid(x[i]) or
 * sqrt(softplus(x[i])), with common/numeric.h's functions */
typedef void (*cm_exp_shifted_fn)(size_t n, const float *x, float shift, float *out);
typedef void (*cm_score_fn)(size_t n, const float *x, float *out);
/* dst[i] = fp32 value of 16-bit src[i] (bf16 or fp16) */
typedef void (*cm_widen_fn)(size_t n, const uint16_t *src, float *dst);
/* dst[i] = 16-bit src[i], round to nearest even */
typedef void (*cm_narrow_fn)(size_t n, const float *src, uint16_t *dst);
/* v[i] = round_to_16bit(v[i]) as fp32, in place */
typedef void (*cm_round_fn)(size_t n, float *v);
/* y[i] += a * x[i] (mul then add, two roundings) */
typedef void (*cm_axpy_fn)(size_t n, float a, const float *x, float *y);
/* y[i] = (c[i] + bias[i]) * g, or c[i] * g without bias */
typedef void (*cm_bias_scale_fn)(size_t n, const float *c, const float *bias, float g, float *y);
/* c[r][i] = c[r][i] * g[r] in place, for rows r < rows of n floats (row stride n): a block's
 * rows times their own scales, bias_scale's multiply without a bias */
typedef void (*cm_scale_rows_fn)(size_t rows, size_t n, float *c, const float *g);
/* bias_scale_stream: the same values, with y written by streaming stores where the tier has
 * them (y 64-byte aligned, n a multiple of 16; otherwise plain stores): for an output that
 * only a later stage reads, so that writing it costs no read of its old lines. The task
 * queue's workers end with a full fence (common/parallel.c), which orders those stores
 * before the stage's end. */
/* dst = the `bytes` at src, by streaming stores where the tier has them (dst 64-byte aligned,
 * bytes a multiple of 64; otherwise a plain copy), for the same kind of output */
typedef void (*cm_copy_fn)(size_t bytes, const void *src, void *dst);
/* returns max(m, max_i |x[i]|) */
typedef float (*cm_absmax_fn)(size_t n, const float *x, float m);
/* q[i] = 128 + clamp(round_half_even(x[i] * inv_scale), -127, 127) */
typedef void (*cm_quantize_u8_fn)(size_t n, const float *x, float inv_scale, uint8_t *q);

/* ---- what a tier provides -----------------------------------------------------------
 * Kernels are grouped by who calls them: the elementwise kernels every scheme shares, the
 * roofline probes, and per scheme the GEMM kernels of its hooks (schemes/<name>/scheme.c).
 * A tier's table (dispatch/config.c) starts from its parent's and overrides only what the
 * tier improves. */

/* How the rows of a panel are laid out for a scheme's GEMM kernels (the A operand);
 * moe/panels.c packs each format. */
typedef enum cm_panel_format {
  CM_PANEL_F32 = 0,      /* fp32 [k][rows] */
  CM_PANEL_U8_QUADS = 1, /* u8 [k/4][rows][4] holding q + 128, q the row quantized to int8
                          * per row (scale per row) */
  CM_PANEL_U8_QUADS_BLOCK_SUMS = 2, /* the same, plus int32 [blocks][rows]: each row's sum of
                                     * q over each of the scheme's reduction blocks */
  CM_PANEL_BF16_PAIRS = 3,          /* uint32 [k/2][rows]: bf16 elements k and k + 1 of a row in one
                                     * dword, k in the high half (which vdpbf16ps takes first) */
  CM_PANEL_BF16_ROWS = 4,           /* bf16 [rows][k]: rows one after another (AMX A tiles) */
  CM_PANEL_U8_ROWS = 5, /* u8 [rows][k] of q + 128, quantized as U8_QUADS (AMX A tiles) */
  CM_PANEL_FORMAT_COUNT = 6,
} cm_panel_format;

typedef struct cm_unquant_kernels {
  cm_gemm_fn gemm;        /* B tile of 16-bit weights in the activation dtype */
  cm_gemm_fn gemm_decode; /* blocks of up to decode_max_rows rows; NULL: none */
} cm_unquant_kernels;

typedef struct cm_int8_kernels {
  cm_gemm_u8s8_fn gemm;
  cm_gemm_u8s8_fn gemm_decode; /* blocks of up to decode_max_rows rows; NULL: none */
  cm_dequant_u8s8_fn dequant;
} cm_int8_kernels;

typedef struct cm_fp8_kernels {
  cm_gemm_fp8_fn gemm_decode;    /* few rows: e4m3 decoded in registers */
  cm_fp8_decode_fn decode_chunk; /* more rows: a chunk decoded once ... */
  cm_gemm_fn gemm_chunk;         /* ... multiplied by every panel ... */
  cm_fp8_fold_fn fold;           /* ... and folded in with the block scale */
} cm_fp8_kernels;

typedef struct cm_mxfp4_kernels {
  cm_gemm_mxfp4_fn gemm_decode;    /* few rows: codes decoded in registers */
  cm_mxfp4_decode_fn decode_chunk; /* more rows: a chunk decoded once to bf16 ... */
  cm_gemm_fn gemm_chunk;           /* ... and multiplied by every panel (bf16 weights) */
} cm_mxfp4_kernels;

typedef struct cm_int4_kernels {
  cm_gemm_int4_fn gemm_decode; /* few rows, nibbles in registers; NULL: always unpack */
  cm_int4_unpack_fn unpack;    /* more rows: blocks unpacked once to s8 VNNI-4 ... */
  cm_gemm_u8s8_fn gemm_u8s8;   /* ... multiplied by every panel ... */
  cm_int4_dequant_fn dequant;  /* ... and folded in per block with the group scale */
} cm_int4_kernels;

/* One (scheme, activation dtype, tier) triple: the GEMM kernels and the tile they are
 * written for. */
typedef struct cm_gemm_config {
  size_t mr;                /* rows per A panel: at most the kernels' tile rows, CM_MR_MAX */
  size_t nr;                /* columns per B tile and C tile: CM_NR */
  size_t kr;                /* k values interleaved per B column: 2 (VNNI-2) or 4 (VNNI-4) */
  cm_panel_format a_format; /* the A panels the kernels read */
  /* Blocks of up to this many rows take the scheme's decode kernel (weights expanded in
   * registers, read once, or a vector kernel where a tile kernel would waste its rows),
   * their panels packed in decode_a_format; larger ones take the main kernels. 0: no
   * decode kernel. Not above the decode kernel's own tile rows, except for INT4, whose
   * decode kernels the scheme calls panel by panel (a tier may send every block there). */
  size_t decode_max_rows;
  cm_panel_format decode_a_format;
  /* How the unquantized and INT8 schemes walk a block of several panels. A block of up to
   * this many panels goes panel by panel over the whole reduction, the first panel's call
   * streaming the weights on its own (CM_PREFETCH_SELF) and the others reading them back from
   * L2: for tile kernels, which stage a stream they read themselves and keep C in tiles for a
   * whole call. A larger block goes in chunks of the reduction, each applied to every panel
   * while it is in L1, each call prefetching its share of the next chunk. 0 or 1: every
   * block of several panels goes in chunks. */
  size_t panel_major_panels;
  /* A block of several panels and up to this many rows, which would go panel by panel,
   * goes through the main kernel in one call instead: the weights streamed once with C in
   * tiles for every row (the panels of a block are one row-major matrix, moe/pipeline.h).
   * 0: panel by panel. Not above the main kernel's rows per call. */
  size_t block_rows_max;
  /* Panels per block of the dense linear (moe/linear.c) where that many panels' A rows fit
   * its cache budget: CM_PANELS_PER_BLOCK_MAX (8) where the scheme's block GEMM keeps up with
   * them in L1, 0 for the fused MoE's 4. */
  size_t linear_block_panels;
  union {
    cm_unquant_kernels unquant;
    cm_int8_kernels int8;
    cm_fp8_kernels fp8;
    cm_int4_kernels int4;
    cm_mxfp4_kernels mxfp4;
  } kernels; /* the member of the config's scheme */
} cm_gemm_config;

typedef struct cm_elementwise_kernels {
  cm_gated_fn silu_mul, gelu_mul;
  cm_swiglu_fn swiglu;
  cm_silu_clamp_fn silu_clamp;
  cm_widen_fn widen_bf16, widen_f16;
  cm_narrow_fn narrow_bf16, narrow_f16;
  cm_round_fn round_bf16, round_f16;
  cm_axpy_fn axpy;
  cm_bias_scale_fn bias_scale;
  cm_bias_scale_fn bias_scale_stream;
  cm_scale_rows_fn scale_rows;
  cm_copy_fn copy_stream;
  cm_absmax_fn absmax;
  cm_quantize_u8_fn quantize_u8;
  cm_exp_shifted_fn exp_shifted;
  cm_score_fn sigmoid, sqrtsoftplus;
} cm_elementwise_kernels;

/* roofline probes: stream `bytes` once; run `iterations` of the widest FMA loop; of the
 * tier's u8*s8 multiply-add loop; of the loop its INT4 kernels run (the u8*s8 loop where they
 * run the same instruction; avx2's vpmaddubsw of nibbles); of the bf16 multiply-add loop its
 * bf16 kernels run on (the FMA loop on tiers that widen bf16 to fp32). Each returns the
 * operations done (2 per multiply-add). */
typedef struct cm_probe_kernels {
  double (*read)(const void *buffer, size_t bytes);
  double (*fma)(int64_t iterations);
  double (*int8)(int64_t iterations);
  double (*int4)(int64_t iterations);
  double (*bf16)(int64_t iterations);
} cm_probe_kernels;

#define CM_SCHEME_COUNT 5 /* moe_comp_method values 0..4 (cpumoe_scheme) */
/* Activation dtypes a config is chosen by: CPUMOE_DTYPE_BF16 (0) and CPUMOE_DTYPE_F16 (1). */
#define CM_ACT_DTYPE_COUNT 2

typedef struct cm_tier_config {
  cpumoe_isa isa;
  cm_elementwise_kernels elementwise;
  cm_probe_kernels probes;
  /* by cpumoe_scheme, then activation dtype */
  cm_gemm_config gemm[CM_SCHEME_COUNT][CM_ACT_DTYPE_COUNT];
  /* Called by every worker at the end of an op's stages when not NULL: gives back per-thread
   * state the tier's kernels took during the op (AMX tiles). */
  void (*end_op)(void);
} cm_tier_config;

/* The table of the active tier (dispatch/config.c). */
const cm_tier_config *cm_active_config(void);

/* Per-tier symbols, one group per kind of kernel; a tier defines the groups it overrides.
 * Elementwise kernels come from one generic source (elementwise/elementwise-impl.h)
 * compiled once per tier. */
#define CM_DECLARE_ELEMENTWISE(tier)                                                       \
  void cm_silu_mul__##tier(size_t, const float *, const float *, float *);                 \
  void cm_gelu_mul__##tier(size_t, const float *, const float *, float *);                 \
  void cm_swiglu__##tier(size_t, const float *, const float *, float, float, float *);     \
  void cm_silu_clamp__##tier(size_t, const float *, const float *, float, float *);        \
  void cm_widen_bf16__##tier(size_t, const uint16_t *, float *);                           \
  void cm_widen_f16__##tier(size_t, const uint16_t *, float *);                            \
  void cm_narrow_bf16__##tier(size_t, const float *, uint16_t *);                          \
  void cm_narrow_f16__##tier(size_t, const float *, uint16_t *);                           \
  void cm_round_bf16__##tier(size_t, float *);                                             \
  void cm_round_f16__##tier(size_t, float *);                                              \
  void cm_axpy__##tier(size_t, float, const float *, float *);                             \
  void cm_bias_scale__##tier(size_t, const float *, const float *, float, float *);        \
  void cm_bias_scale_stream__##tier(size_t, const float *, const float *, float, float *); \
  void cm_scale_rows__##tier(size_t, size_t, float *, const float *);                      \
  void cm_copy_stream__##tier(size_t, const void *, void *);                               \
  float cm_absmax__##tier(size_t, const float *, float);                                   \
  void cm_quantize_u8__##tier(size_t, const float *, float, uint8_t *);                    \
  void cm_fp8_fold__##tier(size_t, const float *, const float *, float *, int, float);     \
  void cm_exp_shifted__##tier(size_t, const float *, float, float *);                      \
  void cm_sigmoid__##tier(size_t, const float *, float *);                                 \
  void cm_sqrtsoftplus__##tier(size_t, const float *, float *);
#define CM_DECLARE_PROBES(tier)                             \
  double cm_probe_read_chunk__##tier(const void *, size_t); \
  double cm_probe_fma_loop__##tier(int64_t);                \
  double cm_probe_int8_loop__##tier(int64_t);
#define CM_DECLARE_UNQUANT(tier)                                                             \
  void cm_bf16_gemm_f32acc_mrx32__##tier(size_t, size_t, const void *, size_t, const void *, \
                                         float *, int, cm_prefetch);                         \
  void cm_f16_gemm_f32acc_mrx32__##tier(size_t, size_t, const void *, size_t, const void *,  \
                                        float *, int, cm_prefetch);
#define CM_DECLARE_INT8(tier)                                                                     \
  void cm_u8s8_gemm_s32acc_mrx32__##tier(size_t, size_t, const uint8_t *, size_t, const int8_t *, \
                                         int32_t *, int, cm_prefetch);                            \
  void cm_u8s8_dequant_mrx32__##tier(size_t, const int32_t *, const int8_t *, const float *,      \
                                     const float *, float *);
#define CM_DECLARE_FP8(tier)                                                                   \
  void cm_fp8_gemm_f32acc_mrx32__##tier(size_t, size_t, const void *, size_t, const uint8_t *, \
                                        const float *, float *, int);                          \
  void cm_fp8_to_f32__##tier(size_t, const uint8_t *, void *);                                 \
  void cm_f32_gemm_f32acc_mrx32__##tier(size_t, size_t, const void *, size_t, const void *,    \
                                        float *, int, cm_prefetch);
#define CM_DECLARE_INT4(tier)                                                                 \
  void cm_int4_unpack__##tier(const cm_int4_tile *, size_t, size_t, int8_t *);                \
  void cm_int4_dequant_mrx32__##tier(size_t, const int32_t *, const uint8_t *, const float *, \
                                     float *, int, int);
#define CM_DECLARE_INT4_DECODE(tier)                                                   \
  void cm_int4_gemm_f32acc_mrx32__##tier(size_t, const cm_int4_tile *, size_t, size_t, \
                                         const uint8_t *, size_t, const int32_t *, float *, int);

#define CM_DECLARE_MXFP4(tier)                                                                   \
  void cm_mxfp4_gemm_f32acc_mrx32__##tier(size_t, size_t, const void *, size_t, const uint8_t *, \
                                          const uint8_t *, float *, int);                        \
  void cm_mxfp4_to_bf16__##tier(size_t, const uint8_t *, const uint8_t *, void *);

#define CM_DECLARE_ALL_KERNELS(tier) \
  CM_DECLARE_ELEMENTWISE(tier)       \
  CM_DECLARE_PROBES(tier)            \
  CM_DECLARE_UNQUANT(tier)           \
  CM_DECLARE_INT8(tier)              \
  CM_DECLARE_FP8(tier)               \
  CM_DECLARE_INT4(tier)              \
  CM_DECLARE_MXFP4(tier)

CM_DECLARE_ALL_KERNELS(scalar)
CM_DECLARE_ALL_KERNELS(avx2)
CM_DECLARE_ALL_KERNELS(avx512)
CM_DECLARE_INT4_DECODE(avx512)

/* avx2: one-pass decode kernels for blocks of few rows (schemes/unquant, int8, int4) */
void cm_bf16_gemm_decode_mrx32__avx2(size_t, size_t, const void *, size_t, const void *, float *,
                                     int, cm_prefetch);
void cm_f16_gemm_decode_mrx32__avx2(size_t, size_t, const void *, size_t, const void *, float *,
                                    int, cm_prefetch);
void cm_u8s8_gemm_decode_mrx32__avx2(size_t, size_t, const uint8_t *, size_t, const int8_t *,
                                     int32_t *, int, cm_prefetch);
void cm_int4_gemm_decode_1x32__avx2(size_t, const cm_int4_tile *, size_t, size_t, const uint8_t *,
                                    size_t, const int32_t *, float *, int);
void cm_int4_unpacked_gemm_s32acc_mrx32__avx2(size_t, size_t, const uint8_t *, size_t,
                                              const int8_t *, int32_t *, int, cm_prefetch);
void cm_fp8_gemm_decode_mrx32__avx2(size_t, size_t, const void *, size_t, const uint8_t *,
                                    const float *, float *, int);
double cm_probe_int4_loop__avx2(int64_t);

/* avx2vnni: vpdpbusd on ymm (schemes/int8, schemes/int4, probe) */
void cm_u8s8_gemm_s32acc_mrx32__avx2vnni(size_t, size_t, const uint8_t *, size_t, const int8_t *,
                                         int32_t *, int, cm_prefetch);
void cm_u8s8_gemm_decode_mrx32__avx2vnni(size_t, size_t, const uint8_t *, size_t, const int8_t *,
                                         int32_t *, int, cm_prefetch);
void cm_int4_gemm_decode_1x32__avx2vnni(size_t, const cm_int4_tile *, size_t, size_t,
                                        const uint8_t *, size_t, const int32_t *, float *, int);
double cm_probe_int8_loop__avx2vnni(int64_t);

/* avx512bf16: vdpbf16ps on BF16_PAIRS panels (schemes/unquant, schemes/fp8) */
void cm_bf16_gemm_pairs_mrx32__avx512bf16(size_t, size_t, const void *, size_t, const void *,
                                          float *, int, cm_prefetch);
void cm_fp8_gemm_pairs_mrx32__avx512bf16(size_t, size_t, const void *, size_t, const uint8_t *,
                                         const float *, float *, int);
void cm_fp8_to_bf16__avx512bf16(size_t, const uint8_t *, void *);
void cm_mxfp4_gemm_pairs_mrx32__avx512bf16(size_t, size_t, const void *, size_t, const uint8_t *,
                                           const uint8_t *, float *, int);

/* amx: tile GEMMs on BF16_ROWS and U8_ROWS panels (tiles/gemm-amx.c); the `rows` entries
 * take up to CM_AMX_CALL_ROWS rows a call, the panels of a block at once (three rows of
 * tiles; cm_gemm_config.block_rows_max), the `tiles` entry up to CM_MR_MAX */
#define CM_AMX_CALL_ROWS 48
void cm_bf16_gemm_rows_mrx32__amx(size_t, size_t, const void *, size_t, const void *, float *, int,
                                  cm_prefetch);
void cm_bf16_gemm_tiles_mrx32__amx(size_t, size_t, const void *, size_t, const void *, float *, int,
                                   cm_prefetch);
void cm_u8s8_gemm_rows_mrx32__amx(size_t, size_t, const uint8_t *, size_t, const int8_t *,
                                  int32_t *, int, cm_prefetch);
void cm_mxfp4_gemm_rows_mrx32__amx(size_t, size_t, const void *, size_t, const uint8_t *,
                                   const uint8_t *, float *, int);
void cm_amx_end_op__amx(void);
double cm_probe_bf16_loop__amx(int64_t);
double cm_probe_int8_loop__amx(int64_t);

/* Preconditions of a kernel, checked in test builds (CPUMOE_CHECK_PRECONDITIONS, set by
 * tools/build_c_tests.py) and compiled out otherwise: a violation there aborts with the
 * condition and its place instead of computing something else (e.g. fewer rows). */
#ifdef CPUMOE_CHECK_PRECONDITIONS
void cm_precondition_failed(const char *condition, const char *file, int line);
#define CM_EXPECT(cond) ((cond) ? (void)0 : cm_precondition_failed(#cond, __FILE__, __LINE__))
#else
#define CM_EXPECT(cond) ((void)0)
#endif

#endif /* CPUMOE_COMMON_UKERNELS_H */
