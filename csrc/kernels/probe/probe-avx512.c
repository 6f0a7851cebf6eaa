/*
 * Machine-limit probes for the benchmark's roofline, AVX-512 tier.
 *   read: streams a buffer with 64-byte loads into 8 independent integer adds
 *         (no FP latency in the way), so DRAM or cache bandwidth is the limit.
 *   fma:  16 independent zmm FMA chains, register-only: 16 chains x 4-cycle
 *         latency covers 2 FMA ports with room to spare, so this is the fp32 peak.
 *   int8: 16 independent vpdpbusd chains: the u8*s8 dot-product peak.
 * The accumulators are named variables (not an array) and pass through an empty asm
 * each iteration, so they stay in registers and no chain can be optimized away.
 */
#include <immintrin.h>

#include "common/ukernels.h"

volatile double cm_probe_sink_avx512;

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

#ifdef CM_PORTABLE_INTRINSICS
/* The emulating test build (tools/build_c_tests.py): its vectors live in memory, not in zmm
 * registers, and its intrinsics layer cannot run asm; the sink still uses every chain. */
#define CM_KEEP_IN_REGISTERS16()
#else
/* asm: an empty asm that takes and gives back each accumulator keeps it in its own register */
#define CM_KEEP_IN_REGISTERS16()                                                                \
  __asm__ volatile(""                                                                           \
                   : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6),      \
                     "+v"(c7));                                                                 \
  __asm__ volatile(""                                                                           \
                   : "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11), "+v"(c12), "+v"(c13), "+v"(c14), \
                     "+v"(c15))
#endif

/* 16 chains: c0..c15 = OP(c_i); then a register barrier on all of them */
#define CM_CHAINS16(OP)                                                                      \
  c0 = OP(c0), c1 = OP(c1), c2 = OP(c2), c3 = OP(c3), c4 = OP(c4), c5 = OP(c5), c6 = OP(c6), \
  c7 = OP(c7), c8 = OP(c8), c9 = OP(c9), c10 = OP(c10), c11 = OP(c11), c12 = OP(c12),        \
  c13 = OP(c13), c14 = OP(c14), c15 = OP(c15);                                               \
  CM_KEEP_IN_REGISTERS16()

double cm_probe_fma_loop__avx512(int64_t iterations) {
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  __m512 c0 = x, c1 = x, c2 = x, c3 = x, c4 = x, c5 = x, c6 = x, c7 = x, c8 = x, c9 = x, c10 = x,
         c11 = x, c12 = x, c13 = x, c14 = x, c15 = x;
#define CM_FMA(c) _mm512_fmadd_ps(c, x, y)
  for (int64_t it = 0; it < iterations; it++) {
    CM_CHAINS16(CM_FMA);
  }
#undef CM_FMA
  const __m512 sum =
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                                  _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
                    _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)),
                                  _mm512_add_ps(_mm512_add_ps(c12, c13), _mm512_add_ps(c14, c15))));
  cm_probe_sink_avx512 = _mm512_reduce_add_ps(sum);
  return (double)iterations * 16.0 * 16.0 * 2.0;
}

/* Counts 2 ops per multiply-add: 16 lanes x 4 products x 2 = 128 ops per vpdpbusd. */
double cm_probe_int8_loop__avx512(int64_t iterations) {
  const __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x01fe01fe);
  __m512i c0 = x, c1 = x, c2 = x, c3 = x, c4 = x, c5 = x, c6 = x, c7 = x, c8 = x, c9 = x, c10 = x,
          c11 = x, c12 = x, c13 = x, c14 = x, c15 = x;
#define CM_DP(c) _mm512_dpbusd_epi32(c, x, y)
  for (int64_t it = 0; it < iterations; it++) {
    CM_CHAINS16(CM_DP);
  }
#undef CM_DP
  const __m512i sum = _mm512_add_epi32(
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                       _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7))),
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)),
                       _mm512_add_epi32(_mm512_add_epi32(c12, c13), _mm512_add_epi32(c14, c15))));
  /* one lane is enough to keep the chains live; _mm512_reduce_add_epi32 would add the
   * wrapped int32 lanes as signed C ints (undefined behaviour) */
  cm_probe_sink_avx512 = _mm_cvtsi128_si32(_mm512_castsi512_si128(sum));
  return (double)iterations * 16.0 * 128.0;
}
