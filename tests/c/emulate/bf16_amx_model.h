/*
 * Exact models, in plain C11, of the bf16 and AMX instructions an avx512bf16 or amx tier would
 * use: vdpbf16ps (one fp32 lane), vcvtne2ps2bf16 / vcvtneps2bf16 (one element), and the AMX
 * tile unit of palette 1 (ldtilecfg, sttilecfg, tileloadd, tilestored, tilezero, tilerelease,
 * tdpbf16ps, tdpbssd / tdpbsud / tdpbusd / tdpbuud).
 *
 * Two users: the emulating build (tests/c/emulate/immintrin.h and amx.h put these under the
 * Intel intrinsic names, so a tier's kernels run on any x86-64 CPU), and
 * tests/c/emulate/test_bf16_amx_conformance.c, which holds them bit for bit against the
 * instructions where the CPU has them. Each model follows the Operation section of the
 * instruction's SDM entry; what the silicon was measured to do is in docs/NUMERICS.md
 * ("bf16 dot products and AMX on silicon"), and where the two part this file says so.
 *
 * No intrinsics and no vector types: values travel as bit patterns (uint32_t for fp32,
 * uint16_t for bf16), so nothing depends on the host's MXCSR but the default rounding mode
 * (round to nearest even), which fmaf uses.
 *
 * The tile unit is one state per thread and per translation unit (static _Thread_local): the
 * hardware keeps one per thread, and a kernel configures and uses its tiles in one file.
 * A tile instruction that would fault on hardware (#GP from ldtilecfg, #UD from a tile
 * instruction with tiles unconfigured or shapes that do not fit) calls CM_AMX_FAULT(message),
 * by default: print the message and abort, so that a test that drives the model wrongly fails
 * loudly instead of computing something the hardware never would. A test may define
 * CM_AMX_FAULT before including this file (it must not return).
 */
#ifndef CPUMOE_TESTS_EMULATE_BF16_AMX_MODEL_H
#define CPUMOE_TESTS_EMULATE_BF16_AMX_MODEL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/numeric.h" /* cm_f32_bits, cm_f32_from_bits */

#ifndef CM_AMX_FAULT
#define CM_AMX_FAULT(message) cm_model_fault(message)
_Noreturn static inline void cm_model_fault(const char *message) {
  fprintf(stderr, "amx model: %s (this faults on hardware)\n", message);
  abort();
}
#endif

/* ---- fp32 steps as the bf16 instructions do them ---------------------------------------- */

static inline int cm_is_nan_bits(uint32_t x) {
  return (x & 0x7fffffffu) > 0x7f800000u;
}

/* DAZ: a denormal input counts as the zero of its sign */
static inline float cm_daz(uint32_t x) {
  return cm_f32_from_bits((x & 0x7f800000u) ? x : x & 0x80000000u);
}

/* The NaN an invalid operation (inf * 0, inf - inf) makes: x86's "real indefinite". */
#define CM_DEFAULT_NAN 0xffc00000u
/* An input NaN comes out quieted, payload kept. */
#define CM_QUIET(x) ((x) | 0x00400000u)

/* FTZ of c + a * b, whose value fmaf rounded to r. x86 detects tininess after rounding: the
 * result is flushed when, rounded to 24 bits with an unbounded exponent, it is below 2^-126.
 * fmaf rounds into the denormal grid instead, which differs in one place: an exact value in
 * [2^-126 - 2^-150, 2^-126 - 2^-151) gives FLT_MIN from fmaf but is tiny after rounding. There
 * the exact value decides, as s + e (TwoSum in double; a * b is exact in double, since one
 * factor has at most 8 significant bits and the other at most 24). */
static inline uint32_t cm_ftz(float r, float a, float b, float c) {
  const uint32_t bits = cm_f32_bits(r), mag = bits & 0x7fffffffu;
  if (mag == 0 || mag > 0x00800000u) return bits;
  if (mag < 0x00800000u) return bits & 0x80000000u;
  const double p = (double)a * (double)b, s = p + (double)c, bp = s - (double)c;
  const double e = (p - bp) + ((double)c - (s - bp));
  const double sign = s < 0 ? -1.0 : 1.0;
  /* |s + e| < 2^-126 - 2^-151; |s| - threshold is exact (Sterbenz: both near 2^-126) */
  const double d = fabs(s) - (0x1p-126 - 0x1p-151);
  return d < -sign * e ? bits & 0x80000000u : bits;
}

