/*
 * <immintrin.h> of the emulating test build (python tools/build_c_tests.py --emulate).
 *
 * That build compiles the avx2 and avx512 tiers' kernel sources without their ISA flags, with
 * this directory first on their include path: their `#include <immintrin.h>` lands here and
 * gets SIMDe's portable implementations under the Intel names (SIMDE_ENABLE_NATIVE_ALIASES),
 * so a CPU without a tier still runs that tier's code, lane for lane. Below SIMDe come the
 * intrinsics the kernels use that SIMDe 0.8.2 lacks, and the ones it computes differently
 * from the hardware (its fmadd is a multiply then an add, two roundings; every tier's bits
 * rest on one). Each follows the Operation section of Intel's Intrinsics Guide entry of its
 * name; lanes travel through memcpy so that nothing depends on how SIMDe stores a vector.
 * tests/c/emulate/test_shim.c checks them against those statements and, on a CPU that has
 * the instructions, the statements against the hardware. The bf16 intrinsics and AMX (amx.h)
 * rest on the exact models of bf16_amx_model.h, which test_bf16_amx_conformance.c holds to the
 * silicon bit for bit.
 */
#ifndef CPUMOE_TESTS_EMULATE_IMMINTRIN_H
#define CPUMOE_TESTS_EMULATE_IMMINTRIN_H

/* With AVX flags SIMDe would include the real <immintrin.h>, which this file shadows. */
#if defined(__AVX__) || defined(__AVX512F__)
#error "emulated objects are compiled without the tiers' ISA flags (tools/build_c_tests.py)"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h> /* _mm256_cvtph_ps: not pulled in by avx512.h */

#include "bf16_amx_model.h" /* the bf16 instructions' lanes, below */

_Static_assert(sizeof(__m128i) == 16 && sizeof(__m256i) == 32 && sizeof(__m512i) == 64 &&
                   sizeof(__m256) == 32 && sizeof(__m512) == 64 && sizeof(__mmask32) == 4,
               "SIMDe's vector types have the sizes of Intel's");

#define CM_EMU static inline

