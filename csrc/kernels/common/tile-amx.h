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

/* Loads the tile configuration on the calling thread unless it holds it already (defined in
 * tiles/gemm-amx.c, whose cm_amx_end_op__amx releases it). */
void cm_amx_configure_tiles__amx(void);

/* C tiles from c (row stride 32 floats or ints) or zero. Whole 16-row tiles are loaded and
 * stored: a caller whose c holds only mr rows goes through a buffer of full size
 * (tiles/gemm-amx.c). */
#define CM_AMX_C_STRIDE (CM_NR * 4)

static inline
    __attribute__((always_inline)) void cm_amx_load_c(int two, const void *c, int accumulate) {
  if (!accumulate) {
    _tile_zero(TC00);
    _tile_zero(TC01);
    if (two) {
      _tile_zero(TC10);
      _tile_zero(TC11);
    }
    return;
  }
  const char *p = (const char *)c;
  _tile_loadd(TC00, p, CM_AMX_C_STRIDE);
  _tile_loadd(TC01, p + 64, CM_AMX_C_STRIDE);
  if (two) {
    _tile_loadd(TC10, p + 16 * CM_AMX_C_STRIDE, CM_AMX_C_STRIDE);
    _tile_loadd(TC11, p + 16 * CM_AMX_C_STRIDE + 64, CM_AMX_C_STRIDE);
  }
}

static inline __attribute__((always_inline)) void cm_amx_store_c(int two, void *c) {
  char *p = (char *)c;
  _tile_stored(TC00, p, CM_AMX_C_STRIDE);
  _tile_stored(TC01, p + 64, CM_AMX_C_STRIDE);
  if (two) {
    _tile_stored(TC10, p + 16 * CM_AMX_C_STRIDE, CM_AMX_C_STRIDE);
    _tile_stored(TC11, p + 16 * CM_AMX_C_STRIDE + 64, CM_AMX_C_STRIDE);
  }
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

#endif /* CPUMOE_COMMON_TILE_AMX_H */
