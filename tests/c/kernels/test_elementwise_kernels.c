/*
 * Bit-for-bit checks of the elementwise kernels that are written with intrinsics on some tiers
 * (elementwise/elementwise-impl.h), against a plain-C restatement of their contract:
 *   - quantize_u8: q = clamp(round_half_even(x * inv_scale), -127, 127) + 128, NaN -> 128,
 *     on every value class (NaN, infinities, signed zeros, ties at +-0.5 .. +-127.5, values
 *     just inside and past the clamp, huge and tiny), on random values, at every length from 0
 *     to 70 (the vector loops' tails) and with inv_scale 1, random, 0, infinity and NaN.
 *   - scale_rows: c[r][i] * g[r] in place, the same bits as bias_scale without a bias row by
 *     row (the INT4 path used that before), for rows 0 to 5 of every length from 0 to 70,
 *     on the same values, with scales 1, random, 0, -0, 2^-100, infinity and NaN.
 * Its own program, linked with the core's objects by tools/build_c_tests.py: natively it runs
 * the tiers the CPU has (and says which it skipped); the emulated build runs every tier.
 * Prints one line per group of checks; exits 1 when a check failed.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ukernels.h"

#include "cpumoe/cpumoe.h"

#define KERNEL_TEST_SEED 0x6a09e667f3bcc909u
#include "kernel_test.h" /* rnd, xmalloc, the precondition hook */

static void check(int ok, const char *what, const char *tier, size_t n, float inv_scale) {
  if (kernel_check_failed(ok))
    fprintf(stderr, "FAIL: %s [%s] (n %zu, inv_scale %g)\n", what, tier, n, (double)inv_scale);
}

typedef struct tier_kernels {
  const char *name;
  cpumoe_isa isa;
  void (*quantize_u8)(size_t n, const float *x, float inv_scale, uint8_t *q);
  cm_scale_rows_fn scale_rows;
  cm_bias_scale_fn bias_scale;
} tier_kernels;

#define CM_TIER_KERNELS(name, ISA, tier) \
  {name, ISA, cm_quantize_u8__##tier, cm_scale_rows__##tier, cm_bias_scale__##tier}
static const tier_kernels g_tiers[] = {
    CM_TIER_KERNELS("scalar", CPUMOE_ISA_SCALAR, scalar),
    CM_TIER_KERNELS("avx2", CPUMOE_ISA_AVX2, avx2),
    CM_TIER_KERNELS("avx512", CPUMOE_ISA_AVX512, avx512),
};

/* 1 (after saying so) when this CPU cannot run the tier's kernels */
static int tier_skipped(const tier_kernels *tk, const char *what) {
  if (tier_runs(tk->isa)) return 0;
  printf("%s: %s skipped, this CPU lacks the tier\n", what, tk->name);
  return 1;
}

/* The contract, in double where it can be: the product rounded to float as the kernel
 * rounds it, then half-to-even rounding by hand (no dependence on the rounding mode). */
static uint8_t quantize_spec(float x, float inv_scale) {
  const float v = x * inv_scale;
  if (v != v) return 128;
  if (v >= 127.0f) return 255;
  if (v <= -127.0f) return 1;
  const double fl = floor((double)v), frac = (double)v - fl;
  double r = frac > 0.5 ? fl + 1 : fl;
  if (frac == 0.5) r = fmod(fl, 2.0) == 0.0 ? fl : fl + 1;
  return (uint8_t)((int)r + 128);
}

static float rnd_float(void) { /* spread over magnitudes 2^-20 .. 2^10, either sign */
  const double u = (double)(rnd() >> 11) / 9007199254740992.0;
  const double m = ldexp(1.0 + u, (int)(rnd() % 31) - 20);
  return (float)(rnd() & 1 ? -m : m);
}

enum { VALUES = 4096, MAX_TAIL = 70 };

/* the inputs: every value class, every tie of the rounding and its neighbours, then random */
static float g_values[VALUES];

static void fill_values(void) {
  float *x = g_values;
  size_t count = 0;
  const float special[] = {NAN,
                           -NAN,
                           INFINITY,
                           -INFINITY,
                           0.0f,
                           -0.0f,
                           1e-30f,
                           -1e-30f,
                           3e38f,
                           -3e38f,
                           127.0f,
                           -127.0f,
                           nextafterf(127.0f, 200.0f),
                           nextafterf(-127.0f, -200.0f),
                           nextafterf(127.5f, 0.0f),
                           nextafterf(-127.5f, 0.0f),
                           2147483648.0f,
                           -2147483648.0f};
  for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) x[count++] = special[i];
  for (int t = -128; t <= 127; t++) { /* every tie and both its neighbours */
    const float tie = (float)t + 0.5f;
    x[count++] = tie;
    x[count++] = nextafterf(tie, -1000.0f);
    x[count++] = nextafterf(tie, 1000.0f);
    x[count++] = (float)t;
  }
  while (count < VALUES) x[count++] = rnd_float();
}

