/*
 * 12 independent ymm chains for the 256-bit peak loops (probe-avx2.c, probe-avx2vnni.c): the
 * accumulators c0..c11 are named variables held in registers behind an empty asm, so each
 * step of a chain is one instruction on a register. Include only from files compiled with
 * the avx2 tier's flags (or more).
 */
#ifndef CPUMOE_PROBE_CHAINS_AVX2_H
#define CPUMOE_PROBE_CHAINS_AVX2_H

#ifdef CM_PORTABLE_INTRINSICS
/* The emulating test build (tools/build_c_tests.py): its vectors live in memory, not in ymm
 * registers, and its intrinsics layer cannot run asm; the sink still uses every chain. */
#define CM_KEEP_IN_REGISTERS12()
#else
/* asm: an empty asm that takes and gives back each accumulator keeps it in its own register */
#define CM_KEEP_IN_REGISTERS12()                                                     \
  __asm__ volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5)); \
  __asm__ volatile("" : "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9), "+x"(c10), "+x"(c11))
#endif

#define CM_CHAINS12(OP)                                                                      \
  c0 = OP(c0), c1 = OP(c1), c2 = OP(c2), c3 = OP(c3), c4 = OP(c4), c5 = OP(c5), c6 = OP(c6), \
  c7 = OP(c7), c8 = OP(c8), c9 = OP(c9), c10 = OP(c10), c11 = OP(c11);                       \
  CM_KEEP_IN_REGISTERS12()

#endif /* CPUMOE_PROBE_CHAINS_AVX2_H */
