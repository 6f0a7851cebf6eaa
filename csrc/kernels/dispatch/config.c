/*
 * Each tier's kernel table, and the choice of the active tier.
 *
 * Tables are built once, in rank order (cpumoe/tiers.h): a tier's table starts as a copy
 * of its parent's and its override function below replaces only the kernels the tier
 * improves (BLIS's cntx_init pattern), so a tier may speed up one scheme and inherit the
 * rest. The scalar tier fills every slot: the portable defaults.
 *
 * The best tier the CPU supports is found once (cpuid + xgetbv); the environment variable
 * CPUMOE_ISA=<tier> caps it at load, cpumoe_set_isa_cap at run time. Only function
 * pointers live here: nothing tier-specific executes in this baseline-compiled file.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/parallel.h"
#include "common/ukernels.h"
#include "dispatch/cpuinfo.h"

/* Rows of each tier's GEMM register tile (the register budget: common/tile-<tier>.h). */
#define CM_TILE_MR_SCALAR 4
#define CM_TILE_MR_AVX2 4
#define CM_TILE_MR_AVX2VNNI 6
/* avx2's 16-bit-weight tile: 6 rows x 16 columns, 12 accumulators, even and odd k widened
 * apart (unquant/gemm-avx2.c), also MXFP4's chunks decoded to bf16. Qwen3 on the AMX Xeon capped
 * to avx2, paired against 4 rows: bf16 M = 512 0.954, M = 64 0.927; MXFP4 M = 512 0.951; fp16
 * M = 512 0.882, M = 64 0.942 (docs/PERFORMANCE-HISTORY.md). */
#define CM_TILE_MR_AVX2_16BIT 6
/* avx2's fp32-weight tile (FP8's chunks decoded once, fp8/gemm-avx2.c): 6 x 16, 12 accumulators
 * beside 2 B vectors and a broadcast. Against 4 rows: M = 512 0.844, M = 64 0.966. */
#define CM_TILE_MR_AVX2_F32 6
/* avx2's INT8 tile: 6 x 8 per pass, 12 accumulators (int8/gemm-avx2.c). Against 4 rows: M = 512
 * 0.944 and 0.976, M = 64 1.139 and 0.999 in two paired runs each. */
#define CM_TILE_MR_AVX2_INT8 6
#define CM_TILE_MR_AVX512 12
#define CM_TILE_MR_AMX 32
/* Rows the decode kernels of FP8 (every tier) and INT4 (avx512) take: up to 4 rows of
 * accumulators beside the weights they expand in registers. */
#define CM_DECODE_MAX_ROWS 4

#define CM_ELEMENTWISE_KERNELS(tier)                     \
  ((cm_elementwise_kernels){                             \
      .silu_mul = cm_silu_mul__##tier,                   \
      .gelu_mul = cm_gelu_mul__##tier,                   \
      .swiglu = cm_swiglu__##tier,                       \
      .silu_clamp = cm_silu_clamp__##tier,               \
      .widen_bf16 = cm_widen_bf16__##tier,               \
      .widen_f16 = cm_widen_f16__##tier,                 \
      .narrow_bf16 = cm_narrow_bf16__##tier,             \
      .narrow_f16 = cm_narrow_f16__##tier,               \
      .round_bf16 = cm_round_bf16__##tier,               \
      .round_f16 = cm_round_f16__##tier,                 \
      .axpy = cm_axpy__##tier,                           \
      .bias_scale = cm_bias_scale__##tier,               \
      .bias_scale_stream = cm_bias_scale_stream__##tier, \
      .scale_rows = cm_scale_rows__##tier,               \
      .copy_stream = cm_copy_stream__##tier,             \
      .absmax = cm_absmax__##tier,                       \
      .quantize_u8 = cm_quantize_u8__##tier,             \
      .exp_shifted = cm_exp_shifted__##tier,             \
      .sigmoid = cm_sigmoid__##tier,                     \
      .sqrtsoftplus = cm_sqrtsoftplus__##tier,           \
  })
