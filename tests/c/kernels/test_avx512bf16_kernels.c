/*
 * Bit-for-bit checks of the avx512bf16 tier's GEMM kernels (schemes/unquant/ and schemes/fp8/
 * gemm-avx512bf16.c) against plain-C references:
 *   - fmaf chains (the fp32-chain class's arithmetic, docs/NUMERICS.md) on random normal data,
 *     where vdpbf16ps computes exactly that chain;
 *   - chains of cm_dpbf16_lane (emulate/bf16_amx_model.h, the exact model of one vdpbf16ps
 *     lane, held to the silicon by test_bf16_amx_conformance.c) on data with denormals,
 *     products near 2^-126, infinities and NaN codes, where the instruction's DAZ and FTZ
 *     part from the chain;
 *   - the fp8 decode to bf16 against a scalar decode of the e4m3fn definition, every code in
 *     every position, and the prefill route (to_bf16, then the bf16 kernel) against the
 *     decode kernel.
 * Its own program, linked with the core's objects by tools/build_c_tests.py: natively it
 * runs where the CPU has the avx512bf16 tier (and says it skipped elsewhere); in the
 * emulating build (--emulate, tests/c/emulate/immintrin.h) everywhere. Prints one line per
 * group; exits 1 when a check failed.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ukernels.h"
#include "emulate/bf16_amx_model.h" /* cm_dpbf16_lane; plain C */

#include "cpumoe/cpumoe.h"

#define KERNEL_TEST_SEED 0x9e3779b97f4a7c15u
#include "kernel_test.h" /* rnd, xmalloc, the precondition hook */

enum { NR = 32, MR_BF16 = 12, MR_FP8 = 4, C_GUARD_ROWS = 1 };

static void check(int ok, const char *what, size_t mr, size_t kp, int accumulate, size_t as) {
  if (kernel_check_failed(ok))
    fprintf(stderr, "FAIL: %s (mr %zu, k pairs %zu, accumulate %d, a_stride %zu)\n", what, mr, kp,
            accumulate, as);
}

/* ---- data ------------------------------------------------------------------------------- */

/* a bf16 of moderate size, either sign: 2^-6 .. 2^6, 8 significant bits */
static uint16_t rnd_bf16_normal(void) {
  const uint64_t r = rnd();
  return (uint16_t)((r & 1) << 15 | (uint64_t)(127 - 6 + (r >> 1) % 13) << 7 | (r >> 8 & 0x7f));
}

/* A bf16 for the special data, by regime:
 *   0  mixed: denormals (1 in 8), zeros, rare infinities and NaNs (1 in 1024 each, so that
 *      most chains stay finite), tiny normals, moderate values;
 *   1  tiny: 2^-126 .. 2^-119, so that against moderate weights every product, and the
 *      chain, lies near 2^-126, where FTZ acts;
 *   2  half denormal, half moderate: DAZ drops the denormals' products. */
static uint16_t rnd_bf16_special(int regime) {
  const uint64_t r = rnd();
  const uint16_t sign = (uint16_t)((r & 1) << 15), mant = (uint16_t)(r >> 8 & 0x7f);
  const unsigned pick = (unsigned)(r >> 16 & 1023);
  if (regime == 1) return (uint16_t)(sign | (uint64_t)(1 + (r >> 32) % 8) << 7 | mant);
  if (regime == 2) return pick % 2 ? (uint16_t)(sign | mant) : rnd_bf16_normal();
  if (pick == 0) return sign | 0x7f80;                                 /* infinity */
  if (pick == 1) return (uint16_t)(sign | 0x7f80 | (mant ? mant : 1)); /* NaN, maybe signalling */
  if (pick < 128) return sign | mant;                                  /* denormal (or zero) */
  if (pick < 160) return sign;                                         /* zero */
  if (pick < 400) return (uint16_t)(sign | (uint64_t)(1 + (r >> 32) % 12) << 7 | mant); /* tiny */
  return rnd_bf16_normal();
}

/* an fp32 accumulator input: moderate, or (special) denormal / tiny / zero */
static uint32_t rnd_c_bits(int special) {
  const uint64_t r = rnd();
  const uint32_t sign = (uint32_t)(r & 1) << 31, mant = (uint32_t)(r >> 8) & 0x7fffffu;
  if (special && r % 4 == 0) return sign | mant; /* denormal */
  if (special && r % 4 == 1) return sign | (uint32_t)(1 + (r >> 40) % 6) << 23 | mant; /* tiny */
  if (special && r % 16 == 2) return sign;
  return sign | (uint32_t)(127 - 4 + (r >> 40) % 9) << 23 | mant;
}

