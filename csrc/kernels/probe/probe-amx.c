/*
 * Machine-limit probes for the benchmark's roofline, amx tier: the tile unit's peaks.
 *   bf16: tdpbf16ps on 4 independent C tiles (16 x 16 fp32 each) from 2 A and 2 B tiles
 *         held in the tile registers, the 2 x 2 blocking of the GEMM kernels
 *         (tiles/gemm-amx.c) without their loads: each instruction is 16 x 16 x 32 bf16
 *         products, counted as 2 ops each.
 *   int8: the same with tdpbusd (16 x 16 x 64 u8 x s8 products).
 * Four C tiles cover the dot products' latency (several times their issue interval). The
 * probe configures its tiles and releases them before it returns: it runs outside ops, on
 * its own.
 */
#include <immintrin.h>
#include <string.h>

#include "common/ukernels.h"

volatile double cm_probe_sink_amx;

typedef struct probe_tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} probe_tile_config;

static void configure_probe_tiles(void) {
  /* tiles a GEMM kernel left configured on this thread are released first, so that its
   * next call configures them again (the probe releases them when it ends) */
  cm_amx_end_op__amx();
  _Alignas(64) probe_tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

/* Small values whose dot products stay finite (bf16 1/64) or wrap harmlessly (int8). */
static void load_operands(uint16_t word) {
  _Alignas(64) uint16_t a[16 * 32];
  for (int i = 0; i < 16 * 32; i++) a[i] = word;
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, a, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

static void sink_tile(void) {
  _Alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  cm_probe_sink_amx = c[0];
  _tile_release();
}

/* `iterations` of the 2 x 2 blocking: C tiles 0..3 from A tiles 4, 5 and B tiles 6, 7; the
 * operations done, each instruction being 16 x 16 x k_per_dword products */
#define CM_PROBE_TILE_LOOP(DP, word, k_per_dword)                       \
  do {                                                                  \
    configure_probe_tiles();                                            \
    load_operands(word);                                                \
    for (int64_t it = 0; it < iterations; it++) {                       \
      DP(0, 4, 6);                                                      \
      DP(1, 4, 7);                                                      \
      DP(2, 5, 6);                                                      \
      DP(3, 5, 7);                                                      \
    }                                                                   \
    sink_tile();                                                        \
    return (double)iterations * 4.0 * 16 * 16 * 16 * (k_per_dword) * 2; \
  } while (0)

double cm_probe_bf16_loop__amx(int64_t iterations) {
  CM_PROBE_TILE_LOOP(_tile_dpbf16ps, 0x3c80 /* bf16 2^-6 */, 2);
}

double cm_probe_int8_loop__amx(int64_t iterations) {
  CM_PROBE_TILE_LOOP(_tile_dpbusd, 0x0101, 4);
}
