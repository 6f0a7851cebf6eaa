/*
 * What the single-kernel test programs of tests/c/kernels/ share: the precondition hook of a
 * build that does not link common/error.c, a seeded splitmix64 generator and a checked
 * malloc, the count of checks and failures, and which tiers can run. Define
 * KERNEL_TEST_SEED (the generator's start) before including it.
 */
#ifndef CPUMOE_TESTS_C_KERNELS_KERNEL_TEST_H
#define CPUMOE_TESTS_C_KERNELS_KERNEL_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpumoe/cpumoe.h" /* cpumoe_isa_native */

#ifndef KERNEL_TEST_SEED
#error "define KERNEL_TEST_SEED before including kernel_test.h"
#endif

#ifdef CPUMOE_CHECK_PRECONDITIONS
/* common/error.c's, for a build that does not link it (weak: a build that does wins) */
__attribute__((weak)) void cm_precondition_failed(const char *condition, const char *file,
                                                  int line) {
  fprintf(stderr, "cpumoe: kernel precondition failed: %s (%s:%d)\n", condition, file, line);
  abort();
}
#endif

static uint64_t g_rng = KERNEL_TEST_SEED;
static inline uint64_t rnd(void) { /* splitmix64 */
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

static inline void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

/* Checks run and failed, counted by kernel_check_failed, reported by kernel_test_summary. */
static int g_checks, g_failures;

/* Counts one check; 1 when it failed and is among the first 20 failures, so that the
 * caller describes it. */
static inline int kernel_check_failed(int ok) {
  g_checks++;
  return !ok && ++g_failures <= 20;
}

/* The program's last line and exit status: 1 when a check failed. */
static inline int kernel_test_summary(void) {
  printf("%s: %d checks, %d failures\n", g_failures ? "FAIL" : "ok", g_checks, g_failures);
  return g_failures ? 1 : 0;
}

/* Whether a tier's kernels can run here: natively, the tiers the CPU has; in the emulated
 * build, every tier. */
static inline int tier_runs(cpumoe_isa isa) {
#ifdef CPUMOE_EMULATE_TIERS
  (void)isa;
  return 1;
#else
  return cpumoe_isa_native(isa);
#endif
}

#endif /* CPUMOE_TESTS_C_KERNELS_KERNEL_TEST_H */