/* ---- scalar references -------------------------------------------------------------------- */

static float bf16_value(uint16_t h) {
  return cm_f32_from_bits((uint32_t)h << 16);
}

/* row r's element k of a high-first pair panel */
static uint16_t a_elem(const uint32_t *a, size_t as, size_t r, size_t k) {
  const uint32_t pair = a[(k / 2) * as + r];
  return (uint16_t)(k % 2 ? pair & 0xffff : pair >> 16);
}

/* e4m3fn by its definition: s.eeee.mmm, bias 7, e = 0 subnormal (m * 2^-9), 0x7f / 0xff NaN,
 * no infinities. Returns the bf16 bits of value * 2^-8 (exact: checked), NaN as 0x7ff0 with
 * the code's sign. */
static uint16_t e4m3_bf16_reference(uint8_t code) {
  const uint16_t sign = (uint16_t)((code & 0x80) << 8);
  const int e = code >> 3 & 0xf, m = code & 7;
  if ((code & 0x7f) == 0x7f) return sign | 0x7ff0;
  const double v = (e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 7 - 3)) * 0x1p-8;
  const uint32_t bits = cm_f32_bits((float)v);
  if (bits & 0xffff) {
    fprintf(stderr, "e4m3 code 0x%02x: not a bf16\n", code);
    exit(2);
  }
  return (uint16_t)(sign | bits >> 16);
}

/* the bf16 weight of B (VNNI-2 16-bit) or the decoded fp8 weight, at (k, n) */
static uint16_t b16_elem(const uint16_t *b, size_t k, size_t n) {
  return b[(k / 2) * 64 + 2 * n + k % 2];
}
static uint16_t fp8_elem(const uint8_t *b, size_t k, size_t n) {
  return e4m3_bf16_reference(b[(k / 2) * 64 + 2 * n + k % 2]);
}

/* The reference of one output element: the chain over k from `acc`, either as fmaf (the
 * fp32 chain) or as vdpbf16ps lanes (the model, pairs high first), of A row r times the
 * weights get(k, n). */
typedef uint16_t (*weight_fn)(const void *b, size_t k, size_t n);
static uint16_t w_b16(const void *b, size_t k, size_t n) {
  return b16_elem(b, k, n);
}
static uint16_t w_fp8(const void *b, size_t k, size_t n) {
  return fp8_elem(b, k, n);
}

static uint32_t chain_fmaf(uint32_t acc, const uint32_t *a, size_t as, size_t r, size_t k,
                           weight_fn w, const void *b, size_t n) {
  float s = cm_f32_from_bits(acc);
  for (size_t i = 0; i < k; i++)
    s = fmaf(bf16_value(a_elem(a, as, r, i)), bf16_value(w(b, i, n)), s);
  return cm_f32_bits(s);
}

static uint32_t chain_model(uint32_t acc, const uint32_t *a, size_t as, size_t r, size_t k,
                            weight_fn w, const void *b, size_t n) {
  for (size_t i = 0; i < k; i += 2) {
    const uint32_t b_pair = (uint32_t)w(b, i, n) << 16 | w(b, i + 1, n); /* high first */
    acc = cm_dpbf16_lane(acc, a[(i / 2) * as + r], b_pair);
  }
  return acc;
}

/* ---- the checks ------------------------------------------------------------------------- */

/* the A panel; special data: row r in regime r % 3 (rnd_bf16_special) */
static uint32_t *make_a(size_t kp, size_t as, int special) {
  uint32_t *a = xmalloc(kp * as * sizeof *a);
  for (size_t i = 0; i < kp * as; i++) {
    const int regime = (int)(i % as % 3);
    const uint16_t hi = special ? rnd_bf16_special(regime) : rnd_bf16_normal();
    const uint16_t lo = special ? rnd_bf16_special(regime) : rnd_bf16_normal();
    a[i] = (uint32_t)hi << 16 | lo;
  }
  return a;
}

/* C with one guard row after the tile; returns the initial bits in c0 */
static float *make_c(size_t mr, int special, uint32_t *c0) {
  float *c = xmalloc((mr + C_GUARD_ROWS) * NR * sizeof *c);
  for (size_t i = 0; i < (mr + C_GUARD_ROWS) * NR; i++) c0[i] = rnd_c_bits(special);
  memcpy(c, c0, (mr + C_GUARD_ROWS) * NR * sizeof *c);
  return c;
}

static int guard_intact(const float *c, const uint32_t *c0, size_t mr) {
  return memcmp(c + mr * NR, c0 + mr * NR, C_GUARD_ROWS * NR * sizeof *c) == 0;
}

static int g_bf16_differs; /* lanes where the model and the fmaf chain part (special data) */