/* One fused step acc + x * y: DAZ on all three inputs, one rounding (RNE), FTZ. NaNs: x's,
 * else y's, else acc's, quieted; an invalid operation gives the default NaN. */
static inline uint32_t cm_fma_step(uint32_t acc, uint32_t x, uint32_t y) {
  if (cm_is_nan_bits(x)) return CM_QUIET(x);
  if (cm_is_nan_bits(y)) return CM_QUIET(y);
  if (cm_is_nan_bits(acc)) return CM_QUIET(acc);
  const float a = cm_daz(x), b = cm_daz(y), c = cm_daz(acc);
  const float r = fmaf(a, b, c);
  if (isnan(r)) return CM_DEFAULT_NAN;
  return cm_ftz(r, a, b, c);
}

/* x + y with DAZ, RNE, FTZ; NaN priority x, then y */
static inline uint32_t cm_add_step(uint32_t x, uint32_t y) {
  if (cm_is_nan_bits(x)) return CM_QUIET(x);
  if (cm_is_nan_bits(y)) return CM_QUIET(y);
  return cm_fma_step(y, x, 0x3f800000u /* 1.0f */);
}

/* make_fp32: a bf16 is the upper half of an fp32 */
static inline uint32_t cm_bf16_widen(uint16_t h) {
  return (uint32_t)h << 16;
}

/* ---- vdpbf16ps: one fp32 lane -------------------------------------------------------------
 * acc + a.bf16[1] * b.bf16[1], then + a.bf16[0] * b.bf16[0]: the odd pair first, as the SDM's
 * Operation has it, each step one fused rounding with DAZ in and FTZ out. a_pair and b_pair
 * hold the element pair as in memory (element 0 in the low 16 bits). Stepping the odd pair
 * first gives exactly the SDM's NaN priorities (a low, b low, a high, b high, acc). */
static inline uint32_t cm_dpbf16_lane(uint32_t acc, uint32_t a_pair, uint32_t b_pair) {
  acc = cm_fma_step(acc, a_pair & 0xffff0000u, b_pair & 0xffff0000u);
  return cm_fma_step(acc, a_pair << 16, b_pair << 16);
}

/* ---- vcvtneps2bf16, one element: the SDM's convert_fp32_to_bfloat16 ----------------------- */
static inline uint16_t cm_cvtne_f32_bf16(uint32_t x) {
  if ((x & 0x7f800000u) == 0) return (uint16_t)((x >> 16) & 0x8000u); /* zero or denormal */
  if ((x & 0x7f800000u) == 0x7f800000u) {                             /* inf, NaN (quieted) */
    return (uint16_t)((x >> 16) | ((x & 0x007fffffu) ? 0x0040u : 0));
  }
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16); /* RNE by an integer add */
}

/* ---- the AMX tile unit, palette 1 --------------------------------------------------------- */

enum { CM_AMX_TILES = 8, CM_AMX_MAX_ROWS = 16, CM_AMX_BYTES_PER_ROW = 64 };

struct cm_amx_unit {
  int configured; /* TILES_CONFIGURED */
  uint8_t palette, start_row;
  uint16_t colsb[CM_AMX_TILES];
  uint8_t rows[CM_AMX_TILES];
  uint8_t data[CM_AMX_TILES][CM_AMX_MAX_ROWS][CM_AMX_BYTES_PER_ROW];
};
/* One unit per thread for the whole program, as the hardware's tile state: every translation
 * unit that includes this header (each amx kernel file) defines it weak, and the linker keeps
 * one. (A static one per file would leave the tiles that one file configured unconfigured
 * for the kernels of another.) */
__attribute__((weak)) _Thread_local struct cm_amx_unit cm_amx;

/* ldtilecfg: the SDM's checks, all before anything changes (a #GP leaves the state as it
 * was). Palette 0 is the INIT state: unconfigured, tiles zero. */