#define CM_PROBE_KERNELS(tier)                             \
  ((cm_probe_kernels){.read = cm_probe_read_chunk__##tier, \
                      .fma = cm_probe_fma_loop__##tier,    \
                      .int8 = cm_probe_int8_loop__##tier,  \
                      .int4 = cm_probe_int8_loop__##tier,  \
                      .bf16 = cm_probe_fma_loop__##tier})
/* 16-bit weights of one dtype (bf16 or f16) on fp32 panels */
#define CM_UNQUANT_KERNELS(tier, dtype) \
  ((cm_unquant_kernels){.gemm = cm_##dtype##_gemm_f32acc_mrx32__##tier})
#define CM_INT8_KERNELS(tier)                                          \
  ((cm_int8_kernels){.gemm = cm_u8s8_gemm_s32acc_mrx32__##tier,        \
                     .gemm_decode = cm_u8s8_gemm_s32acc_mrx32__##tier, \
                     .dequant = cm_u8s8_dequant_mrx32__##tier})
#define CM_FP8_KERNELS(tier)                                         \
  ((cm_fp8_kernels){.gemm_decode = cm_fp8_gemm_f32acc_mrx32__##tier, \
                    .decode_chunk = cm_fp8_to_f32__##tier,           \
                    .gemm_chunk = cm_f32_gemm_f32acc_mrx32__##tier,  \
                    .fold = cm_fp8_fold__##tier})
/* MXFP4: the tier's register decode, its chunk decoder, and its bf16-weight kernel on fp32
 * panels for the decoded chunks */
#define CM_MXFP4_KERNELS(tier)                                           \
  ((cm_mxfp4_kernels){.gemm_decode = cm_mxfp4_gemm_f32acc_mrx32__##tier, \
                      .decode_chunk = cm_mxfp4_to_bf16__##tier,          \
                      .gemm_chunk = cm_bf16_gemm_f32acc_mrx32__##tier})
/* INT4 without a decode kernel: every block unpacks, then runs the tier's u8 x s8 GEMM */
#define CM_INT4_UNPACK_KERNELS(tier)                                 \
  ((cm_int4_kernels){.gemm_decode = NULL,                            \
                     .unpack = cm_int4_unpack__##tier,               \
                     .gemm_u8s8 = cm_u8s8_gemm_s32acc_mrx32__##tier, \
                     .dequant = cm_int4_dequant_mrx32__##tier})

/* ---- each tier's overrides ---- */

#define CM_BF16 CPUMOE_DTYPE_BF16
#define CM_F16 CPUMOE_DTYPE_F16
#define CM_UNQUANT CPUMOE_SCHEME_UNQUANT
#define CM_INT8 CPUMOE_SCHEME_INT8_W8A8
#define CM_FP8 CPUMOE_SCHEME_FP8_W8A16
#define CM_INT4 CPUMOE_SCHEME_INT4_W4A8
#define CM_MXFP4 CPUMOE_SCHEME_MXFP4

/* The portable defaults: every slot. Only the unquantized scheme's kernels depend on the
 * activation dtype (the weights are in it); the others start alike for both. */
static void cm_config_init__scalar(cm_tier_config *c) {
  c->elementwise = CM_ELEMENTWISE_KERNELS(scalar);
  c->probes = CM_PROBE_KERNELS(scalar);
  for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {
    const cm_gemm_config base = {.mr = CM_TILE_MR_SCALAR, .nr = CM_NR};
    cm_gemm_config *g = &c->gemm[CM_UNQUANT][act];
    *g = base, g->kr = 2, g->a_format = CM_PANEL_F32;
    g->kernels.unquant =
        act == CM_BF16 ? CM_UNQUANT_KERNELS(scalar, bf16) : CM_UNQUANT_KERNELS(scalar, f16);
    g = &c->gemm[CM_INT8][act];
    *g = base, g->kr = 4, g->a_format = CM_PANEL_U8_QUADS;
    g->kernels.int8 = CM_INT8_KERNELS(scalar);
    g = &c->gemm[CM_FP8][act];
    *g = base, g->kr = 2, g->a_format = g->decode_a_format = CM_PANEL_F32;
    g->decode_max_rows = CM_DECODE_MAX_ROWS;
    g->kernels.fp8 = CM_FP8_KERNELS(scalar);
    g = &c->gemm[CM_INT4][act];
    *g = base, g->kr = 4, g->a_format = CM_PANEL_U8_QUADS;
    g->kernels.int4 = CM_INT4_UNPACK_KERNELS(scalar);
    g = &c->gemm[CM_MXFP4][act];
    *g = base, g->kr = 2, g->a_format = g->decode_a_format = CM_PANEL_F32;
    g->decode_max_rows = CM_DECODE_MAX_ROWS;
    g->kernels.mxfp4 = CM_MXFP4_KERNELS(scalar);
  }
}

/* A tier that has its own version of every kernel kind (its tile rows still to be set). The
 * unquantized, INT8 and INT4 sets have no decode kernel of their own, so a parent's decode
 * split for them is dropped with the parent's kernels; FP8's decode kernel takes its
 * CM_DECODE_MAX_ROWS again. */
#define CM_OVERRIDE_EVERY_KERNEL(c, tier)                                            \
  do {                                                                               \
    (c)->elementwise = CM_ELEMENTWISE_KERNELS(tier);                                 \
    (c)->probes = CM_PROBE_KERNELS(tier);                                            \
    (c)->gemm[CM_UNQUANT][CM_BF16].kernels.unquant = CM_UNQUANT_KERNELS(tier, bf16); \
    (c)->gemm[CM_UNQUANT][CM_F16].kernels.unquant = CM_UNQUANT_KERNELS(tier, f16);   \
    for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {                             \
      (c)->gemm[CM_UNQUANT][act].decode_max_rows = 0;                                \
      (c)->gemm[CM_INT8][act].decode_max_rows = 0;                                   \
      (c)->gemm[CM_INT4][act].decode_max_rows = 0;                                   \
      (c)->gemm[CM_FP8][act].decode_max_rows = CM_DECODE_MAX_ROWS;                   \
      (c)->gemm[CM_INT8][act].kernels.int8 = CM_INT8_KERNELS(tier);                  \
      (c)->gemm[CM_FP8][act].kernels.fp8 = CM_FP8_KERNELS(tier);                     \
      (c)->gemm[CM_INT4][act].kernels.int4 = CM_INT4_UNPACK_KERNELS(tier);           \
      (c)->gemm[CM_MXFP4][act].kernels.mxfp4 = CM_MXFP4_KERNELS(tier);               \
    }                                                                                \
  } while (0)

/* every config of the tier */
#define CM_FOR_EACH_GEMM(c, g)               \
  for (cm_gemm_config *g = &(c)->gemm[0][0]; \
       g < &(c)->gemm[0][0] + CM_SCHEME_COUNT * CM_ACT_DTYPE_COUNT; g++)

/* Rows of the avx2 one-pass decode kernels: bf16/fp16 keep 4 fp32 chains per row for up to
 * 2 rows in 16 ymm, INT8 up to 2 rows (8 int32 accumulators for 1, 4 per row for 2). INT4's
 * decode kernel (nibbles split in registers, a row pair sharing each split) takes blocks of up
 * to 2 rows; larger blocks unpack each chunk once and run vpmaddubsw on the unpacked tile
 * (int4/gemm-avx2.c), with no split per row pair. Both use vpmaddubsw, twice the products per
 * instruction of the INT8 tile's widened vpmaddwd. Qwen3 on the AMX Xeon capped to avx2,
 * paired A/Bs against every block on the decode kernel: M = 512 0.831, M = 64 0.946 (blocks
 * of up to 4 rows on it: 0.992; of 1 row against 2: 0.995) (docs/PERFORMANCE-HISTORY.md,
 * "INT4 on avx2: the unpacked tile on vpmaddubsw"). */
#define CM_AVX2_UNQUANT_DECODE_ROWS 2
#define CM_AVX2_INT8_DECODE_ROWS 2
#define CM_AVX2_INT4_DECODE_ROWS 2
#define CM_AVX2_FP8_DECODE_ROWS 2   /* 4 accumulators a row beside the decoded weights */
#define CM_AVX2_MXFP4_DECODE_ROWS 2 /* 4 accumulators per row for the 32 columns in one pass */
/* g takes blocks of up to max_rows rows on its decode kernel, with panels in `format` */
static cm_gemm_config *with_decode(cm_gemm_config *g, size_t max_rows, cm_panel_format format) {
  g->decode_max_rows = max_rows;
  g->decode_a_format = format;
  return g;
}

static void cm_config_init__avx2(cm_tier_config *c) {
  CM_OVERRIDE_EVERY_KERNEL(c, avx2);
  c->probes.int4 = cm_probe_int4_loop__avx2; /* its INT4 kernels run vpmaddubsw on nibbles */
  CM_FOR_EACH_GEMM(c, g) g->mr = CM_TILE_MR_AVX2;
  for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {
    c->gemm[CM_UNQUANT][act].mr = CM_TILE_MR_AVX2_16BIT;
    c->gemm[CM_INT8][act].mr = CM_TILE_MR_AVX2_INT8;
    c->gemm[CM_FP8][act].mr = CM_TILE_MR_AVX2_F32;     /* chunks decoded to fp32 */
    c->gemm[CM_MXFP4][act].mr = CM_TILE_MR_AVX2_16BIT; /* chunks decoded to bf16 */
  }
  for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {
    with_decode(&c->gemm[CM_UNQUANT][act], CM_AVX2_UNQUANT_DECODE_ROWS, CM_PANEL_F32)
        ->kernels.unquant.gemm_decode =
        act == CM_BF16 ? cm_bf16_gemm_decode_mrx32__avx2 : cm_f16_gemm_decode_mrx32__avx2;
    with_decode(&c->gemm[CM_INT8][act], CM_AVX2_INT8_DECODE_ROWS, CM_PANEL_U8_QUADS)
        ->kernels.int8.gemm_decode = cm_u8s8_gemm_decode_mrx32__avx2;
    cm_int4_kernels *int4 =
        &with_decode(&c->gemm[CM_INT4][act], CM_AVX2_INT4_DECODE_ROWS, CM_PANEL_U8_QUADS_BLOCK_SUMS)
             ->kernels.int4;
    int4->gemm_decode = cm_int4_gemm_decode_1x32__avx2;
    int4->gemm_u8s8 = cm_int4_unpacked_gemm_s32acc_mrx32__avx2;
    with_decode(&c->gemm[CM_FP8][act], CM_AVX2_FP8_DECODE_ROWS, CM_PANEL_F32)
        ->kernels.fp8.gemm_decode = cm_fp8_gemm_decode_mrx32__avx2;
    with_decode(&c->gemm[CM_MXFP4][act], CM_AVX2_MXFP4_DECODE_ROWS, CM_PANEL_F32);
  }
}

#define CM_AVX2VNNI_INT4_DECODE_ROWS 1

/* AVX-VNNI (AVX2 CPUs with the VEX vpdpbusd): INT8 and INT4 sum u8 x s8 products straight
 * into int32 lanes, one instruction per 4 products where avx2 needs a widening multiply and
 * an add per 2; the same exact integers, so avx2's bits. Everything else is avx2's. */
static void cm_config_init__avx2vnni(cm_tier_config *c) {
  c->probes.int8 = c->probes.int4 = cm_probe_int8_loop__avx2vnni;
  for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {
    c->gemm[CM_INT8][act].mr = c->gemm[CM_INT4][act].mr = CM_TILE_MR_AVX2VNNI;
    cm_int8_kernels *int8 = &c->gemm[CM_INT8][act].kernels.int8;
    int8->gemm = cm_u8s8_gemm_s32acc_mrx32__avx2vnni;
    int8->gemm_decode = cm_u8s8_gemm_decode_mrx32__avx2vnni;
    cm_int4_kernels *int4 = &c->gemm[CM_INT4][act].kernels.int4;
    int4->gemm_u8s8 = cm_u8s8_gemm_s32acc_mrx32__avx2vnni;
    int4->gemm_decode = cm_int4_gemm_decode_1x32__avx2vnni;
    /* with vpdpbusd the unpack path's 6 x 16 tile wins from a few rows on (Qwen3 against
     * every block on the decode kernel: M = 16 about even, 1.05; M = 512 1.9x faster) */
    c->gemm[CM_INT4][act].decode_max_rows = CM_AVX2VNNI_INT4_DECODE_ROWS;
  }
}

static void cm_config_init__avx512(cm_tier_config *c) {
  CM_OVERRIDE_EVERY_KERNEL(c, avx512);
  CM_FOR_EACH_GEMM(c, g) g->mr = CM_TILE_MR_AVX512;
  for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {
    /* decode expands nibbles in registers and needs each row's sums per block */
    with_decode(&c->gemm[CM_INT4][act], CM_DECODE_MAX_ROWS, CM_PANEL_U8_QUADS_BLOCK_SUMS)
        ->kernels.int4.gemm_decode = cm_int4_gemm_f32acc_mrx32__avx512;
    with_decode(&c->gemm[CM_MXFP4][act], CM_DECODE_MAX_ROWS, CM_PANEL_F32);
    /* the dense linear's blocks of 8 panels (96 rows per pass over a weight chunk, INT8's
     * chunks twice as long): Qwen3 M = 512 on the AMX Xeon capped to avx512, paired A/B
     * against blocks of 4, q / o projection: INT8 0.970 / 0.940, INT4 0.976 / 0.981 */
    c->gemm[CM_INT8][act].linear_block_panels = CM_PANELS_PER_BLOCK_MAX;
    c->gemm[CM_INT4][act].linear_block_panels = CM_PANELS_PER_BLOCK_MAX;
  }
}

/* vdpbf16ps for the bf16 GEMMs of blocks of few rows: there it streams the weights at least
 * as fast as the avx512 kernels (which widen each bf16 to fp32 first), and FP8 decodes to
 * bf16 with VBMI byte permutes. With more rows the avx512 kernels stay: vdpbf16ps occupies
 * the shuffle port for 2 cycles per instruction on the Xeon it was measured on, half the
 * MAC rate of fp32 FMAs (docs/PERFORMANCE-HISTORY.md). Only bf16 activations: the A
 * panels hold bf16 pairs. */
#define CM_BF16_PAIRS_MAX_ROWS 2
#define CM_FP8_PAIRS_MAX_ROWS 1
#define CM_MXFP4_PAIRS_MAX_ROWS 1
static void cm_config_init__avx512bf16(cm_tier_config *c) {
  with_decode(&c->gemm[CM_UNQUANT][CM_BF16], CM_BF16_PAIRS_MAX_ROWS, CM_PANEL_BF16_PAIRS)
      ->kernels.unquant.gemm_decode = cm_bf16_gemm_pairs_mrx32__avx512bf16;
  with_decode(&c->gemm[CM_FP8][CM_BF16], CM_FP8_PAIRS_MAX_ROWS, CM_PANEL_BF16_PAIRS)
      ->kernels.fp8.gemm_decode = cm_fp8_gemm_pairs_mrx32__avx512bf16;
  with_decode(&c->gemm[CM_MXFP4][CM_BF16], CM_MXFP4_PAIRS_MAX_ROWS, CM_PANEL_BF16_PAIRS)
      ->kernels.mxfp4.gemm_decode = cm_mxfp4_gemm_pairs_mrx32__avx512bf16;
}

/* AMX: tile GEMMs of CM_TILE_MR_AMX rows (two 16-row tiles). INT8 and INT4 run tdpbusd on the same
 * VNNI-4 weights, bf16 runs tdpbf16ps (its own numerics class, docs/NUMERICS.md), FP8 with bf16
 * activations decodes each chunk to bf16 once and runs tdpbf16ps on it. fp16 has no tile
 * instruction here and keeps the vector kernels. INT8 keeps the VNNI kernel for blocks of up to
 * CM_AMX_INT8_VECTOR_ROWS rows, where it is faster than a tile pass of 16 rows
 * (docs/PERFORMANCE-HISTORY.md). */
#define CM_AMX_INT8_VECTOR_ROWS 8
/* g's main kernels become tile kernels: panels of CM_TILE_MR_AMX rows in `format` */
static cm_gemm_config *on_tiles(cm_gemm_config *g, cm_panel_format format) {
  g->mr = CM_TILE_MR_AMX;
  g->a_format = format;
  return g;
}

static void cm_config_init__amx(cm_tier_config *c) {
  c->end_op = cm_amx_end_op__amx;
  c->probes.bf16 = cm_probe_bf16_loop__amx;
  c->probes.int8 = c->probes.int4 = cm_probe_int8_loop__amx; /* INT4 unpacks to s8 tiles */
  /* Blocks of 1 or 2 rows keep the parent's vdpbf16ps kernels: at decode (M = 1) they stream
   * the weights faster than the tile kernels (docs/PERFORMANCE-HISTORY.md). The two
   * round differently, so on this tier a token's bf16 bits can depend on how many rows its
   * experts got in the batch (docs/NUMERICS.md). */
  cm_gemm_config *bf16 = on_tiles(&c->gemm[CM_UNQUANT][CM_BF16], CM_PANEL_BF16_ROWS);
  bf16->kernels.unquant.gemm = cm_bf16_gemm_rows_mrx32__amx;
  /* An expert with 33-64 rows is a 32-row panel and a smaller one. Panel by panel, the first
   * call stages the weights as a one-panel block's does and each call keeps C in tiles over
   * the whole reduction: Qwen3 M=512 53.46/53.72 -> 51.40/51.68 ms. Blocks of 4 panels (the
   * dense linear at M=512) reuse each chunk from L1 better: 4.05 ms in chunks, 4.5 panel by
   * panel. INT8 stays in chunks: panel by panel took 31.18-31.52 against 30.29-30.68 ms at
   * M=512 (docs/PERFORMANCE-HISTORY.md, "Staged B tiles"). */
  bf16->panel_major_panels = 2;
  bf16->block_rows_max = CM_AMX_CALL_ROWS;
  /* The dense linear's blocks of 8 panels where 8 panels' A rows fit 1 MiB (Qwen3 q projection
   * M = 512, paired A/B against blocks of 4: bf16 0.89-0.92, INT8 0.97, INT4 0.96; o
   * projection INT8 0.90, INT4 0.97). FP8 too, since a K block of one chunk folds each panel
   * as soon as its tiles are done (0.96; 1.28 while the 8 panels' sums waited for one fold
   * pass and overflowed L1). */
  bf16->linear_block_panels = CM_PANELS_PER_BLOCK_MAX;
  cm_gemm_config *fp8_config = on_tiles(&c->gemm[CM_FP8][CM_BF16], CM_PANEL_BF16_ROWS);
  fp8_config->linear_block_panels = CM_PANELS_PER_BLOCK_MAX;
  cm_fp8_kernels *fp8 = &fp8_config->kernels.fp8;
  fp8->decode_chunk = cm_fp8_to_bf16__avx512bf16;
  fp8->gemm_chunk = cm_bf16_gemm_tiles_mrx32__amx; /* P: whole tiles (cm_fp8_kernels) */
  /* MXFP4 with bf16 activations: tdpbf16ps for every block, so a token's bits do not depend
   * on its batch; a block of one panel decodes group by group into tile buffers (the vector
   * kernels, with one fp32 chain per column, are bound by that chain's latency at decode),
   * a larger one decodes each chunk once for all its panels (avx512's decoder). */
  cm_gemm_config *mxfp4 = on_tiles(&c->gemm[CM_MXFP4][CM_BF16], CM_PANEL_BF16_ROWS);
  mxfp4->kernels.mxfp4.gemm_chunk = cm_bf16_gemm_rows_mrx32__amx;
  with_decode(mxfp4, CM_TILE_MR_AMX, CM_PANEL_BF16_ROWS)->kernels.mxfp4.gemm_decode =
      cm_mxfp4_gemm_rows_mrx32__amx;
  for (int act = 0; act < CM_ACT_DTYPE_COUNT; act++) {
    /* the parent's VNNI kernel and its panels become the decode path */
    cm_gemm_config *g = &c->gemm[CM_INT8][act];
    g->decode_a_format = g->a_format;
    g->kernels.int8.gemm_decode = g->kernels.int8.gemm;
    g->decode_max_rows = CM_AMX_INT8_VECTOR_ROWS;
    on_tiles(g, CM_PANEL_U8_ROWS)->kernels.int8.gemm = cm_u8s8_gemm_rows_mrx32__amx;
    g->block_rows_max = CM_AMX_CALL_ROWS; /* blocks of 33-48 rows in one call, as bf16's */
    g->linear_block_panels = CM_PANELS_PER_BLOCK_MAX;
    cm_gemm_config *int4 = on_tiles(&c->gemm[CM_INT4][act], CM_PANEL_U8_ROWS);
    int4->kernels.int4.gemm_u8s8 = cm_u8s8_gemm_rows_mrx32__amx;
    int4->linear_block_panels = CM_PANELS_PER_BLOCK_MAX;
  }
}

/* ---- the tier list (cpumoe/tiers.h) as tables ---- */

typedef struct cm_tier_row {
  const char *name, *parent, *numerics;
  uint64_t features; /* beyond the parent's */
  void (*init)(cm_tier_config *c);
} cm_tier_row;

static const cm_tier_row cm_tier_rows[CPUMOE_ISA_COUNT] = {
#define CM_TIER_ROW(ENUM, name, id, parent, numerics, flags, features) \
  [id] = {#name, #parent, numerics, features, cm_config_init__##name},
    CPUMOE_FOR_EACH_TIER(CM_TIER_ROW)
#undef CM_TIER_ROW
};

/* Tiers in rank order, worst first (the rows' order; ids need not follow it). */
static const cpumoe_isa cm_tier_rank[CPUMOE_ISA_COUNT] = {
#define CM_TIER_ID(ENUM, ...) CPUMOE_ISA_##ENUM,
    CPUMOE_FOR_EACH_TIER(CM_TIER_ID)
#undef CM_TIER_ID
};

static cpumoe_isa parent_of(cpumoe_isa isa) {
  return cpumoe_isa_from_name(cm_tier_rows[isa].parent);
}

typedef struct cm_dispatch_state {
  uint64_t features;
  unsigned native_mask; /* bit t: the CPU runs tier t itself */
  cpumoe_isa best;      /* best tier the CPU runs, or every tier in an emulating test build */
  cm_tier_config configs[CPUMOE_ISA_COUNT];
  char features_text[256];
  char feature_note[200]; /* why a feature the CPU has is not used ("" if none) */
} cm_dispatch_state;

static cm_dispatch_state cm_state;
static atomic_int cm_state_ready; /* 0: not probed, 1: probing, 2: ready */
static atomic_int cm_active = -1; /* active tier, -1 until chosen */
static char cm_reason[400];

static void build_state(cm_dispatch_state *st) {
  static const struct {
    uint64_t bit;
    const char *name;
  } feature_names[] = {
#define CM_FEATURE_NAME(id, name) {CM_FEATURE(id), name},
      CM_FOR_EACH_CPU_FEATURE(CM_FEATURE_NAME)
#undef CM_FEATURE_NAME
  };
  st->features = cm_detect_cpu_features(st->feature_note, sizeof st->feature_note);
  char *t = st->features_text;
  t[0] = '\0';
  for (size_t i = 0; i < sizeof feature_names / sizeof feature_names[0]; i++)
    if (st->features & feature_names[i].bit) {
      const size_t len = strlen(t);
      snprintf(t + len, sizeof st->features_text - len, "%s%s", len ? " " : "",
               feature_names[i].name);
    }
  /* rank order visits a parent before its children */
  for (int r = 0; r < CPUMOE_ISA_COUNT; r++) {
    const cpumoe_isa isa = cm_tier_rank[r], parent = parent_of(isa);
    const cm_tier_row *row = &cm_tier_rows[isa];
    const int parent_native = isa == parent || ((st->native_mask >> parent) & 1);
    if (parent_native && (st->features & row->features) == row->features) {
      st->native_mask |= 1u << isa;
      st->best = isa;
    }
    cm_tier_config *c = &st->configs[isa];
    if (isa != parent) *c = st->configs[parent];
    row->init(c);
    c->isa = isa;
    /* test builds check each row against what the pipeline and the packed layouts assume */
    CM_FOR_EACH_GEMM(c, g) {
      CM_EXPECT(g->nr == CM_NR && g->mr >= 1 && g->mr <= CM_MR_MAX);
      CM_EXPECT(g->kr == 2 || g->kr == 4);
      /* INT4's decode kernels run a block panel by panel, so any block may take them */
      CM_EXPECT(g->decode_max_rows <= g->mr ||
                (g - &c->gemm[0][0]) / CM_ACT_DTYPE_COUNT == CM_INT4);
      CM_EXPECT(g->block_rows_max == 0 || g->block_rows_max > g->mr);
      CM_EXPECT(g->a_format < CM_PANEL_FORMAT_COUNT && g->decode_a_format < CM_PANEL_FORMAT_COUNT);
    }
  }
#ifdef CPUMOE_EMULATE_TIERS
  st->best = cm_tier_rank[CPUMOE_ISA_COUNT - 1];
#endif
}

static const cm_dispatch_state *dispatch_state(void) {
  if (atomic_load(&cm_state_ready) == 2) return &cm_state;
  int expected = 0;
  if (atomic_compare_exchange_strong(&cm_state_ready, &expected, 1)) {
    build_state(&cm_state);
    atomic_store(&cm_state_ready, 2);
  } else {
    while (atomic_load(&cm_state_ready) != 2) {
    }
  }
  return &cm_state;
}

/* A tier the build can run: the CPU's own, or any in an emulating test build. */
static int supported(cpumoe_isa isa) {
#ifdef CPUMOE_EMULATE_TIERS
  (void)isa;
  return 1;
#else
  return cpumoe_isa_native(isa);
#endif
}

/* `cap` if it is supported, else its nearest supported ancestor. */
static cpumoe_isa capped(cpumoe_isa cap) {
  while (!supported(cap)) cap = parent_of(cap);
  return cap;
}

/* The reason, plus why a feature the CPU has is not used (AMX without the OS's permission). */
static void append_feature_note(void) {
  const char *note = dispatch_state()->feature_note;
  const size_t len = strlen(cm_reason);
  if (note[0]) snprintf(cm_reason + len, sizeof cm_reason - len, "; %s", note);
}

static cpumoe_isa choose_active(void) {
  const cpumoe_isa best = dispatch_state()->best;
  const char *best_name = cpumoe_isa_name(best);
  cpumoe_isa chosen = best;
  const char *env = getenv("CPUMOE_ISA");
  if (env && *env) {
    const cpumoe_isa cap = cpumoe_isa_from_name(env);
    if (cap == CPUMOE_ISA_COUNT) {
      snprintf(cm_reason, sizeof cm_reason,
               "%s (best supported; CPUMOE_ISA=%s is not a tier name, ignored)", best_name, env);
    } else if ((chosen = capped(cap)) != best) {
      snprintf(cm_reason, sizeof cm_reason, "%s (capped by CPUMOE_ISA=%s; best supported: %s)",
               cpumoe_isa_name(chosen), env, best_name);
    } else {
      snprintf(cm_reason, sizeof cm_reason, "%s (best supported; CPUMOE_ISA=%s allows it)",
               best_name, env);
    }
  } else {
    snprintf(cm_reason, sizeof cm_reason, "%s (best supported by this CPU)", best_name);
  }
  append_feature_note();
  return chosen;
}

cpumoe_isa cpumoe_active_isa(void) {
  int active = atomic_load(&cm_active);
  if (active < 0) {
    int expected = -1;
    const int chosen = (int)choose_active();
    if (!atomic_compare_exchange_strong(&cm_active, &expected, chosen)) return (cpumoe_isa)expected;
    active = chosen;
  }
  return (cpumoe_isa)active;
}

const cm_tier_config *cm_active_config(void) {
  return &dispatch_state()->configs[cpumoe_active_isa()];
}

cpumoe_isa cpumoe_best_supported_isa(void) {
  return dispatch_state()->best;
}

const char *cpumoe_isa_name(cpumoe_isa isa) {
  return (unsigned)isa < CPUMOE_ISA_COUNT ? cm_tier_rows[isa].name : "unknown";
}

cpumoe_isa cpumoe_isa_from_name(const char *name) {
  for (int i = 0; i < CPUMOE_ISA_COUNT; i++)
    if (name && strcmp(name, cm_tier_rows[i].name) == 0) return (cpumoe_isa)i;
  return CPUMOE_ISA_COUNT;
}

int cpumoe_isa_native(cpumoe_isa isa) {
  return (unsigned)isa < CPUMOE_ISA_COUNT && ((dispatch_state()->native_mask >> isa) & 1);
}

const char *cpumoe_isa_numerics(cpumoe_isa isa) {
  return (unsigned)isa < CPUMOE_ISA_COUNT ? cm_tier_rows[isa].numerics : NULL;
}

cpumoe_status cpumoe_set_isa_cap(cpumoe_isa isa) {
  if ((unsigned)isa >= CPUMOE_ISA_COUNT)
    return cm_fail(CPUMOE_EINVAL, "unknown ISA tier %d (expected 0..%d; see cpumoe_isa_name)",
                   (int)isa, CPUMOE_ISA_COUNT - 1);
  const cpumoe_isa best = cpumoe_best_supported_isa();
  const cpumoe_isa chosen = capped(isa);
  if (chosen != isa)
    snprintf(cm_reason, sizeof cm_reason, "%s (requested %s, which this CPU cannot run)",
             cpumoe_isa_name(chosen), cpumoe_isa_name(isa));
  else
    snprintf(cm_reason, sizeof cm_reason, "%s (set by cpumoe.set_isa; best supported: %s)",
             cpumoe_isa_name(chosen), cpumoe_isa_name(best));
  append_feature_note();
  atomic_store(&cm_active, (int)chosen);
  return CPUMOE_OK;
}

const char *cpumoe_isa_reason(void) {
  (void)cpumoe_active_isa();
  return cm_reason;
}

const char *cpumoe_cpu_features(void) {
  return dispatch_state()->features_text;
}

/* ---- probes: the active tier's loops, run once on every worker ---- */

typedef struct probe_job {
  const char *buffer;
  size_t bytes_per_worker;
  int64_t passes, iterations;
  double result[CM_MAX_WORKERS];
} probe_job;

static void probe_read_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  const cm_probe_kernels *probes = &cm_active_config()->probes;
  double s = 0;
  for (int64_t p = 0; p < job->passes; p++)
    s += probes->read(job->buffer + (size_t)w * job->bytes_per_worker, job->bytes_per_worker);
  job->result[w] = s;
}

static void probe_fma_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  job->result[w] = cm_active_config()->probes.fma(job->iterations);
}

static double run_probe(const cpumoe_runner *runner, cpumoe_worker_fn fn, probe_job *job) {
  const int64_t workers = cm_worker_count(runner, CM_MAX_WORKERS);
  if (job->buffer) job->bytes_per_worker = (job->bytes_per_worker / (size_t)workers) & ~(size_t)511;
  cm_run_workers(runner, workers, fn, job);
  double total = 0;
  for (int64_t w = 0; w < workers; w++) total += job->result[w];
  return total;
}

double cpumoe_probe_read(const void *buffer, size_t bytes, int64_t passes,
                         const cpumoe_runner *runner) {
  if (!buffer) return 0.0; /* nothing to read (run_probe takes a NULL buffer for "no buffer") */
  probe_job job = {.buffer = (const char *)buffer, .bytes_per_worker = bytes, .passes = passes};
  return run_probe(runner, probe_read_worker, &job);
}

static void probe_int8_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  job->result[w] = cm_active_config()->probes.int8(job->iterations);
}

static void probe_int4_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  job->result[w] = cm_active_config()->probes.int4(job->iterations);
}

static void probe_bf16_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  job->result[w] = cm_active_config()->probes.bf16(job->iterations);
}

double cpumoe_probe_bf16(int64_t iterations, const cpumoe_runner *runner) {
  probe_job job = {.iterations = iterations};
  return run_probe(runner, probe_bf16_worker, &job);
}

double cpumoe_probe_int8(int64_t iterations, const cpumoe_runner *runner) {
  probe_job job = {.iterations = iterations};
  return run_probe(runner, probe_int8_worker, &job);
}

double cpumoe_probe_int4(int64_t iterations, const cpumoe_runner *runner) {
  probe_job job = {.iterations = iterations};
  return run_probe(runner, probe_int4_worker, &job);
}

double cpumoe_probe_fma(int64_t iterations, const cpumoe_runner *runner) {
  probe_job job = {.iterations = iterations};
  return run_probe(runner, probe_fma_worker, &job);
}
