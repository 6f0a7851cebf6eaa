/*
 * Checks of the amx tier's tile GEMMs (cm_bf16_gemm_rows_mrx32__amx and
 * cm_u8s8_gemm_rows_mrx32__amx, tiles/gemm-amx.c) on calls of 33 to 48 rows, three rows of
 * tiles, which the pipeline makes for a block of two panels (cm_gemm_config.block_rows_max):
 * every row bit for bit equal to the same row computed by calls of at most 32 rows (rows
 * 0..31 in one call, the rest in another), which is what the pipeline assumes when it takes a
 * block in one call instead of panel by panel: a tile product computes each row from its own
 * A row and B alone (and the calls of at most 32 rows are held to the reference by the
 * driver's cases). With and without accumulating into C, over reductions with a partial last
 * k step, with the call staging its own weights (CM_PREFETCH_SELF) or requesting a share of
 * other memory; bf16's C rows past mr left as they were (unless mr is 48, a whole tile row),
 * u8s8's accumulators written as whole tiles up to row 48 and not past it.
 * Its own program, linked with the core's objects by tools/build_c_tests.py: natively it runs
 * where the CPU has the amx tier (and says it skipped elsewhere); in the emulated build
 * (--emulate, the tile model of tests/c/emulate/amx.h) everywhere. Prints one line per
 * group; exits 1 when a check failed.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/numeric.h" /* cm_f32_bits */
#include "common/ukernels.h"

#include "cpumoe/cpumoe.h"

#define KERNEL_TEST_SEED 0x5851f42d4c957f2du
#include "kernel_test.h" /* rnd, xmalloc, the precondition hook */

enum { NR = 32, MAX_ROWS = 48, SLACK_ROWS = 16, GUARD_ROWS = 2 };

static void check(int ok, const char *what, size_t mr, size_t k, int accumulate, int self) {
  if (kernel_check_failed(ok))
    fprintf(stderr, "FAIL: %s (mr %zu, k %zu, accumulate %d, %s)\n", what, mr, k, accumulate,
            self ? "staged" : "shared prefetch");
}

static int same_bits(float a, float b) {
  return cm_f32_bits(a) == cm_f32_bits(b);
}

static const size_t g_rows[] = {33, 34, 40, 47, 48};

/* The prefetch argument of a call: the kernel's own staging, or a share of `other`. */
static cm_prefetch prefetch_of(int self, const void *other) {
  return self ? CM_PREFETCH_SELF : (cm_prefetch){other, 7};
}

/* Runs one kernel's check on every case (each row count of g_rows, reduction of ks,
 * accumulating or not, staged or with a shared prefetch) and prints how many checks it made. */
typedef void (*case_fn)(size_t mr, size_t k, int accumulate, int self);
static void run_cases(const char *kernel, const size_t *ks, size_t n_ks, case_fn check_case) {
  const int checks = g_checks;
  for (size_t ri = 0; ri < sizeof g_rows / sizeof g_rows[0]; ri++)
    for (size_t ki = 0; ki < n_ks; ki++)
      for (int accumulate = 0; accumulate < 2; accumulate++)
        for (int self = 0; self < 2; self++) check_case(g_rows[ri], ks[ki], accumulate, self);
  printf("amx tile kernels: %s %d checks of 33-48 rows against calls of up to 32 rows\n", kernel,
         g_checks - checks);
}

/* ---- bf16 --------------------------------------------------------------------------------- */

/* a bf16 of moderate size, either sign: 2^-4 .. 2^4, 8 significant bits */
static uint16_t rnd_bf16(void) {
  const uint64_t r = rnd();
  return (uint16_t)((r & 1) << 15 | (uint64_t)(127 - 4 + (r >> 1) % 9) << 7 | (r >> 8 & 0x7f));
}