/* vpmovdw: each dword's low word, in order */
CM_EMU __m256i cm_emu_mm512_cvtepi32_epi16(__m512i a) {
  uint32_t in[16];
  uint16_t out[16];
  memcpy(in, &a, sizeof in);
  for (int j = 0; j < 16; j++) out[j] = (uint16_t)in[j];
  __m256i r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_cvtepi32_epi16(a) cm_emu_mm512_cvtepi32_epi16(a)

/* vpmovzxbd: the 16 bytes of a, zero-extended to dwords */
CM_EMU __m512i cm_emu_mm512_cvtepu8_epi32(__m128i a) {
  uint8_t in[16];
  uint32_t out[16];
  memcpy(in, &a, sizeof in);
  for (int j = 0; j < 16; j++) out[j] = in[j];
  __m512i r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_cvtepu8_epi32(a) cm_emu_mm512_cvtepu8_epi32(a)

/* vpmovzxbw: the 32 bytes of a, zero-extended to words */
CM_EMU __m512i cm_emu_mm512_cvtepu8_epi16(__m256i a) {
  uint8_t in[32];
  uint16_t out[32];
  memcpy(in, &a, sizeof in);
  for (int j = 0; j < 32; j++) out[j] = in[j];
  __m512i r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_cvtepu8_epi16(a) cm_emu_mm512_cvtepu8_epi16(a)

/* vpmulhuw: the high 16 bits of each unsigned word product */
CM_EMU __m512i cm_emu_mm512_mulhi_epu16(__m512i a, __m512i b) {
  uint16_t x[32], y[32], out[32];
  memcpy(x, &a, sizeof x);
  memcpy(y, &b, sizeof y);
  for (int j = 0; j < 32; j++) out[j] = (uint16_t)(((uint32_t)x[j] * y[j]) >> 16);
  __m512i r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_mulhi_epu16(a, b) cm_emu_mm512_mulhi_epu16(a, b)

/* vpcmpeqw into a mask: bit j set when word j of a equals word j of b */
CM_EMU __mmask32 cm_emu_mm512_cmpeq_epi16_mask(__m512i a, __m512i b) {
  uint16_t x[32], y[32];
  memcpy(x, &a, sizeof x);
  memcpy(y, &b, sizeof y);
  uint32_t k = 0;
  for (int j = 0; j < 32; j++) k |= (uint32_t)(x[j] == y[j]) << j;
  return (__mmask32)k;
}
#define _mm512_cmpeq_epi16_mask(a, b) cm_emu_mm512_cmpeq_epi16_mask(a, b)

/* the sum of the 8 qwords, wrapping as the hardware's adds do (unsigned, so no C overflow) */
CM_EMU long long cm_emu_mm512_reduce_add_epi64(__m512i a) {
  uint64_t v[8], sum = 0;
  memcpy(v, &a, sizeof v);
  for (int j = 0; j < 8; j++) sum += v[j];
  long long r;
  memcpy(&r, &sum, sizeof r);
  return r;
}
#define _mm512_reduce_add_epi64(a) cm_emu_mm512_reduce_add_epi64(a)

/* The sum of the 16 floats in the Guide's order, which fixes the rounding: while more than 2
 * lanes are left, lane j += lane j + half, then the last two are added. */
CM_EMU float cm_emu_mm512_reduce_add_ps(__m512 a) {
  float v[16];
  memcpy(v, &a, sizeof v);
  for (int len = 8; len >= 2; len /= 2)
    for (int j = 0; j < len; j++) v[j] = v[j] + v[j + len];
  return v[0] + v[1];
}
#define _mm512_reduce_add_ps(a) cm_emu_mm512_reduce_add_ps(a)

/* vfmadd: a * b + c rounded once (fmaf), where SIMDe's portable path rounds the product
 * first. One body per width; lanes per width are sizeof / 4. */
#define CM_EMU_FMADD_PS(name, type)                                              \
  CM_EMU type name(type a, type b, type c) {                                     \
    float x[sizeof(type) / 4], y[sizeof(type) / 4], z[sizeof(type) / 4];         \
    memcpy(x, &a, sizeof x);                                                     \
    memcpy(y, &b, sizeof y);                                                     \
    memcpy(z, &c, sizeof z);                                                     \
    for (size_t j = 0; j < sizeof(type) / 4; j++) x[j] = fmaf(x[j], y[j], z[j]); \
    type r;                                                                      \
    memcpy(&r, x, sizeof r);                                                     \
    return r;                                                                    \
  }
CM_EMU_FMADD_PS(cm_emu_mm_fmadd_ps, __m128)
CM_EMU_FMADD_PS(cm_emu_mm256_fmadd_ps, __m256)
CM_EMU_FMADD_PS(cm_emu_mm512_fmadd_ps, __m512)
#undef CM_EMU_FMADD_PS
#undef _mm_fmadd_ps
#undef _mm256_fmadd_ps
#undef _mm512_fmadd_ps
#define _mm_fmadd_ps(a, b, c) cm_emu_mm_fmadd_ps(a, b, c)
#define _mm256_fmadd_ps(a, b, c) cm_emu_mm256_fmadd_ps(a, b, c)
#define _mm512_fmadd_ps(a, b, c) cm_emu_mm512_fmadd_ps(a, b, c)

/* bf16 (AVX512_BF16). SIMDe 0.8.2's _mm512_dpbf16_ps adds the even product first, with no
 * DAZ or FTZ; the hardware adds the odd one first and flushes (bf16_amx_model.h, and
 * test_bf16_amx_conformance.c, which holds that model to the instruction bit for bit). SIMDe
 * has none of the conversions. */
_Static_assert(sizeof(__m512bh) == 64 && sizeof(__m256bh) == 32, "SIMDe's bf16 vectors");
CM_EMU __m512 cm_emu_mm512_dpbf16_lanes(__m512 src, __m512bh a, __m512bh b, uint32_t k,
                                        int zero_masked) {
  uint32_t acc[16], x[16], y[16];
  memcpy(acc, &src, sizeof acc);
  memcpy(x, &a, sizeof x);
  memcpy(y, &b, sizeof y);
  for (int j = 0; j < 16; j++) {
    if (k >> j & 1)
      acc[j] = cm_dpbf16_lane(acc[j], x[j], y[j]);
    else if (zero_masked)
      acc[j] = 0;
  }
  __m512 r;
  memcpy(&r, acc, sizeof r);
  return r;
}
#undef _mm512_dpbf16_ps
#undef _mm512_mask_dpbf16_ps
#undef _mm512_maskz_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) cm_emu_mm512_dpbf16_lanes(src, a, b, 0xffffu, 0)
#define _mm512_mask_dpbf16_ps(src, k, a, b) cm_emu_mm512_dpbf16_lanes(src, a, b, k, 0)
#define _mm512_maskz_dpbf16_ps(k, src, a, b) cm_emu_mm512_dpbf16_lanes(src, a, b, k, 1)

/* vcvtne2ps2bf16: words 0-15 from b, 16-31 from a (the instruction's second source is low) */
CM_EMU __m512bh cm_emu_mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
  uint32_t hi[16], lo[16];
  uint16_t out[32];
  memcpy(hi, &a, sizeof hi);
  memcpy(lo, &b, sizeof lo);
  for (int j = 0; j < 16; j++) {
    out[j] = cm_cvtne_f32_bf16(lo[j]);
    out[j + 16] = cm_cvtne_f32_bf16(hi[j]);
  }
  __m512bh r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_cvtne2ps_pbh(a, b) cm_emu_mm512_cvtne2ps_pbh(a, b)

CM_EMU __m256bh cm_emu_mm512_cvtneps_pbh(__m512 a) {
  uint32_t in[16];
  uint16_t out[16];
  memcpy(in, &a, sizeof in);
  for (int j = 0; j < 16; j++) out[j] = cm_cvtne_f32_bf16(in[j]);
  __m256bh r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_cvtneps_pbh(a) cm_emu_mm512_cvtneps_pbh(a)

/* bf16 to fp32 is exact (a shift; compilers emit vpslld, no DAZ) */
CM_EMU __m512 cm_emu_mm512_cvtpbh_ps(__m256bh a) {
  uint16_t in[16];
  uint32_t out[16];
  memcpy(in, &a, sizeof in);
  for (int j = 0; j < 16; j++) out[j] = cm_bf16_widen(in[j]);
  __m512 r;
  memcpy(&r, out, sizeof r);
  return r;
}
#define _mm512_cvtpbh_ps(a) cm_emu_mm512_cvtpbh_ps(a)

/* AVX-VNNI's vpdpbusd (VEX): the same lanes as AVX512-VNNI's 256-bit form, which SIMDe has */
#define _mm256_dpbusd_avx_epi32(src, a, b) simde_mm256_dpbusd_epi32(src, a, b)

/* AMX, as GCC's <immintrin.h> has it */
#include "amx.h"

#undef CM_EMU
#endif /* CPUMOE_TESTS_EMULATE_IMMINTRIN_H */
