/*
 * AMX tile GEMMs, shared by the schemes of the amx tier (config: dispatch/config.c).
 *
 *   bf16:  C[mr][32] (+)= A x B   fp32; A bf16 [mr][a_stride] rows (BF16_ROWS panels),
 *          B bf16 VNNI-2 [k/2][32][2] (a packed weight tile, or FP8 decoded to bf16).
 *   u8s8:  acc[mr][32] (+)= A x B int32; A u8 [mr][a_stride] rows (U8_ROWS panels, q + 128),
 *          B s8 VNNI-4 [kc/4][32][4] (a packed INT8 tile, or INT4 unpacked).
 *   mr <= CM_AMX_CALL_ROWS (48) for the `rows` kernels, CM_MR_MAX (32) for
 *   cm_bf16_gemm_tiles. C and acc have row stride 32. C goes through a bounce buffer unless
 *   mr is 16, 32 or 48, so that rows past mr are not written; acc (cm_gemm_u8s8_fn: room for
 *   CM_MR_MAX rows, CM_AMX_CALL_ROWS above that) and the C of cm_bf16_gemm_tiles (FP8's sums,
 *   cm_fp8_kernels; room for CM_MR_MAX rows) take whole tiles. The bounce's copies had 3 %
 *   of INT4 M = 512's samples (Qwen3, 2 threads); without them FP8 M = 512 took 0.94-0.96x
 *   the time, with its one-scale K blocks (schemes/fp8/scheme.c).
 *
 * The packed weights are already B tiles: a k-row of a 32-column block (a k pair in VNNI-2,
 * a k quad in VNNI-4) is 128 bytes, so one tile load with stride 128 takes columns 0..15
 * (16 k-rows x 64 bytes) and another at +64 bytes columns 16..31. A panel's rows one after
 * another are A tiles (16 rows x 64 bytes at stride a_stride elements).
 *
 * Tiles, one configuration for both kernels and the tier's MXFP4 kernel (common/tile-amx.h):
 * 4 C, 2 A (rows 0..15, 16..31), 2 B (columns 0..15, 16..31). 2 A + 2 B loads feed 4 dot
 * products per k step (32 k of bf16, 64 k of u8): the 2 x 2 register blocking that fits 8
 * tiles. A panel of up to 16 rows skips the second row of tiles.
 *
 * 33 to 48 rows (the two panels of a block taken in one call, cm_gemm_config.block_rows_max)
 * are three rows of tiles: 6 C, one A and one B register (common/tile-amx.h), each A tile
 * loaded once per k step and the B halves reloaded instead (from the staged step in L1), 6
 * products per k step. Such a call replaces a 32-row call that streams the weights and a
 * second one that rereads them from L2 with nothing streaming meanwhile. Its next step's copy
 * goes before the step's tile work, not after: one thread streaming 32-column blocks of
 * K = 2048 from DRAM with 40 rows, 285 against 302 ns per 4 KiB (32 rows: 245-257 either
 * way, so they keep the copy after); copying it in halves between the column halves took
 * 328. Bf16 Qwen3 M = 512: 0.957x the time of the two calls while the step loaded each A
 * tile twice, 0.93-0.96x more since it loads it once (docs/PERFORMANCE-HISTORY.md, "Two
 * panels in one call", "Three-row steps load each A tile once"). The u8s8 kernel has the
 * same step for INT8's blocks of 33-48 rows: INT8 M = 512 0.944-0.995x the time of the chunk
 * path ("Shorter read-ahead"; before the staged copy read 3 KiB ahead, 0.99-1.01x). FP8's
 * chunk kernel (cm_bf16_gemm_tiles), which never takes more than 32 rows, leaves it out:
 * compiled in, it made the dense FP8 linear 1.05-1.11x slower.
 *
 * Tile loads read whole 16-row tiles: rows past mr come from the next panel or the A region's
 * slack (CM_PANEL_SLACK_ROWS) and make C rows that are never stored. A reduction that is not a
 * whole number of k steps ends with one step on zero-padded copies of its tail.
 *
 * Each worker loads the configuration at its first tile kernel of an op and releases the
 * tiles when the op ends (cm_amx_end_op, the tier's end_op): ldtilecfg costs as much as a
 * few dot products, and a thread holding tiles makes every context switch save 8 KiB.
 *
 * Numerics: integer sums are exact, so u8s8 gives every tier's bits. tdpbf16ps sums each
 * k step's 16 pairs as two fp32 chains (even and odd elements) and adds their sum to C:
 * the amx-bf16 numerics class (docs/NUMERICS.md).
 */
#include <immintrin.h>
#include <string.h>

#include "common/tile-amx.h"
#include "common/ukernels.h"

