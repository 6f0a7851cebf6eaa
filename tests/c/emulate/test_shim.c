/*
 * Checks the intrinsics that tests/c/emulate/immintrin.h adds to SIMDe against plain-C
 * statements of Intel's documented semantics (the Intrinsics Guide's Operation sections),
 * on random inputs and on the inputs where a wrong reading would show (a product whose
 * rounding an unfused multiply-add loses, lanes whose sum depends on the order). The bf16
 * intrinsics are checked lane for lane against bf16_amx_model.h (itself held to the silicon
 * by test_bf16_amx_conformance.c), and, emulated only, the AMX names of amx.h against a plain
 * statement of the int8 tile products.
 *
 * Built twice by python tools/build_c_tests.py --emulate:
 *   with CM_PORTABLE_INTRINSICS, through the shim: the shim against the statements;
 *   without, against the compiler's <immintrin.h>: the statements against the hardware,
 *   on a CPU with AVX-512 (elsewhere it says so and passes: there is nothing to compare).
 * Prints one line (and one more where the CPU lacks AVX512_BF16); exits 1 when a check failed.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* the bf16 statements: exact models, held to the silicon by test_bf16_amx_conformance.c */
#include "bf16_amx_model.h"

#ifdef CM_PORTABLE_INTRINSICS
#define CM_TARGET static
#define CM_TARGET_BF16 static
#define CM_TARGET_AVXVNNI static
#define VARIANT "emulated"
#else
/* only these functions use the instructions, so the rest runs on any x86-64 */
#define CM_TARGET static __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq")))
#define CM_TARGET_BF16 static __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define CM_TARGET_AVXVNNI static __attribute__((target("avx2,avxvnni")))
#define VARIANT "native"
#endif

static int g_checks, g_failures;

static void check(int ok, const char *what, int trial) {
  g_checks++;
  if (ok) return;
  if (++g_failures <= 20) fprintf(stderr, "FAIL: %s (trial %d)\n", what, trial);
}

static uint64_t g_rng = 0x243f6a8885a308d3u;
static uint64_t rnd(void) { /* splitmix64 */
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}
static void rnd_bytes(void *p, size_t n) {
  for (size_t i = 0; i < n; i++) ((unsigned char *)p)[i] = (unsigned char)rnd();
}
/* finite floats over many binades, both signs */
static float rnd_float(void) {
  return ldexpf((float)(rnd() >> 40) * 0x1p-24f, (int)(rnd() % 40) - 20) *
         ((rnd() & 1) ? -1.0f : 1.0f);
}

enum { TRIALS = 200 };

CM_TARGET void test_conversions(void) {
  for (int t = 0; t < TRIALS; t++) {
    uint8_t bytes[64];
    rnd_bytes(bytes, sizeof bytes);

    uint32_t d[16];
    uint16_t w[16], wide[32];
    memcpy(d, bytes, 64);
    __m256i r256;
    __m512i r512;
    r256 = _mm512_cvtepi32_epi16(_mm512_loadu_si512(bytes));
    memcpy(w, &r256, 32);
    int ok = 1;
    for (int j = 0; j < 16; j++) ok &= w[j] == (uint16_t)(d[j] & 0xffff);
    check(ok, "_mm512_cvtepi32_epi16: dword j's low word", t);

    r512 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    memcpy(d, &r512, 64);
    ok = 1;
    for (int j = 0; j < 16; j++) ok &= d[j] == bytes[j];
    check(ok, "_mm512_cvtepu8_epi32: byte j zero-extended", t);

    r512 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)bytes));
    memcpy(wide, &r512, 64);
    ok = 1;
    for (int j = 0; j < 32; j++) ok &= wide[j] == bytes[j];
    check(ok, "_mm512_cvtepu8_epi16: byte j zero-extended", t);

    uint16_t x[32], y[32], hi[32];
    rnd_bytes(x, sizeof x);
    rnd_bytes(y, sizeof y);
    if (t == 0) x[0] = y[0] = 0xffff; /* the largest product */
    r512 = _mm512_mulhi_epu16(_mm512_loadu_si512(x), _mm512_loadu_si512(y));
    memcpy(hi, &r512, 64);
    ok = 1;
    for (int j = 0; j < 32; j++) ok &= hi[j] == (uint16_t)(((uint32_t)x[j] * y[j]) >> 16);
    check(ok, "_mm512_mulhi_epu16: high word of the unsigned product", t);
  }
}