static inline void cm_amx_ldtilecfg(const void *config) {
  uint8_t buf[64];
  memcpy(buf, config, sizeof buf);
  if (buf[0] > 1) CM_AMX_FAULT("ldtilecfg: palette > 1");
  if (buf[0] == 0) {
    memset(&cm_amx, 0, sizeof cm_amx);
    return;
  }
  for (int i = 2; i < 16; i++)
    if (buf[i]) CM_AMX_FAULT("ldtilecfg: reserved bytes 2-15 not zero");
  for (int i = 16 + 2 * CM_AMX_TILES; i < 48; i++)
    if (buf[i]) CM_AMX_FAULT("ldtilecfg: colsb of a tile beyond tmm7 not zero");
  for (int i = 48 + CM_AMX_TILES; i < 64; i++)
    if (buf[i]) CM_AMX_FAULT("ldtilecfg: rows of a tile beyond tmm7 not zero");
  uint16_t colsb[CM_AMX_TILES];
  for (int t = 0; t < CM_AMX_TILES; t++) {
    colsb[t] = (uint16_t)(buf[16 + 2 * t] | buf[17 + 2 * t] << 8);
    const uint8_t rows = buf[48 + t];
    if (colsb[t] > CM_AMX_BYTES_PER_ROW) CM_AMX_FAULT("ldtilecfg: colsb > 64");
    if (rows > CM_AMX_MAX_ROWS) CM_AMX_FAULT("ldtilecfg: rows > 16");
    if ((rows == 0) != (colsb[t] == 0)) CM_AMX_FAULT("ldtilecfg: one of rows, colsb zero");
  }
  /* start_row resumes an interrupted tileloadd/tilestored; kernels never set it, and a model
   * that ignored it would compute something else than the hardware */
  if (buf[1]) CM_AMX_FAULT("ldtilecfg: start_row != 0 (the model does not resume)");
  memset(&cm_amx, 0, sizeof cm_amx);
  cm_amx.configured = 1;
  cm_amx.palette = 1;
  memcpy(cm_amx.colsb, colsb, sizeof colsb);
  memcpy(cm_amx.rows, buf + 48, CM_AMX_TILES);
}

static inline void cm_amx_sttilecfg(void *config) {
  uint8_t buf[64] = {0};
  if (cm_amx.configured) {
    buf[0] = cm_amx.palette;
    buf[1] = cm_amx.start_row;
    for (int t = 0; t < CM_AMX_TILES; t++) {
      buf[16 + 2 * t] = (uint8_t)cm_amx.colsb[t];
      buf[17 + 2 * t] = (uint8_t)(cm_amx.colsb[t] >> 8);
      buf[48 + t] = cm_amx.rows[t];
    }
  }
  memcpy(config, buf, sizeof buf);
}

static inline void cm_amx_tilerelease(void) {
  memset(&cm_amx, 0, sizeof cm_amx);
}

/* #UD unless the tiles are configured and tile t is (rows and colsb nonzero) */
static inline void cm_amx_require(int t, const char *instruction) {
  if (!cm_amx.configured) CM_AMX_FAULT(instruction);
  if (t < 0 || t >= CM_AMX_TILES || cm_amx.rows[t] == 0) CM_AMX_FAULT(instruction);
}

/* write_row_and_zero / zero_upper_rows: bytes past colsb and rows past rows become zero */
static inline void cm_amx_zero_outside(int t) {
  for (int r = 0; r < CM_AMX_MAX_ROWS; r++) {
    const int from = r < cm_amx.rows[t] ? cm_amx.colsb[t] : 0;
    memset(cm_amx.data[t][r] + from, 0, (size_t)(CM_AMX_BYTES_PER_ROW - from));
  }
}

/* tileloadd and tilestored move whole dwords: on the silicon (docs/NUMERICS.md) both #UD on a
 * tile whose colsb is not a multiple of 4, which ldtilecfg accepts (and tilezero clears). */
static inline void cm_amx_require_dwords(int t, const char *instruction) {
  if (cm_amx.colsb[t] % 4) CM_AMX_FAULT(instruction);
}

/* tileloadd: row r from base + r * stride, colsb bytes */
static inline void cm_amx_tileloadd(int t, const void *base, long stride) {
  cm_amx_require(t, "tileloadd: tiles not configured or tile not valid");
  cm_amx_require_dwords(t, "tileloadd: colsb not a multiple of 4");
  for (int r = 0; r < cm_amx.rows[t]; r++)
    memcpy(cm_amx.data[t][r], (const char *)base + (ptrdiff_t)r * stride, cm_amx.colsb[t]);
  cm_amx_zero_outside(t);
}