static void check_bf16_case(size_t mr, size_t k, int accumulate, int self) {
  const size_t as = k + 32;
  uint16_t *a = xmalloc(2 * (MAX_ROWS + SLACK_ROWS) * as);
  uint16_t *b = xmalloc(2 * k * NR);
  for (size_t i = 0; i < (MAX_ROWS + SLACK_ROWS) * as; i++) a[i] = rnd_bf16();
  for (size_t i = 0; i < k * NR; i++) b[i] = rnd_bf16();
  float c[(MAX_ROWS + GUARD_ROWS) * NR], split[(MAX_ROWS + GUARD_ROWS) * NR];
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) c[i] = (float)(rnd() % 64) / 16.0f - 2.0f;
  memcpy(split, c, sizeof c);
  const float *start = split; /* rows past mr keep these */
  float guard[GUARD_ROWS * NR];
  memcpy(guard, split + MAX_ROWS * NR, sizeof guard);
  cm_bf16_gemm_rows_mrx32__amx(mr, k, a, as, b, c, accumulate, prefetch_of(self, a));
  float past[(MAX_ROWS - 33 + GUARD_ROWS) * NR];
  const size_t past_n = (MAX_ROWS + GUARD_ROWS - mr) * NR;
  memcpy(past, start + mr * NR, past_n * sizeof(float));
  cm_bf16_gemm_rows_mrx32__amx(32, k, a, as, b, split, accumulate, prefetch_of(self, a));
  cm_bf16_gemm_rows_mrx32__amx(mr - 32, k, a + 32 * as, as, b, split + 32 * NR, accumulate,
                               prefetch_of(self, a));
  int ok = 1;
  for (size_t i = 0; i < mr * NR; i++) ok &= same_bits(c[i], split[i]);
  check(ok, "bf16 rows equal to calls of up to 32 rows", mr, k, accumulate, self);
  int kept = 1;
  for (size_t i = 0; mr < MAX_ROWS && i < past_n; i++) kept &= same_bits(c[mr * NR + i], past[i]);
  for (size_t i = 0; i < GUARD_ROWS * NR; i++) kept &= same_bits(c[MAX_ROWS * NR + i], guard[i]);
  check(kept, "bf16 rows past mr untouched", mr, k, accumulate, self);
  free(a), free(b);
}

/* ---- u8 x s8 ------------------------------------------------------------------------------ */

static void check_u8s8_case(size_t mr, size_t k, int accumulate, int self) {
  const size_t as = k + 64;
  uint8_t *a = xmalloc((MAX_ROWS + SLACK_ROWS) * as);
  int8_t *b = xmalloc(k * NR);
  for (size_t i = 0; i < (MAX_ROWS + SLACK_ROWS) * as; i++) a[i] = (uint8_t)rnd();
  for (size_t i = 0; i < k * NR; i++) b[i] = (int8_t)rnd();
  int32_t acc[(MAX_ROWS + GUARD_ROWS) * NR], split[(MAX_ROWS + GUARD_ROWS) * NR];
  for (size_t i = 0; i < sizeof acc / sizeof acc[0]; i++) acc[i] = (int32_t)(rnd() % 2001) - 1000;
  memcpy(split, acc, sizeof acc);
  int32_t guard[GUARD_ROWS * NR];
  memcpy(guard, acc + MAX_ROWS * NR, sizeof guard);
  cm_u8s8_gemm_rows_mrx32__amx(mr, k, a, as, b, acc, accumulate, prefetch_of(self, a));
  cm_u8s8_gemm_rows_mrx32__amx(32, k, a, as, b, split, accumulate, prefetch_of(self, a));
  cm_u8s8_gemm_rows_mrx32__amx(mr - 32, k, a + 32 * as, as, b, split + 32 * NR, accumulate,
                               prefetch_of(self, a));
  int ok = 1;
  for (size_t i = 0; i < mr * NR; i++) ok &= acc[i] == split[i];
  check(ok, "u8s8 rows equal to calls of up to 32 rows", mr, k, accumulate, self);
  int kept = 1;
  for (size_t i = 0; i < GUARD_ROWS * NR; i++) kept &= acc[MAX_ROWS * NR + i] == guard[i];
  check(kept, "u8s8 rows past 48 untouched", mr, k, accumulate, self);
  free(a), free(b);
}

int main(void) {
  if (!tier_runs(CPUMOE_ISA_AMX)) {
    printf("amx tile kernels: skipped, this CPU lacks the amx tier\n");
    return kernel_test_summary();
  }
  (void)cpumoe_active_isa(); /* on Linux: the tile data permission, asked at the first choice */
  /* reductions with a partial last k step: 50 (steps of 32 k), 100 (of 64) */
  static const size_t bf16_ks[] = {32, 50, 288, 2048}, u8s8_ks[] = {64, 100, 256, 2048};
  run_cases("bf16", bf16_ks, sizeof bf16_ks / sizeof bf16_ks[0], check_bf16_case);
  run_cases("u8s8", u8s8_ks, sizeof u8s8_ks / sizeof u8s8_ks[0], check_u8s8_case);
  cm_amx_end_op__amx();
  return kernel_test_summary();
}