CM_TARGET void test_compare_and_reduce(void) {
  for (int t = 0; t < TRIALS; t++) {
    uint16_t a[32], b[32];
    rnd_bytes(a, sizeof a);
    memcpy(b, a, sizeof b);
    for (int j = 0; j < 32; j++) /* about half the words differ, in one bit or many */
      if (rnd() & 1) b[j] ^= (rnd() & 1) ? (uint16_t)(1u << (rnd() % 16)) : (uint16_t)(rnd() | 1);
    uint32_t want = 0;
    for (int j = 0; j < 32; j++) want |= (uint32_t)(a[j] == b[j]) << j;
    const __mmask32 got = _mm512_cmpeq_epi16_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
    check((uint32_t)got == want, "_mm512_cmpeq_epi16_mask: bit j = (word j equal)", t);

    /* lanes of either sign; in the shim's variant also big enough that the sum wraps (the
     * compiler's header adds them as signed C integers, so there a wrap is undefined) */
#ifdef CM_PORTABLE_INTRINSICS
    const int shift = t & 1 ? 0 : 5;
#else
    const int shift = 5;
#endif
    uint64_t q[8], sum = 0;
    for (int j = 0; j < 8; j++) {
      const uint64_t m = rnd() >> shift;
      sum += q[j] = (rnd() & 1) ? m : ~m + 1; /* ~m + 1: -m modulo 2^64 */
    }
    const long long total = _mm512_reduce_add_epi64(_mm512_loadu_si512(q));
    uint64_t total_bits;
    memcpy(&total_bits, &total, 8);
    check(total_bits == sum, "_mm512_reduce_add_epi64: wrapping sum", t);

    float f[16];
    for (int j = 0; j < 16; j++) f[j] = rnd_float();
    float v[16];
    memcpy(v, f, sizeof v); /* the Guide's order: halves added lane by lane, then the pair */
    for (int len = 8; len >= 2; len /= 2)
      for (int j = 0; j < len; j++) v[j] += v[j + len];
    const float want_sum = v[0] + v[1], got_sum = _mm512_reduce_add_ps(_mm512_loadu_ps(f));
    check(memcmp(&want_sum, &got_sum, 4) == 0, "_mm512_reduce_add_ps: the Guide's order", t);
  }
  /* left to right the 1s vanish against 2^30 (sum 2); in the Guide's order 2^30 and -2^30
   * meet first (sum 4) */
  float f[16] = {0x1p30f, 1.0f, 1.0f, 0, 0, 0, 0, 0, -0x1p30f, 1.0f, 1.0f};
  const float got = _mm512_reduce_add_ps(_mm512_loadu_ps(f));
  check(got == 4.0f, "_mm512_reduce_add_ps: 2^30 and -2^30 meet first", 0);
}

/* vpdpbusd: each dword lane of src plus the four products of a's unsigned bytes with b's
 * signed bytes of that lane, wrapping at 32 bits (no saturation) */
CM_TARGET_AVXVNNI void test_dpbusd_avx(void) {
  for (int t = 0; t < TRIALS; t++) {
    uint8_t a[32], b[32];
    uint32_t src[8], got[8];
    rnd_bytes(a, sizeof a), rnd_bytes(b, sizeof b), rnd_bytes(src, sizeof src);
    if (t == 0) memset(a, 255, sizeof a), memset(b, 0x80, sizeof b); /* 4 x 255 x -128 */
    const __m256i r = _mm256_dpbusd_avx_epi32(_mm256_loadu_si256((const __m256i *)src),
                                              _mm256_loadu_si256((const __m256i *)a),
                                              _mm256_loadu_si256((const __m256i *)b));
    memcpy(got, &r, sizeof got);
    int ok = 1;
    for (int j = 0; j < 8; j++) {
      uint32_t want = src[j];
      for (int i = 4 * j; i < 4 * j + 4; i++) want += (uint32_t)((int32_t)a[i] * (int8_t)b[i]);
      ok &= got[j] == want;
    }
    check(ok, "_mm256_dpbusd_avx_epi32: u8 x s8 quads added to each dword, wrapping", t);
  }
}