static void check_bf16(size_t mr, size_t kp, int accumulate, size_t as, int special) {
  const size_t k = 2 * kp;
  uint32_t *a = make_a(kp, as, special);
  uint16_t *b = xmalloc(kp * 64 * sizeof *b);
  for (size_t i = 0; i < kp * 64; i++) /* B: mixed, so that denormal weights meet every A */
    b[i] = special ? rnd_bf16_special(0) : rnd_bf16_normal();
  uint32_t c0[(MR_BF16 + C_GUARD_ROWS) * NR];
  float *c = make_c(mr, special, c0);

  cm_bf16_gemm_pairs_mrx32__avx512bf16(mr, k, a, as, b, c, accumulate, CM_PREFETCH_SELF);

  int ok = 1;
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < NR; n++) {
      const uint32_t start = accumulate ? c0[r * NR + n] : 0;
      const uint32_t got = cm_f32_bits(c[r * NR + n]);
      const uint32_t model = chain_model(start, a, as, r, k, w_b16, b, n);
      if (special) {
        ok &= got == model;
        const uint32_t chain = chain_fmaf(start, a, as, r, k, w_b16, b, n);
        g_bf16_differs += model != chain && !(cm_is_nan_bits(model) && cm_is_nan_bits(chain));
      } else {
        ok &= got == chain_fmaf(start, a, as, r, k, w_b16, b, n) && got == model;
      }
    }
  check(ok, special ? "bf16 gemm = vdpbf16ps model chain" : "bf16 gemm = fmaf chain", mr, kp,
        accumulate, as);
  check(guard_intact(c, c0, mr), "bf16 gemm: rows past mr untouched", mr, kp, accumulate, as);
  free(a);
  free(b);
  free(c);
}

static int g_fp8_differs;

/* codes: normal data uses every code but the NaNs; special data adds a few NaN codes */
static uint8_t *make_fp8(size_t kp, int special) {
  uint8_t *b = xmalloc(kp * 64);
  for (size_t i = 0; i < kp * 64; i++) {
    uint8_t code = (uint8_t)rnd();
    if ((code & 0x7f) == 0x7f && !(special && rnd() % 8 == 0)) code ^= 1;
    b[i] = code;
  }
  return b;
}

static void check_fp8(size_t mr, size_t kp, int accumulate, size_t as, int special) {
  const size_t kc = 2 * kp;
  uint32_t *a = make_a(kp, as, special);
  uint8_t *b = make_fp8(kp, special);
  float scale[NR];
  for (size_t n = 0; n < NR; n++) scale[n] = cm_f32_from_bits(rnd_c_bits(0));
  uint32_t c0[(MR_FP8 + C_GUARD_ROWS) * NR];
  float *c = make_c(mr, special, c0);

  cm_fp8_gemm_pairs_mrx32__avx512bf16(mr, kc, a, as, b, scale, c, accumulate);

  int ok = 1;
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < NR; n++) {
      const float start = accumulate ? cm_f32_from_bits(c0[r * NR + n]) : 0.0f;
      const uint32_t got = cm_f32_bits(c[r * NR + n]);
      const uint32_t pm = chain_model(0, a, as, r, kc, w_fp8, b, n);
      const uint32_t pf = chain_fmaf(0, a, as, r, kc, w_fp8, b, n);
      const uint32_t model = cm_f32_bits(fmaf(cm_f32_from_bits(pm), scale[n], start));
      const uint32_t chain = cm_f32_bits(fmaf(cm_f32_from_bits(pf), scale[n], start));
      if (special) {
        ok &= got == model;
        g_fp8_differs += pm != pf && !(cm_is_nan_bits(pm) && cm_is_nan_bits(pf));
      } else {
        ok &= got == chain && got == model;
      }
    }
  check(ok, special ? "fp8 gemm = vdpbf16ps model chain, then fmaf" : "fp8 gemm = fmaf chains", mr,
        kp, accumulate, as);
  check(guard_intact(c, c0, mr), "fp8 gemm: rows past mr untouched", mr, kp, accumulate, as);

  /* the prefill route gives the same bits: the chunk decoded to bf16 VNNI-2, the bf16
   * kernel from +0, the fold */
  uint16_t *d = xmalloc(kp * 64 * sizeof *d);
  cm_fp8_to_bf16__avx512bf16(kc, b, d);
  float p[MR_FP8 * NR];
  cm_bf16_gemm_pairs_mrx32__avx512bf16(mr, kc, a, as, d, p, 0, CM_PREFETCH_SELF);
  ok = 1;
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < NR; n++) {
      const float start = accumulate ? cm_f32_from_bits(c0[r * NR + n]) : 0.0f;
      ok &= cm_f32_bits(fmaf(p[r * NR + n], scale[n], start)) == cm_f32_bits(c[r * NR + n]);
    }
  check(ok, "fp8: to_bf16 + bf16 gemm + fold = decode gemm", mr, kp, accumulate, as);
  if (kp >= 2) { /* the block in two chunks, the second accumulating: the same chain */
    const size_t kp1 = kp / 2;
    float p2[MR_FP8 * NR];
    cm_fp8_to_bf16__avx512bf16(2 * kp1, b, d);
    cm_fp8_to_bf16__avx512bf16(2 * (kp - kp1), b + kp1 * 64, d + kp1 * 64);
    cm_bf16_gemm_pairs_mrx32__avx512bf16(mr, 2 * kp1, a, as, d, p2, 0, CM_PREFETCH_SELF);
    cm_bf16_gemm_pairs_mrx32__avx512bf16(mr, 2 * (kp - kp1), a + kp1 * as, as, d + kp1 * 64, p2, 1,
                                         CM_PREFETCH_SELF);
    check(memcmp(p, p2, mr * NR * sizeof *p) == 0, "fp8: prefill in two chunks = in one", mr, kp,
          accumulate, as);
  }
  free(d);
  free(a);
  free(b);
  free(c);
}

