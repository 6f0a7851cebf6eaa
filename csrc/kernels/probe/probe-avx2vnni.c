/*
 * Machine-limit probe, AVX-VNNI tier: the int8 peak of the method its INT8 and INT4 kernels
 * run (int8/gemm-avx2vnni.c, int4/gemm-avx2vnni.c), vpdpbusd on ymm: 8 lanes x 4 u8*s8
 * products x 2 ops = 64 ops per instruction, 12 independent chains (probe/chains-avx2.h).
 * The read and FMA probes are the avx2 tier's.
 */
#include <immintrin.h>

#include "common/ukernels.h"
#include "probe/chains-avx2.h" /* CM_CHAINS12 */

volatile double cm_probe_sink_avx2vnni;

double cm_probe_int8_loop__avx2vnni(int64_t iterations) {
  const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2);
  __m256i c0 = x, c1 = x, c2 = x, c3 = x, c4 = x, c5 = x, c6 = x, c7 = x, c8 = x, c9 = x, c10 = x,
          c11 = x;
#define CM_DP(c) _mm256_dpbusd_avx_epi32(c, x, y)
  for (int64_t it = 0; it < iterations; it++) {
    CM_CHAINS12(CM_DP);
  }
#undef CM_DP
  const __m256i sum = _mm256_add_epi32(
      _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                       _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7))),
      _mm256_add_epi32(_mm256_add_epi32(c8, c9), _mm256_add_epi32(c10, c11)));
  unsigned out[8]; /* wrapped lanes: read as unsigned, no signed overflow */
  _mm256_storeu_si256((__m256i *)out, sum);
  cm_probe_sink_avx2vnni = out[0];
  return (double)iterations * 12.0 * 64.0;
}