CM_TARGET void test_fmadd(void) {
  for (int t = 0; t < TRIALS + 1; t++) {
    float a[16], b[16], c[16], want[16], got[16];
    for (int j = 0; j < 16; j++) {
      a[j] = rnd_float(), b[j] = rnd_float();
      /* c near -a*b, where the product's rounding decides the result */
      c[j] = (rnd() & 1) ? -(a[j] * b[j]) : rnd_float();
      if (t == TRIALS) /* (1 + 2^-20)^2 - (1 + 2^-19) = 2^-40 fused, 0 unfused */
        a[j] = b[j] = 1.0f + 0x1p-20f, c[j] = -(1.0f + 0x1p-19f);
      want[j] = fmaf(a[j], b[j], c[j]);
    }
    const __m512 r512 = _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b), _mm512_loadu_ps(c));
    memcpy(got, &r512, 64);
    check(memcmp(got, want, 64) == 0, "_mm512_fmadd_ps: one rounding", t);
    const __m256 r256 = _mm256_fmadd_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b), _mm256_loadu_ps(c));
    memcpy(got, &r256, 32);
    check(memcmp(got, want, 32) == 0, "_mm256_fmadd_ps: one rounding", t);
    const __m128 r128 = _mm_fmadd_ps(_mm_loadu_ps(a), _mm_loadu_ps(b), _mm_loadu_ps(c));
    memcpy(got, &r128, 16);
    check(memcmp(got, want, 16) == 0, "_mm_fmadd_ps: one rounding", t);
  }
}

/* the bf16 intrinsics, lane for lane and mask bit for mask bit, against the models; fp32
 * lanes of every kind (denormals, NaNs), bf16 of every bit pattern */
CM_TARGET_BF16 void test_bf16(void) {
  for (int t = 0; t < TRIALS; t++) {
    uint32_t acc[16], a[16], b[16], out[16];
    uint16_t h[32];
    rnd_bytes(a, sizeof a);
    rnd_bytes(b, sizeof b);
    rnd_bytes(acc, sizeof acc);
    for (int j = 0; j < 16; j++) /* half the accumulators moderate, so sums do not saturate */
      if (j % 2) acc[j] = (acc[j] & 0x807fffffu) | (uint32_t)(110 + rnd() % 40) << 23;
    const uint16_t k = (uint16_t)rnd();
    __m512bh x, y;
    memcpy(&x, a, 64);
    memcpy(&y, b, 64);
    const __m512 c = _mm512_loadu_ps((const float *)acc);
    __m512 r = _mm512_dpbf16_ps(c, x, y);
    memcpy(out, &r, 64);
    int ok = 1;
    for (int j = 0; j < 16; j++) ok &= out[j] == cm_dpbf16_lane(acc[j], a[j], b[j]);
    check(ok, "_mm512_dpbf16_ps: odd pair first, DAZ, FTZ", t);
    r = _mm512_mask_dpbf16_ps(c, k, x, y);
    memcpy(out, &r, 64);
    ok = 1;
    for (int j = 0; j < 16; j++)
      ok &= out[j] == (k >> j & 1 ? cm_dpbf16_lane(acc[j], a[j], b[j]) : acc[j]);
    check(ok, "_mm512_mask_dpbf16_ps: unmasked lanes keep src", t);
    r = _mm512_maskz_dpbf16_ps(k, c, x, y);
    memcpy(out, &r, 64);
    ok = 1;
    for (int j = 0; j < 16; j++)
      ok &= out[j] == (k >> j & 1 ? cm_dpbf16_lane(acc[j], a[j], b[j]) : 0);
    check(ok, "_mm512_maskz_dpbf16_ps: unmasked lanes zero", t);

    const __m512bh two =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps((const float *)a), _mm512_loadu_ps((const float *)b));
    memcpy(h, &two, 64);
    ok = 1;
    for (int j = 0; j < 16; j++)
      ok &= h[j] == cm_cvtne_f32_bf16(b[j]) && h[j + 16] == cm_cvtne_f32_bf16(a[j]);
    check(ok, "_mm512_cvtne2ps_pbh: b's lanes low, a's high, RNE", t);
    const __m256bh one = _mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)a));
    memcpy(h, &one, 32);
    ok = 1;
    for (int j = 0; j < 16; j++) ok &= h[j] == cm_cvtne_f32_bf16(a[j]);
    check(ok, "_mm512_cvtneps_pbh: RNE", t);
    r = _mm512_cvtpbh_ps(one);
    memcpy(out, &r, 64);
    ok = 1;
    for (int j = 0; j < 16; j++) ok &= out[j] == cm_bf16_widen(h[j]);
    check(ok, "_mm512_cvtpbh_ps: the upper half of an fp32", t);
  }
}