/* A call that streams its own weights (CM_PREFETCH_SELF, a block of one panel) stages them:
 * each k step's B rows (2 KiB) are copied by vector loads into a buffer in L1 one step ahead,
 * and the tile loads read that buffer. Tile loads straight from the stream miss L1 and stall
 * the tile unit however far ahead they are prefetched; vector loads keep many misses in flight
 * as the decode kernels' do. Two threads streaming 32-column blocks of K = 2048 from DRAM
 * (huge pages, 32-row panels, gate and up blocks alternating as in the op): 25.5-26.1 GB/s
 * with tile loads from the stream, 31.4-32.9 GB/s staged, as fast as a plain read loop
 * (docs/PERFORMANCE-HISTORY.md, "Staged B tiles"). The copy reads ahead into L2 on its own,
 * 3 KiB past each line it copies: the same two threads at 32 rows 15.2-16.3 GB/s each against
 * 14.4-15.3 at 8 KiB, at 40 rows 14.5-15.2 against 13.4-14.2 (4 KiB no better than 8, 2 KiB
 * worse); Qwen3 M = 512 bf16 0.94x the time, INT8 0.96-0.98x ("Shorter read-ahead"). */
#define CM_AMX_STAGE_PF_BYTES 3072

typedef struct cm_amx_tile_config {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} cm_amx_tile_config;

/* Every tile 16 rows x 64 bytes. A constant in memory, not a local filled before the
 * load: GCC 12 does not see that ldtilecfg reads the local's rows and colsb and drops those
 * stores once the function is not inlined (the tiles then stay unconfigured: #UD). */
#define CM_AMX_8(v) v, v, v, v, v, v, v, v
static const cm_amx_tile_config cm_amx_config __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {CM_AMX_8(CM_AMX_TILE_BYTES)},
    .rows = {CM_AMX_8(CM_AMX_TILE_ROWS)},
};

static _Thread_local int cm_amx_configured;

void cm_amx_configure_tiles__amx(void) {
  if (cm_amx_configured) return;
  _tile_loadconfig(&cm_amx_config);
  cm_amx_configured = 1;
}

void cm_amx_end_op__amx(void) {
  if (!cm_amx_configured) return;
  _tile_release();
  cm_amx_configured = 0;
}

/* The last, partial k step: its `tail` bytes of each A row and its b_rows k-rows of B,
 * copied into zeroed full tiles (zero products leave the sums as they are). */
typedef struct tail_tiles {
  _Alignas(64) uint8_t a[3 * CM_AMX_TILE_ROWS][CM_AMX_TILE_BYTES];
  _Alignas(64) uint8_t b[CM_AMX_TILE_ROWS][CM_AMX_B_ROW_BYTES];
} tail_tiles;

static void fill_tail(tail_tiles *t, size_t mr, const uint8_t *a, size_t a_bytes, size_t tail,
                      const uint8_t *b, size_t b_rows) {
  memset(t, 0, sizeof *t);
  for (size_t i = 0; i < mr; i++) memcpy(t->a[i], a + i * a_bytes, tail);
  memcpy(t->b, b, b_rows * CM_AMX_B_ROW_BYTES);
}

/* Bytes of B per k step, for both kernels: 16 k-rows of 128 bytes (32 k of bf16 pairs, 64 k
 * of u8 quads). */
#define CM_AMX_STEP_B_BYTES (CM_AMX_TILE_ROWS * CM_AMX_B_ROW_BYTES)

/* Copies one k step of B from the stream into a staging buffer, reading ahead into L2. */
static inline __attribute__((always_inline)) void stage_b(uint8_t *restrict dst,
                                                          const uint8_t *restrict b) {
  for (int l = 0; l < CM_AMX_STEP_B_BYTES / 64; l++) {
    _mm_prefetch((const char *)b + CM_AMX_STAGE_PF_BYTES + 64 * l, _MM_HINT_T1);
    _mm512_store_si512(dst + 64 * l, _mm512_loadu_si512(b + 64 * l));
  }
}

/* A row's bytes per k step: 32 bf16 or 64 u8 = one 64-byte tile row. */
#define CM_AMX_STEP_K_BF16 32
#define CM_AMX_STEP_K_U8 64

/* One k step over the call's rows of tiles: three (CM_AMX_STEP3), else one or two. */
#define CM_AMX_ROWS_STEP(DP, two, three, a, a_bytes, b)        \
  do {                                                         \
    if (three)                                                 \
      CM_AMX_STEP3(DP, a, a_bytes, b, CM_AMX_B_ROW_BYTES);     \
    else                                                       \
      CM_AMX_STEP(DP, two, a, a_bytes, b, CM_AMX_B_ROW_BYTES); \
  } while (0)