static inline void cm_amx_tilestored(int t, void *base, long stride) {
  cm_amx_require(t, "tilestored: tiles not configured or tile not valid");
  cm_amx_require_dwords(t, "tilestored: colsb not a multiple of 4");
  for (int r = 0; r < cm_amx.rows[t]; r++)
    memcpy((char *)base + (ptrdiff_t)r * stride, cm_amx.data[t][r], cm_amx.colsb[t]);
}

static inline void cm_amx_tilezero(int t) {
  cm_amx_require(t, "tilezero: tiles not configured or tile not valid");
  memset(cm_amx.data[t], 0, sizeof cm_amx.data[t]);
}

/* The shape checks of the dot products (#UD otherwise): three valid, distinct tiles;
 * C (dst) is M x N dwords, A (src1) M x K dwords, B (src2) K x N dwords. The SDM sizes rows in
 * dwords (colsb / 4); a colsb that is not a multiple of 4 leaves a partial dword, which the
 * model refuses (stricter than the hardware may be: no kernel means it). */
static inline void cm_amx_check_dp(int c, int a, int b, const char *instruction) {
  cm_amx_require(c, instruction);
  cm_amx_require(a, instruction);
  cm_amx_require(b, instruction);
  if (c == a || c == b || a == b) CM_AMX_FAULT(instruction);
  if (cm_amx.colsb[c] % 4 || cm_amx.colsb[a] % 4 || cm_amx.colsb[b] % 4) CM_AMX_FAULT(instruction);
  if (cm_amx.rows[c] != cm_amx.rows[a]) CM_AMX_FAULT(instruction);
  if (cm_amx.colsb[c] != cm_amx.colsb[b]) CM_AMX_FAULT(instruction);
  if (cm_amx.colsb[a] / 4 != cm_amx.rows[b]) CM_AMX_FAULT(instruction);
}

static inline uint32_t cm_amx_dword(int t, int r, int k) {
  uint32_t v;
  memcpy(&v, cm_amx.data[t][r] + 4 * k, 4);
  return v;
}

/* tdpbf16ps, as the SDM's Operation has it: per output element, two fp32 sums from +0, one of
 * the even elements of the pairs and one of the odd, each k a fused step (DAZ, RNE, FTZ);
 * then even + odd, then C + that, each rounded (DAZ, RNE, FTZ). */
static inline void cm_amx_tdpbf16ps(int c, int a, int b) {
  cm_amx_check_dp(c, a, b, "tdpbf16ps: tiles not configured, not distinct or shapes differ");
  const int M = cm_amx.rows[c], N = cm_amx.colsb[c] / 4, K = cm_amx.colsb[a] / 4;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      uint32_t even = 0, odd = 0;
      for (int k = 0; k < K; k++) {
        const uint32_t x = cm_amx_dword(a, m, k), y = cm_amx_dword(b, k, n);
        even = cm_fma_step(even, x << 16, y << 16);
        odd = cm_fma_step(odd, x & 0xffff0000u, y & 0xffff0000u);
      }
      const uint32_t sum = cm_add_step(cm_amx_dword(c, m, n), cm_add_step(even, odd));
      memcpy(cm_amx.data[c][m] + 4 * n, &sum, 4);
    }
  cm_amx_zero_outside(c);
}

/* tdpb[su][su]d: C += the four byte products of each dword pair, modulo 2^32 (the SDM's DPBD
 * adds without saturation); each byte sign- or zero-extended as the letter says. */
static inline void cm_amx_tdpb(int c, int a, int b, int a_signed, int b_signed) {
  cm_amx_check_dp(c, a, b, "tdpb*d: tiles not configured, not distinct or shapes differ");
  const int M = cm_amx.rows[c], N = cm_amx.colsb[c] / 4, K = cm_amx.colsb[a] / 4;
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      uint32_t acc = cm_amx_dword(c, m, n);
      for (int k = 0; k < K; k++)
        for (int i = 0; i < 4; i++) {
          const uint8_t x = cm_amx.data[a][m][4 * k + i], y = cm_amx.data[b][k][4 * n + i];
          const int32_t xv = a_signed && x > 127 ? x - 256 : x;
          const int32_t yv = b_signed && y > 127 ? y - 256 : y;
          acc += (uint32_t)(xv * yv); /* |xv * yv| <= 2^16: no int overflow */
        }
      memcpy(cm_amx.data[c][m] + 4 * n, &acc, 4);
    }
  cm_amx_zero_outside(c);
}

#endif /* CPUMOE_TESTS_EMULATE_BF16_AMX_MODEL_H */