#ifdef CM_PORTABLE_INTRINSICS
/* The AMX names of amx.h (immediates, strides, the letters' signedness) against a plain
 * statement of the int8 dot products; the model itself is held to the silicon by
 * test_bf16_amx_conformance.c. */
static void test_amx_names(void) {
  for (int t = 0; t < TRIALS / 10; t++) {
    const int M = 1 + (int)(rnd() % 16), N = 1 + (int)(rnd() % 16), K = 1 + (int)(rnd() % 16);
    uint8_t cfg[64] = {1}, a[16][80], b[16][80];
    uint32_t c[16][20], out[16][20], want[16][20];
    rnd_bytes(a, sizeof a), rnd_bytes(b, sizeof b), rnd_bytes(c, sizeof c);
    cfg[16 + 2 * 5] = cfg[16 + 2 * 7] = (uint8_t)(4 * N), cfg[16 + 2 * 2] = (uint8_t)(4 * K);
    cfg[48 + 5] = cfg[48 + 2] = (uint8_t)M, cfg[48 + 7] = (uint8_t)K;
    for (int variant = 0; variant < 2; variant++) {
      _tile_loadconfig(cfg);
      _tile_loadd(5, c, sizeof c[0]);
      _tile_loadd(2, a, sizeof a[0]);
      _tile_loadd(7, b, sizeof b[0]);
      if (variant)
        _tile_dpbssd(5, 2, 7);
      else
        _tile_dpbusd(5, 2, 7);
      _tile_stored(5, out, sizeof out[0]);
      _tile_release();
      int ok = 1;
      for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
          uint32_t sum = c[m][n];
          for (int q = 0; q < 4 * K; q++) {
            const int x = variant && a[m][q] > 127 ? a[m][q] - 256 : a[m][q];
            const int y = b[q / 4][4 * n + q % 4] > 127 ? b[q / 4][4 * n + q % 4] - 256
                                                        : b[q / 4][4 * n + q % 4];
            sum += (uint32_t)(x * y);
          }
          want[m][n] = sum;
          ok &= out[m][n] == want[m][n];
        }
      check(ok,
            variant ? "_tile_dpbssd: signed x signed, wrapping"
                    : "_tile_dpbusd: unsigned x signed, wrapping",
            t);
    }
  }
}
#endif

int main(void) {
#ifndef CM_PORTABLE_INTRINSICS
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("fma")) {
    printf("shim test (native): no AVX-512 here, the statements are checked on CPUs with it\n");
    return 0;
  }
#endif
  test_conversions();
  test_compare_and_reduce();
  test_fmadd();
#ifdef CM_PORTABLE_INTRINSICS
  test_bf16();
  test_amx_names();
  test_dpbusd_avx();
#else
  if (__builtin_cpu_supports("avxvnni"))
    test_dpbusd_avx();
  else
    printf("shim test (native): no AVX-VNNI here, its statement is not checked\n");
  unsigned eax, ebx, ecx, edx; /* AVX512_BF16: CPUID.(7,1):EAX[5] */
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 5 & 1))
    test_bf16();
  else
    printf("shim test (native): no AVX512_BF16 here, its statements are not checked\n");
#endif
  printf("shim test (" VARIANT "): %d checks, %d failed\n", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