#define CM_AMX_GEMM_BODY(DP, elem_bytes, k_per_b_row, step_k, whole_tiles, max_rows)             \
  do {                                                                                           \
    const int two = mr > CM_AMX_TILE_ROWS;                                                       \
    const int three = (max_rows) > 2 * CM_AMX_TILE_ROWS && mr > 2 * CM_AMX_TILE_ROWS;            \
    const size_t a_bytes = a_stride * (elem_bytes);                                              \
    const size_t steps = k / (step_k), tail_k = k % (step_k);                                    \
    const uint8_t *a8 = (const uint8_t *)a, *b8 = (const uint8_t *)b;                            \
    _Alignas(64) int32_t bounce[(max_rows) * CM_NR];                                             \
    void *cc = whole_tiles || mr % CM_AMX_TILE_ROWS == 0 ? (void *)c : bounce;                   \
    if (cc != (void *)c && accumulate) memcpy(bounce, c, mr * CM_NR * 4);                        \
    _Alignas(64) uint8_t staged[2][CM_AMX_STEP_B_BYTES];                                         \
    const int stage = !prefetch.start; /* CM_PREFETCH_SELF: this call streams its own B */       \
    cm_amx_configure_tiles__amx();                                                               \
    cm_amx_load_c(1 + two + three, cc, accumulate);                                              \
    if (stage && steps) stage_b(staged[0], b8);                                                  \
    for (size_t s = 0; s < steps; s++) {                                                         \
      const uint8_t *bs = stage ? staged[s & 1] : b8 + s * CM_AMX_STEP_B_BYTES;                  \
      if (!stage) cm_prefetch_step(&pf, pf_steps);                                               \
      const int copy_next = stage && s + 1 < steps;                                              \
      /* three rows of tiles: the next step's copy first (see the header) */                     \
      if (three && copy_next) stage_b(staged[(s + 1) & 1], b8 + (s + 1) * CM_AMX_STEP_B_BYTES);  \
      CM_AMX_ROWS_STEP(DP, two, three, a8 + s * CM_AMX_TILE_BYTES, a_bytes, bs);                 \
      if (!three && copy_next) stage_b(staged[(s + 1) & 1], b8 + (s + 1) * CM_AMX_STEP_B_BYTES); \
    }                                                                                            \
    if (tail_k) {                                                                                \
      tail_tiles t;                                                                              \
      fill_tail(&t, mr, a8 + steps * CM_AMX_TILE_BYTES, a_bytes, tail_k * (elem_bytes),          \
                b8 + steps * CM_AMX_STEP_B_BYTES, tail_k / (k_per_b_row));                       \
      CM_AMX_ROWS_STEP(DP, two, three, t.a, CM_AMX_TILE_BYTES, t.b);                             \
    }                                                                                            \
    cm_amx_store_c(1 + two + three, cc);                                                         \
    if (cc != (void *)c) memcpy(c, bounce, mr * CM_NR * 4);                                      \
  } while (0)

/* whole_tiles: C has room for CM_MR_MAX rows (see the header); up to CM_AMX_CALL_ROWS rows
 * otherwise, CM_MR_MAX with whole tiles (FP8's chunk calls, one panel each) */
static inline __attribute__((always_inline)) void bf16_gemm(const int whole_tiles, size_t mr,
                                                            size_t k, const void *a,
                                                            size_t a_stride, const void *b,
                                                            float *c, int accumulate,
                                                            cm_prefetch prefetch) {
  CM_EXPECT(mr >= 1 && mr <= (whole_tiles ? CM_MR_MAX : CM_AMX_CALL_ROWS) && k % 2 == 0 &&
            a_stride >= k);
  cm_prefetch_cursor pf = cm_prefetch_begin(prefetch);
  const size_t pf_steps = k / CM_AMX_STEP_K_BF16 ? k / CM_AMX_STEP_K_BF16 : 1;
  CM_AMX_GEMM_BODY(_tile_dpbf16ps, 2, 2, CM_AMX_STEP_K_BF16, whole_tiles,
                   whole_tiles ? CM_MR_MAX : CM_AMX_CALL_ROWS);
  if (prefetch.start) cm_prefetch_finish(&pf);
}

void cm_bf16_gemm_rows_mrx32__amx(size_t mr, size_t k, const void *a, size_t a_stride,
                                  const void *b, float *c, int accumulate, cm_prefetch prefetch) {
  bf16_gemm(0, mr, k, a, a_stride, b, c, accumulate, prefetch);
}

void cm_bf16_gemm_tiles_mrx32__amx(size_t mr, size_t k, const void *a, size_t a_stride,
                                   const void *b, float *c, int accumulate, cm_prefetch prefetch) {
  bf16_gemm(1, mr, k, a, a_stride, b, c, accumulate, prefetch);
}

void cm_u8s8_gemm_rows_mrx32__amx(size_t mr, size_t kc, const uint8_t *a, size_t a_stride,
                                  const int8_t *b, int32_t *acc, int accumulate,
                                  cm_prefetch prefetch) {
  CM_EXPECT(mr >= 1 && mr <= CM_AMX_CALL_ROWS && kc % 4 == 0 && a_stride >= kc);
  const size_t k = kc;
  int32_t *c = acc;
  cm_prefetch_cursor pf = cm_prefetch_begin(prefetch);
  const size_t pf_steps = kc / CM_AMX_STEP_K_U8 ? kc / CM_AMX_STEP_K_U8 : 1;
  CM_AMX_GEMM_BODY(_tile_dpbusd, 1, 4, CM_AMX_STEP_K_U8, 1, CM_AMX_CALL_ROWS);
  if (prefetch.start) cm_prefetch_finish(&pf);
}
