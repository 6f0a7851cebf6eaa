/*
 * What the amx tier's tile kernels share (tiles/gemm-amx.c, schemes/mxfp4/gemm-amx.c): the
 * tile numbering of their one configuration, the per-thread configuration itself (loaded at
 * a worker's first tile kernel of an op, released by the tier's end_op), and C's way in and
 * out of the accumulator tiles. Include only from files compiled with the amx tier's flags.
 *
 * Tiles (every one 16 rows x 64 bytes):
 *   0..3  C: rows 0..15 / 16..31 x columns 0..15 / 16..31
 *   4, 5  A: rows 0..15, 16..31
 *   6, 7  B: columns 0..15, 16..31
 * A call of 33 to 48 rows (three rows of tiles) uses them otherwise, from the same
 * configuration:
 *   0..5  C: rows 0..15 / 16..31 / 32..47 x columns 0..15 / 16..31
 *   6     A: the row of tiles being multiplied (each loaded once per k step)
 *   7     B: the column half being multiplied
 */
#ifndef CPUMOE_COMMON_TILE_AMX_H
#define CPUMOE_COMMON_TILE_AMX_H

#include <immintrin.h>

#include "common/ukernels.h"

#define CM_AMX_TILE_ROWS 16
#define CM_AMX_TILE_BYTES 64   /* bytes per tile row */
#define CM_AMX_B_ROW_BYTES 128 /* bytes per k-row of a packed 32-column block */

/* tile numbers: macros, not an enum, since the intrinsics paste them into the asm */
#define TC00 0
#define TC01 1
#define TC10 2
#define TC11 3
#define TA0 4
#define TA1 5
#define TB0 6
#define TB1 7

/* tile numbers of a three-row call (above) */
#define T3C20 4
#define T3C21 5
#define T3A 6
#define T3B 7

/* Loads the tile configuration on the calling thread unless it holds it already (defined in
 * tiles/gemm-amx.c, whose cm_amx_end_op__amx releases it). */
void cm_amx_configure_tiles__amx(void);

/* C tiles from c (row stride 32 floats or ints) or zero. Whole 16-row tiles are loaded and
 * stored: a caller whose c holds only mr rows goes through a buffer of full size
 * (tiles/gemm-amx.c). */
#define CM_AMX_C_STRIDE (CM_NR * 4)

/* One row of C tiles, t0 (columns 0..15) and t1 (16..31), from c's 16 rows at p or zero, and
 * back (tile numbers are literals: macros) */
#define CM_AMX_LOAD_C_ROW(t0, t1, p, accumulate)                \
  do {                                                          \
    if (accumulate) {                                           \
      _tile_loadd(t0, (p), CM_AMX_C_STRIDE);                    \
      _tile_loadd(t1, (const char *)(p) + 64, CM_AMX_C_STRIDE); \
    } else {                                                    \
      _tile_zero(t0);                                           \
      _tile_zero(t1);                                           \
    }                                                           \
  } while (0)
#define CM_AMX_STORE_C_ROW(t0, t1, p)                    \
  do {                                                   \
    _tile_stored(t0, (p), CM_AMX_C_STRIDE);              \
    _tile_stored(t1, (char *)(p) + 64, CM_AMX_C_STRIDE); \
  } while (0)

/* C's tile_rows rows of tiles (1 to 3; the third as a three-row call numbers them) */
static inline __attribute__((always_inline)) void cm_amx_load_c(int tile_rows, const void *c,
                                                                int accumulate) {
  const char *p = (const char *)c;
  CM_AMX_LOAD_C_ROW(TC00, TC01, p, accumulate);
  if (tile_rows > 1) CM_AMX_LOAD_C_ROW(TC10, TC11, p + 16 * CM_AMX_C_STRIDE, accumulate);
  if (tile_rows > 2) CM_AMX_LOAD_C_ROW(T3C20, T3C21, p + 32 * CM_AMX_C_STRIDE, accumulate);
}

static inline __attribute__((always_inline)) void cm_amx_store_c(int tile_rows, void *c) {
  char *p = (char *)c;
  CM_AMX_STORE_C_ROW(TC00, TC01, p);
  if (tile_rows > 1) CM_AMX_STORE_C_ROW(TC10, TC11, p + 16 * CM_AMX_C_STRIDE);
  if (tile_rows > 2) CM_AMX_STORE_C_ROW(T3C20, T3C21, p + 32 * CM_AMX_C_STRIDE);
}

/* One k step: A rows at a (stride a_bytes), B k-rows at b (stride b_bytes). */
#define CM_AMX_STEP(DP, two, a, a_bytes, b, b_bytes)                    \
  do {                                                                  \
    _tile_loadd(TB0, (b), (b_bytes));                                   \
    _tile_loadd(TB1, (const char *)(b) + CM_AMX_TILE_BYTES, (b_bytes)); \
    _tile_loadd(TA0, (a), (a_bytes));                                   \
    DP(TC00, TA0, TB0);                                                 \
    DP(TC01, TA0, TB1);                                                 \
    if (two) {                                                          \
      _tile_loadd(TA1, (const char *)(a) + 16 * (a_bytes), (a_bytes));  \
      DP(TC10, TA1, TB0);                                               \
      DP(TC11, TA1, TB1);                                               \
    }                                                                   \
  } while (0)

/* One k step of a three-row call, with one A and one B register: each row of A tiles is
 * loaded once and multiplied by the column half already in the B register, then by the
 * other half, so the halves alternate from row to row (B0 B1 | B1 B0 | B0 B1). That is 3 A
 * loads from the panel (in L2) and 4 B loads from the staged step (in L1), where taking
 * the column halves one after the other reloads each A tile: 6 A loads and 2 B. Each C
 * tile still gets one product per k step, so the sums are the same. */
#define CM_AMX_STEP3(DP, a, a_bytes, b, b_bytes)                     \
  do {                                                               \
    const char *b1_ = (const char *)(b) + CM_AMX_TILE_BYTES;         \
    _tile_loadd(T3A, (a), (a_bytes));                                \
    _tile_loadd(T3B, (b), (b_bytes));                                \
    DP(TC00, T3A, T3B);                                              \
    _tile_loadd(T3B, b1_, (b_bytes));                                \
    DP(TC01, T3A, T3B);                                              \
    _tile_loadd(T3A, (const char *)(a) + 16 * (a_bytes), (a_bytes)); \
    DP(TC11, T3A, T3B);                                              \
    _tile_loadd(T3B, (b), (b_bytes));                                \
    DP(TC10, T3A, T3B);                                              \
    _tile_loadd(T3A, (const char *)(a) + 32 * (a_bytes), (a_bytes)); \
    DP(T3C20, T3A, T3B);                                             \
    _tile_loadd(T3B, b1_, (b_bytes));                                \
    DP(T3C21, T3A, T3B);                                             \
  } while (0)

#endif /* CPUMOE_COMMON_TILE_AMX_H */
