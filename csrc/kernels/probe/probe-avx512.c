/*
 * Machine-limit probes for the benchmark's roofline, AVX-512 tier.
 *   read: streams a buffer with 64-byte loads into 8 independent integer adds
 *         (no FP latency in the way), so DRAM or cache bandwidth is the limit.
 *   fma:  16 independent zmm FMA chains, register-only: 16 chains x 4-cycle
 *         latency covers 2 FMA ports with room to spare, so this is the fp32 peak.
 */
#include <immintrin.h>

#include "common/ukernels.h"

double cm_probe_read_chunk__avx512(const void *buffer, size_t bytes) {
  const char *p = (const char *)buffer;
  __m512i s[8];
  for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 512 <= bytes; i += 512)
    for (int j = 0; j < 8; j++) s[j] = _mm512_add_epi64(s[j], _mm512_loadu_si512(p + i + 64 * j));
  for (int j = 1; j < 8; j++) s[0] = _mm512_add_epi64(s[0], s[j]);
  return (double)_mm512_reduce_add_epi64(s[0]);
}

double cm_probe_fma_loop__avx512(int64_t iterations) {
  __m512 acc[16];
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
  for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[5]), "+v"(acc[10]), "+v"(acc[15]));
  }
  for (int i = 1; i < 16; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  (void)_mm512_reduce_add_ps(acc[0]);
  return (double)iterations * 16.0 * 16.0 * 2.0;
}

/* u8*s8 dot-product peak: 16 independent vpdpbusd chains (register-only). Counts 2 ops
 * per multiply-add: 16 lanes x 4 products x 2 = 128 ops per instruction. */
double cm_probe_int8_loop__avx512(int64_t iterations) {
  __m512i acc[16];
  const __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x01fe01fe);
  for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
  for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], x, y);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[5]), "+v"(acc[10]), "+v"(acc[15]));
  }
  for (int i = 1; i < 16; i++) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
  (void)_mm512_reduce_add_epi32(acc[0]);
  return (double)iterations * 16.0 * 128.0;
}