static void check_quantize_u8(void) {
  const float *x = g_values;
  static uint8_t q[VALUES + 64], want[VALUES];
  const float scales[] = {1.0f, 0.37f, 127.0f / 3.5f, 0.0f, INFINITY, NAN};
  for (size_t t = 0; t < sizeof g_tiers / sizeof g_tiers[0]; t++) {
    const tier_kernels *tk = &g_tiers[t];
    if (tier_skipped(tk, "quantize_u8")) continue;
    const int checks = g_checks;
    for (size_t s = 0; s < sizeof scales / sizeof scales[0]; s++) {
      const float inv = scales[s];
      for (size_t i = 0; i < VALUES; i++) want[i] = quantize_spec(x[i], inv);
      /* the whole array from several offsets (unaligned starts), then every short length */
      for (size_t off = 0; off < 4; off++) {
        memset(q, 0xa5, sizeof q);
        tk->quantize_u8(VALUES - off, x + off, inv, q);
        check(memcmp(q, want + off, VALUES - off) == 0 && q[VALUES - off] == 0xa5,
              "quantize_u8 of every value class", tk->name, VALUES - off, inv);
      }
      for (size_t n = 0; n <= MAX_TAIL; n++) {
        memset(q, 0xa5, sizeof q);
        tk->quantize_u8(n, x + 1, inv, q);
        check(memcmp(q, want + 1, n) == 0 && q[n] == 0xa5, "quantize_u8 of a short row", tk->name,
              n, inv);
      }
    }
    printf("quantize_u8: %s %d checks (%d values, lengths 0..%d, %zu scales)\n", tk->name,
           g_checks - checks, VALUES, MAX_TAIL, sizeof scales / sizeof scales[0]);
  }
}

/* each row of c a different window of g_values */
static void check_scale_rows(void) {
  const float *x = g_values;
  enum { ROWS = 5 };
  static float c[ROWS * MAX_TAIL], want[ROWS * MAX_TAIL];
  const float scales[] = {1.0f, 0.37f, 0.0f, -0.0f, 0x1p-100f, INFINITY, NAN};
  const size_t ns = sizeof scales / sizeof scales[0];
  for (size_t t = 0; t < sizeof g_tiers / sizeof g_tiers[0]; t++) {
    const tier_kernels *tk = &g_tiers[t];
    if (tier_skipped(tk, "scale_rows")) continue;
    const int checks = g_checks;
    for (size_t rows = 0; rows <= ROWS; rows++)
      for (size_t n = 0; n <= MAX_TAIL; n++) {
        float g[ROWS];
        for (size_t r = 0; r < rows; r++) {
          g[r] = scales[(rows + n + r) % ns];
          const float *src = x + (r * 977 + n * 31) % (VALUES - MAX_TAIL);
          memcpy(c + r * n, src, n * sizeof(float));
          tk->bias_scale(n, src, NULL, g[r], want + r * n);
        }
        tk->scale_rows(rows, n, c, g);
        int same = 1;
        for (size_t i = 0; i < rows * n; i++) {
          uint32_t a, b;
          memcpy(&a, c + i, 4);
          memcpy(&b, want + i, 4);
          /* a NaN times a NaN scale may keep either payload: any NaN for a NaN */
          same &= a == b || (c[i] != c[i] && want[i] != want[i]);
        }
        check(same, "scale_rows", tk->name, n, (float)rows);
      }
    printf("scale_rows: %s %d checks (rows 0..%d, lengths 0..%d, %zu scales)\n", tk->name,
           g_checks - checks, ROWS, MAX_TAIL, ns);
  }
}

int main(void) {
  fill_values();
  check_quantize_u8();
  check_scale_rows();
  return kernel_test_summary();
}
