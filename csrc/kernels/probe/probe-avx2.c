/*
 * Machine-limit probes, AVX2 tier (see probe-avx512.c): 32-byte loads into 8 integer
 * adds; 12 independent ymm chains (of 16 registers, probe/chains-avx2.h) for the FMA, int8
 * and int4 peaks.
 */
#include <immintrin.h>

#include "common/ukernels.h"

volatile double cm_probe_sink_avx2;

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

#include "probe/chains-avx2.h" /* CM_CHAINS12 */

double cm_probe_fma_loop__avx2(int64_t iterations) {
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  __m256 c0 = x, c1 = x, c2 = x, c3 = x, c4 = x, c5 = x, c6 = x, c7 = x, c8 = x, c9 = x, c10 = x,
         c11 = x;
#define CM_FMA(c) _mm256_fmadd_ps(c, x, y)
  for (int64_t it = 0; it < iterations; it++) {
    CM_CHAINS12(CM_FMA);
  }
#undef CM_FMA
  const __m256 sum =
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                                  _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7))),
                    _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
  float out[8];
  _mm256_storeu_ps(out, sum);
  cm_probe_sink_avx2 = out[0];
  return (double)iterations * 12.0 * 8.0 * 2.0;
}

/* the integer chains' sum into the sink, so the loops are not dropped */
static void sink_int_chains(__m256i c0, __m256i c1, __m256i c2, __m256i c3, __m256i c4, __m256i c5,
                            __m256i c6, __m256i c7, __m256i c8, __m256i c9, __m256i c10,
                            __m256i c11) {
  const __m256i sum = _mm256_add_epi32(
      _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                       _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7))),
      _mm256_add_epi32(_mm256_add_epi32(c8, c9), _mm256_add_epi32(c10, c11)));
  int out[8];
  _mm256_storeu_si256((__m256i *)out, sum);
  cm_probe_sink_avx2 = out[0];
}

/* int8 peak of this tier's exact method (schemes/int8/gemm-avx2.c): vpmaddwd + vpaddd on
 * int16-widened operands; 8 lanes x 2 products x 2 ops = 32 ops per pair. */
double cm_probe_int8_loop__avx2(int64_t iterations) {
  const __m256i x = _mm256_set1_epi16(3), y = _mm256_set1_epi16(-2);
  __m256i c0 = x, c1 = x, c2 = x, c3 = x, c4 = x, c5 = x, c6 = x, c7 = x, c8 = x, c9 = x, c10 = x,
          c11 = x;
#define CM_MADD(c) _mm256_add_epi32(c, _mm256_madd_epi16(c, y)) /* depends on c: not hoisted */
  for (int64_t it = 0; it < iterations; it++) {
    CM_CHAINS12(CM_MADD);
  }
#undef CM_MADD
  sink_int_chains(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11);
  return (double)iterations * 12.0 * 32.0;
}

/* int4 peak of this tier's exact method (schemes/int4/gemm-avx2.c): vpmaddubsw of nibbles
 * (unsigned) by s8 activations + vpaddw into int16, and per CM_INT4_I16_QUADS = 8 of those one
 * vpmaddwd with ones + vpaddd widening the sums to int32. Only the products count: 16 lanes x
 * 2 products x 2 ops = 64 ops per vpmaddubsw. The values are meaningless (the int16 sums are
 * read back as bytes and as int32); the instruction mix and its dependencies are the kernel's. */
double cm_probe_int4_loop__avx2(int64_t iterations) {
  const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  __m256i c0 = x, c1 = x, c2 = x, c3 = x, c4 = x, c5 = x, c6 = x, c7 = x, c8 = x, c9 = x, c10 = x,
          c11 = x;
#define CM_MADDUBS(c) _mm256_add_epi16(c, _mm256_maddubs_epi16(c, y)) /* depends on c */
#define CM_WIDEN(c) _mm256_add_epi32(c, _mm256_madd_epi16(c, ones))
  for (int64_t it = 0; it < iterations; it++) {
    for (int q = 0; q < 8; q++) {
      CM_CHAINS12(CM_MADDUBS);
    }
    CM_CHAINS12(CM_WIDEN);
  }
#undef CM_WIDEN
#undef CM_MADDUBS
  sink_int_chains(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11);
  return (double)iterations * 12.0 * 8.0 * 64.0;
}