/* every code in every byte position of a k pair, odd and even numbers of k pairs */
static void check_to_bf16(void) {
  for (size_t kp = 1; kp <= 256 + 3; kp += (kp < 4 ? 1 : 255)) {
    uint8_t *b = xmalloc(kp * 64);
    for (size_t q = 0; q < kp; q++)
      for (size_t pos = 0; pos < 64; pos++) b[q * 64 + pos] = (uint8_t)(q + 37 * pos + kp);
    uint16_t *d = xmalloc(kp * 64 * sizeof *d);
    cm_fp8_to_bf16__avx512bf16(2 * kp, b, d);
    int ok = 1;
    for (size_t k = 0; k < 2 * kp; k++)
      for (size_t n = 0; n < NR; n++) ok &= b16_elem(d, k, n) == fp8_elem(b, k, n);
    check(ok, "fp8 to_bf16 = scalar e4m3 decode, bf16 VNNI-2", 0, kp, 0, 0);
    free(b);
    free(d);
  }
}

int main(void) {
#ifndef CPUMOE_EMULATE_TIERS
  if (!cpumoe_isa_native(CPUMOE_ISA_AVX512BF16)) {
    printf(
        "avx512bf16 kernels: skipped, this CPU lacks the avx512bf16 tier (the emulated "
        "build runs them)\n");
    return 0;
  }
#endif
  static const size_t kpairs[] = {1, 2, 3, 8, 33, 64};
  const size_t nk = sizeof kpairs / sizeof kpairs[0];
  int checks = g_checks;

  check_to_bf16();
  printf("fp8 to_bf16: %d checks (256 codes x 64 positions)\n", g_checks - checks);

  for (int special = 0; special <= 1; special++) {
    checks = g_checks;
    for (size_t mr = 1; mr <= MR_BF16; mr++)
      for (size_t i = 0; i < nk; i++)
        for (int acc = 0; acc <= 1; acc++)
          for (size_t pad = 0; pad <= 3; pad += 3)
            check_bf16(mr, kpairs[i], acc, mr + pad, special);
    printf("bf16 gemm, %s: %d checks%s\n",
           special ? "denormals/inf/NaN vs model" : "normal data vs fmaf chain", g_checks - checks,
           special ? "" : " (and vs model)");
    checks = g_checks;
    for (size_t mr = 1; mr <= MR_FP8; mr++)
      for (size_t i = 0; i < nk; i++)
        for (int acc = 0; acc <= 1; acc++)
          for (size_t pad = 0; pad <= 3; pad += 3)
            for (int rep = 0; rep < 4; rep++) check_fp8(mr, kpairs[i], acc, mr + pad, special);
    printf("fp8 gemm, %s: %d checks\n",
           special ? "NaN codes, tiny/denormal A vs model" : "all finite codes vs fmaf chain",
           g_checks - checks);
  }
  /* the special data must reach the lanes where DAZ/FTZ part from the chain, or it tests
   * nothing the normal data does not */
  printf("special data: %d bf16 and %d fp8 lanes where the model parts from the fmaf chain\n",
         g_bf16_differs, g_fp8_differs);
  check(g_bf16_differs > 0 && g_fp8_differs > 0, "special data reaches DAZ/FTZ", 0, 0, 0, 0);

  return kernel_test_summary();
}
