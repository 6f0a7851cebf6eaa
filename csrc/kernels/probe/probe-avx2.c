/*
 * Machine-limit probes, AVX2 tier (see probe-avx512.c): 32-byte loads into 8
 * integer adds; 12 independent ymm FMA chains (of 16 registers) for the peak.
 */
#include <immintrin.h>

#include "common/ukernels.h"

double cm_probe_read_chunk__avx2(const void *buffer, size_t bytes) {
  const char *p = (const char *)buffer;
  __m256i s[8];
  for (int i = 0; i < 8; i++) s[i] = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256)
    for (int j = 0; j < 8; j++)
      s[j] = _mm256_add_epi64(s[j], _mm256_loadu_si256((const __m256i *)(p + i + 32 * j)));
  for (int j = 1; j < 8; j++) s[0] = _mm256_add_epi64(s[0], s[j]);
  long long out[4];
  _mm256_storeu_si256((__m256i *)out, s[0]);
  return (double)(out[0] + out[1] + out[2] + out[3]);
}

double cm_probe_fma_loop__avx2(int64_t iterations) {
  __m256 acc[12];
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps((float)i);
  for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
    __asm__ volatile("" : "+x"(acc[0]), "+x"(acc[6]), "+x"(acc[11]));
  }
  float out[8];
  for (int i = 1; i < 12; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  _mm256_storeu_ps(out, acc[0]);
  (void)out[0];
  return (double)iterations * 12.0 * 8.0 * 2.0;
}

/* int8 peak of this tier's exact method (int8/gemm-avx2.c): vpmaddwd + vpaddd chains on
 * int16-widened operands; 8 lanes x 2 products x 2 ops = 32 ops per pair. */
double cm_probe_int8_loop__avx2(int64_t iterations) {
  __m256i acc[12];
  const __m256i x = _mm256_set1_epi16(3), y = _mm256_set1_epi16(-2);
  for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_epi32(i);
  for (int64_t it = 0; it < iterations; it++) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(x, y));
    __asm__ volatile("" : "+x"(acc[0]), "+x"(acc[6]), "+x"(acc[11]));
  }
  int out[8];
  for (int i = 1; i < 12; i++) acc[0] = _mm256_add_epi32(acc[0], acc[i]);
  _mm256_storeu_si256((__m256i *)out, acc[0]);
  (void)out[0];
  return (double)iterations * 12.0 * 32.0;
}
