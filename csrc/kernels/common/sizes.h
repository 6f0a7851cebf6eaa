/*
 * Size arithmetic that cannot overflow: byte counts of caller tensors are products of
 * int64 sizes, any of which may be absurd. A product that exceeds PTRDIFF_MAX describes
 * no object that can exist, so the check rejects it instead of computing it.
 */
#ifndef CPUMOE_COMMON_SIZES_H
#define CPUMOE_COMMON_SIZES_H

#include <stddef.h>
#include <stdint.h>

/* a * b * c for non-negative factors, or -1 when a factor is negative or the product
 * exceeds PTRDIFF_MAX. Nests: a -1 factor gives -1. */
static inline int64_t cm_size_product(int64_t a, int64_t b, int64_t c) {
  if (a < 0 || b < 0 || c < 0) return -1;
  if (a == 0 || b == 0 || c == 0) return 0;
  const int64_t limit = PTRDIFF_MAX;
  if (a > limit / b) return -1;
  if (a * b > limit / c) return -1;
  return a * b * c;
}

/* ceil(a / b) for a >= 0, b >= 1, without forming a + b - 1 */
static inline int64_t cm_ceil_div(int64_t a, int64_t b) {
  return a == 0 ? 0 : (a - 1) / b + 1;
}

#endif
