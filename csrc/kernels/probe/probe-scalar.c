/*
 * Machine-limit probes, scalar tier (see probe/probe-avx512.c): 8-byte loads
 * into 8 integer adds; the "FMA" peak of this tier is 8 independent chains of a
 * plain multiply-add (no FMA instruction is assumed), counted as 2 flops each.
 */
#include <string.h>

#include "common/ukernels.h"

double cm_probe_read_chunk__scalar(const void *buffer, size_t bytes) {
  const char *p = (const char *)buffer;
  unsigned long long s[8] = {0};
  for (size_t i = 0; i + 64 <= bytes; i += 64)
    for (int j = 0; j < 8; j++) {
      unsigned long long v;
      memcpy(&v, p + i + 8 * j, 8);
      s[j] += v;
    }
  for (int j = 1; j < 8; j++) s[0] += s[j];
  return (double)s[0];
}

double cm_probe_fma_loop__scalar(int64_t iterations) {
  volatile float seed = 0.999999f;
  float x = seed, acc[8];
  for (int i = 0; i < 8; i++) acc[i] = (float)i;
  for (int64_t it = 0; it < iterations; it++)
    for (int i = 0; i < 8; i++) acc[i] = acc[i] * x + 1e-7f;
  for (int i = 1; i < 8; i++) acc[0] += acc[i];
  seed = acc[0];
  return (double)iterations * 8.0 * 2.0;
}

/* int8 peak of the scalar tier: 8 independent integer multiply-add chains (unsigned: the
 * sums wrap after ~1e7 iterations, which must not be signed overflow). */
double cm_probe_int8_loop__scalar(int64_t iterations) {
  volatile uint32_t seed = 3;
  uint32_t x = seed, acc[8];
  for (int i = 0; i < 8; i++) acc[i] = (uint32_t)i;
  for (int64_t it = 0; it < iterations; it++)
    for (int i = 0; i < 8; i++) acc[i] += x * (uint32_t)(it & 127);
  for (int i = 1; i < 8; i++) acc[0] += acc[i];
  seed = acc[0];
  return (double)iterations * 8.0 * 2.0;
}
