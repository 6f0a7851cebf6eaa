/*
 * Holds the models of tests/c/emulate/bf16_amx_model.h to the instructions, bit for bit, on a
 * CPU that has them (AVX512_BF16; AMX-TILE, AMX-BF16, AMX-INT8): vdpbf16ps (plain, masked,
 * zero-masked), vcvtne2ps2bf16, vcvtneps2bf16, and the tile unit (ldtilecfg, tileloadd,
 * tilestored, tilezero, tdpbf16ps, tdpb[su][su]d). Inputs are chosen where a wrong reading of
 * the SDM would show: the order of the pair, two roundings against one, denormals in each
 * input (DAZ) and in results (FTZ, at the tininess boundary too), infinities and NaNs in each
 * position, every tile shape, strides, int8 extremes whose sums wrap; then random bulk (a few
 * million lanes), and the bulk again with MXCSR set to flush, treat denormals as zero and
 * round toward zero, which the SDM says these instructions ignore. The wrong readings are
 * run too and must differ from the hardware on these inputs (else the inputs show nothing).
 * Configurations and shapes that fault on hardware must make the model refuse (the model's
 * fault hook) and the hardware fault (in a child process).
 *
 * Built by python tools/build_c_tests.py at baseline x86-64 flags; only the functions that run
 * the instructions name them in a target attribute, so the program starts on any x86-64 CPU and
 * says what it skipped where the CPU or the OS lacks a feature (exit 0: nothing to compare).
 * Prints one line per instruction, "conformance <instr>: <N> cases, <F> mismatches", the first
 * mismatches in hex; exits 1 when anything mismatched.
 */
#define _GNU_SOURCE /* syscall() */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* The model's faults come back here, so that a test can see that it refused. */
static jmp_buf g_fault_jump;
static int g_fault_armed;
static const char *g_fault_message;
static _Noreturn void test_fault(const char *message) {
  if (!g_fault_armed) {
    fprintf(stderr, "amx model: unexpected fault: %s\n", message);
    abort();
  }
  g_fault_message = message;
  longjmp(g_fault_jump, 1);
}
#define CM_AMX_FAULT(message) test_fault(message)
#include "bf16_amx_model.h"

#define BF16_TARGET __attribute__((target("avx512f,avx512bf16"), noinline))
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8"), noinline))

/* ---- random inputs ------------------------------------------------------------------------ */

static uint64_t g_rng = 0x9e3779b97f4a7c15u;
static uint64_t rnd(void) { /* splitmix64 */
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

/* An fp32 pattern with exponent in [lo, hi] (biased), random sign and mantissa. */
static uint32_t f32_in(int lo, int hi) {
  const uint32_t e = (uint32_t)(lo + (int)(rnd() % (uint64_t)(hi - lo + 1)));
  return (uint32_t)(rnd() & 0x807fffffu) | e << 23;
}
/* Mostly values near 1 whose sums round, some near the bottom of the range, some zeros and
 * denormals, some any bit pattern (infinities, NaNs). */
static uint32_t f32_mix(void) {
  const unsigned kind = (unsigned)(rnd() % 20);
  if (kind < 13) return f32_in(127 - 12, 127 + 12);
  if (kind < 16) return f32_in(1, 40);
  if (kind < 18) return f32_in(0, 0);
  return (uint32_t)rnd();
}
static uint16_t bf16_mix(void) {
  const unsigned kind = (unsigned)(rnd() % 20);
  if (kind < 13) return (uint16_t)(f32_in(127 - 6, 127 + 6) >> 16);
  if (kind < 16) return (uint16_t)(f32_in(1, 70) >> 16); /* products near 2^-126 */
  if (kind < 18) return (uint16_t)(f32_in(0, 0) >> 16);
  return (uint16_t)rnd();
}
static uint32_t pair(uint16_t lo, uint16_t hi) {
  return (uint32_t)hi << 16 | lo;
}
static uint16_t bf16_of(float f) {
  return (uint16_t)(cm_f32_bits(f) >> 16);
}

/* ---- results -------------------------------------------------------------------------------- */

static int g_failed;
struct tally {
  const char *name;
  long cases, mismatches;
};
static void report(const struct tally *t) {
  printf("conformance %s: %ld cases, %ld mismatches\n", t->name, t->cases, t->mismatches);
  g_failed |= t->mismatches != 0;
}
/* A reading of the SDM that the silicon does not follow must differ from it somewhere here. */
static void report_wrong_reading(const char *reading, long cases, long differ) {
  printf("  wrong reading (%s): differs from the hardware in %ld of %ld cases%s\n", reading, differ,
         cases, differ ? "" : "  <- FAIL: these inputs cannot tell it apart");
  g_failed |= differ == 0;
}

/* ---- vdpbf16ps ---------------------------------------------------------------------------- */

/* n lanes (a multiple of 16), under the given MXCSR; merge- and zero-masked with k when
 * mode is 1 or 2. */
BF16_TARGET static void native_dpbf16(uint32_t *out, const uint32_t *acc, const uint32_t *a,
                                      const uint32_t *b, size_t n, unsigned mxcsr, int mode,
                                      const uint16_t *k) {
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(mxcsr);
  for (size_t i = 0; i < n; i += 16) {
    const __m512 c = _mm512_loadu_ps(acc + i);
    const __m512bh x = (__m512bh)_mm512_loadu_si512(a + i);
    const __m512bh y = (__m512bh)_mm512_loadu_si512(b + i);
    __m512 r;
    if (mode == 1)
      r = _mm512_mask_dpbf16_ps(c, k[i / 16], x, y);
    else if (mode == 2)
      r = _mm512_maskz_dpbf16_ps(k[i / 16], c, x, y);
    else
      r = _mm512_dpbf16_ps(c, x, y);
    _mm512_storeu_ps(out + i, r);
  }
  _mm_setcsr(saved);
}

enum { LANES_MAX = 1 << 16 };
static uint32_t g_acc[LANES_MAX], g_a[LANES_MAX], g_b[LANES_MAX], g_hw[LANES_MAX];
static uint16_t g_k[LANES_MAX / 16];

static uint32_t swap_pair(uint32_t p) {
  return p << 16 | p >> 16;
}

/* The same lanes with the pairs swapped: the even product first (SIMDe's order). */
static uint32_t even_first(uint32_t acc, uint32_t a, uint32_t b) {
  return cm_dpbf16_lane(acc, swap_pair(a), swap_pair(b));
}
/* acc + p1 + p0 rounded once: exact in double for the inputs that use it (below). */
static uint32_t one_rounding(uint32_t acc, uint32_t a, uint32_t b) {
  const double s = (double)cm_daz(acc) + (double)cm_daz(a & 0xffff0000u) * cm_daz(b & 0xffff0000u) +
                   (double)cm_daz(a << 16) * cm_daz(b << 16);
  return cm_f32_bits((float)s);
}

/* Runs lanes [0, n) natively and through the model; counts into t, prints the first
 * mismatches. wrong: a reading to count differences from the hardware with (or NULL). */
static long g_wrong_differ, g_wrong_cases;
static void run_dpbf16(struct tally *t, size_t n, unsigned mxcsr, int mode,
                       uint32_t (*wrong)(uint32_t, uint32_t, uint32_t)) {
  native_dpbf16(g_hw, g_acc, g_a, g_b, n, mxcsr, mode, g_k);
  for (size_t i = 0; i < n; i++) {
    const int on = mode == 0 || (g_k[i / 16] >> (i % 16) & 1);
    const uint32_t want = on ? cm_dpbf16_lane(g_acc[i], g_a[i], g_b[i]) : mode == 2 ? 0 : g_acc[i];
    t->cases++;
    if (want != g_hw[i] && ++t->mismatches <= 8)
      printf("  acc %08x a %08x b %08x (mxcsr %04x mode %d): hardware %08x model %08x\n", g_acc[i],
             g_a[i], g_b[i], mxcsr, mode, g_hw[i], want);
    if (wrong && on) {
      g_wrong_cases++;
      g_wrong_differ += wrong(g_acc[i], g_a[i], g_b[i]) != g_hw[i];
    }
  }
}

/* Lanes a wrong reading would compute differently: drawn until the reading and the model
 * part (so the hardware must take a side). */
static size_t fill_discriminating(uint32_t (*wrong)(uint32_t, uint32_t, uint32_t), int spread) {
  size_t n = 0;
  while (n < 4096) {
    /* the products within `spread` binades of the accumulator, so one_rounding's double is
     * exact and the roundings meet */
    const int e = 110 + (int)(rnd() % 40);
    const uint32_t acc = f32_in(e, e);
    uint16_t h[4];
    for (int i = 0; i < 4; i += 2) {
      const int ea = 100 + (int)(rnd() % 50), eb = e + 127 - ea - (int)(rnd() % (unsigned)spread);
      h[i] = (uint16_t)(f32_in(ea, ea) >> 16), h[i + 1] = (uint16_t)(f32_in(eb, eb) >> 16);
    }
    const uint32_t a = pair(h[0], h[2]), b = pair(h[1], h[3]);
    if (wrong(acc, a, b) == cm_dpbf16_lane(acc, a, b)) continue;
    g_acc[n] = acc, g_a[n] = a, g_b[n] = b;
    n++;
  }
  return n;
}

/* Hand-made lanes: each exercises one rule of the SDM. */
static size_t fill_special(void) {
  const uint16_t one = 0x3f80, two = 0x4000, inf = 0x7f80, ninf = 0xff80, zero = 0, nzero = 0x8000;
  const uint16_t dnorm = 0x0040, ndnorm = 0x8001, qnan = 0x7fc1, snan = 0x7f81, nqnan = 0xffc3;
  const uint16_t tiny = bf16_of(0x1p-65f), tiny76 = bf16_of(-0x1p-76f), tiny75 = bf16_of(0x1p-75f);
  const uint16_t p62 = bf16_of(0x1p-62f), p63 = bf16_of(0x1p-63f), p70 = bf16_of(0x1p-70f);
  const uint32_t c_one = 0x3f800000u, c_min = 0x00800000u, c_dn = 0x00200000u, c_ndn = 0x80200000u;
  struct {
    uint32_t acc, a, b;
  } cases[] = {
      /* DAZ: a bf16 denormal in a, in b, in either half */
      {c_one, pair(dnorm, one), pair(0x7f00, one)},
      {c_one, pair(one, dnorm), pair(one, 0x7f00)},
      {c_one, pair(0x7f00, one), pair(dnorm, one)},
      {0, pair(ndnorm, zero), pair(0x7f00, zero)}, /* -denormal * big: -0 or a value */
      {0, pair(dnorm, dnorm), pair(0x7f7f, 0x7f7f)},
      /* a denormal accumulator, with a product that keeps it visible: 2^-125 + 2^-127 */
      {c_dn, pair(p62, zero), pair(p63, zero)},
      {c_ndn, pair(p62, zero), pair(p63, zero)},
      {c_dn, pair(zero, zero), pair(zero, zero)},
      {c_ndn, pair(zero, zero), pair(zero, zero)},
      /* FTZ: a denormal result from a product, and from cancellation */
      {0, pair(tiny, zero), pair(tiny, zero)},
      {0x80000000u, pair(tiny, zero), pair(bf16_of(-0x1p-65f), zero)},
      {0x00c00000u, pair(bf16_of(-0x1p-63f), zero), pair(p63, zero)},
      /* the tininess boundary: 2^-126 - 2^-151 exactly, and a product below the normal range
       * added to a small normal (fused: kept; product flushed first: lost) */
      {c_min, pair(tiny76, zero), pair(tiny75, zero)},
      {c_min, pair(zero, tiny76), pair(zero, tiny75)},
      {0x03800000u /* 2^-120 */, pair(p70, zero), pair(p70, zero)},
      {0x03800000u, pair(zero, p70), pair(zero, p70)},
      /* signs of zero */
      {0x80000000u, pair(nzero, nzero), pair(one, one)},
      {0x80000000u, pair(zero, nzero), pair(one, one)},
      {0, pair(nzero, nzero), pair(one, one)},
      {0x80000000u, pair(one, one), pair(bf16_of(-1.0f), one)},
      /* infinities: inf * 0 (invalid), inf - inf, inf + finite */
      {c_one, pair(inf, one), pair(zero, one)},
      {c_one, pair(one, inf), pair(one, zero)},
      {c_one, pair(inf, ninf), pair(one, one)},
      {0x7f800000u, pair(one, one), pair(bf16_of(-1.0f), one)},
      {0xff800000u, pair(inf, one), pair(one, one)},
      {c_one, pair(0x7f7f, 0x7f7f), pair(0x7f7f, 0x7f7f)}, /* overflow */
      /* NaNs: in each position, signalling and quiet, and two at once (priorities) */
      {c_one, pair(qnan, one), pair(one, one)},
      {c_one, pair(one, one), pair(qnan, one)},
      {c_one, pair(one, qnan), pair(one, one)},
      {c_one, pair(one, one), pair(one, qnan)},
      {0x7fa00001u, pair(one, one), pair(one, one)},
      {0xffc00005u, pair(one, one), pair(one, one)},
      {c_one, pair(snan, one), pair(one, one)},
      {c_one, pair(one, snan), pair(one, one)},
      {c_one, pair(qnan, nqnan), pair(one, one)},
      {c_one, pair(one, nqnan), pair(qnan, one)},
      {0x7fa00001u, pair(one, nqnan), pair(one, one)},
      {0x7fa00001u, pair(nqnan, one), pair(one, one)},
      {c_one, pair(one, qnan), pair(one, snan)},
      {0x7fa00001u, pair(inf, one), pair(zero, one)},
      {c_one, pair(inf, qnan), pair(zero, one)},
      {c_one, pair(qnan, inf), pair(one, zero)},
      {c_one, pair(two, inf), pair(two, zero)},
  };
  const size_t n = sizeof cases / sizeof cases[0];
  size_t i = 0;
  for (; i < n; i++) g_acc[i] = cases[i].acc, g_a[i] = cases[i].a, g_b[i] = cases[i].b;
  for (; i % 16; i++) g_acc[i] = g_a[i] = g_b[i] = 0;
  return i;
}

static void fill_bulk(size_t n) {
  for (size_t i = 0; i < n; i++)
    g_acc[i] = f32_mix(), g_a[i] = pair(bf16_mix(), bf16_mix()),
    g_b[i] = pair(bf16_mix(), bf16_mix());
  for (size_t i = 0; i < n / 16; i++) g_k[i] = (uint16_t)rnd();
}

static void test_dpbf16(void) {
  struct tally t = {"vdpbf16ps", 0, 0};
  const unsigned standard = 0x1f80; /* all exceptions masked, RNE, no FTZ / DAZ */
  /* FTZ | DAZ | round toward zero: the SDM says MXCSR is not consulted */
  const unsigned skewed = 0x1f80 | 0x8000 | 0x0040 | 0x6000;

  run_dpbf16(&t, fill_special(), standard, 0, NULL);

  g_wrong_differ = g_wrong_cases = 0;
  run_dpbf16(&t, fill_discriminating(even_first, 3), standard, 0, even_first);
  report_wrong_reading("even pair first", g_wrong_cases, g_wrong_differ);
  g_wrong_differ = g_wrong_cases = 0;
  run_dpbf16(&t, fill_discriminating(one_rounding, 6), standard, 0, one_rounding);
  report_wrong_reading("both products added with one rounding", g_wrong_cases, g_wrong_differ);

  for (int round = 0; round < 64; round++) { /* 64 x 2^16 = 4.2 million lanes */
    fill_bulk(LANES_MAX);
    run_dpbf16(&t, LANES_MAX, round % 8 == 7 ? skewed : standard,
               round % 8 == 5   ? 1
               : round % 8 == 6 ? 2
                                : 0,
               NULL);
  }
  report(&t);
}

/* ---- vcvtne2ps2bf16 / vcvtneps2bf16 ------------------------------------------------------- */

BF16_TARGET static void native_cvtne(uint16_t *two, uint16_t *one, const uint32_t *x, size_t n) {
  for (size_t i = 0; i < n; i += 32) {
    const __m512bh r2 = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(two + i, (__m512i)r2);
    const __m256bh r1 = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256((__m256i *)(one + i / 2), (__m256i)r1);
  }
}

static void test_cvtne(void) {
  struct tally t = {"vcvtne2ps2bf16/vcvtneps2bf16", 0, 0};
  static uint16_t two[LANES_MAX], one[LANES_MAX / 2];
  for (int round = 0; round < 16; round++) {
    for (size_t i = 0; i < LANES_MAX; i++) /* ties (low half 0x8000) are a case of their own */
      g_a[i] = i % 7 == 0 ? (f32_mix() & 0xffff0000u) | 0x8000u : f32_mix();
    native_cvtne(two, one, g_a, LANES_MAX);
    for (size_t i = 0; i < LANES_MAX; i++) {
      /* two: words 0-15 of each 32 from the second source (x[i..i+15]), 16-31 from the first */
      const uint16_t want = cm_cvtne_f32_bf16(g_a[i]);
      t.cases++;
      if (two[i] != want && ++t.mismatches <= 8)
        printf("  cvtne2ps2bf16 %08x: hardware %04x model %04x\n", g_a[i], two[i], want);
      if ((i / 16) % 2 == 0) {
        const uint16_t got = one[(i / 32) * 16 + i % 16];
        t.cases++;
        if (got != want && ++t.mismatches <= 8)
          printf("  cvtneps2bf16 %08x: hardware %04x model %04x\n", g_a[i], got, want);
      }
    }
  }
  report(&t);
}

/* ---- AMX ----------------------------------------------------------------------------------- */

enum { OP_BF16, OP_SS, OP_SU, OP_US, OP_UU, OP_COUNT };
static const char *const op_names[OP_COUNT] = {"tdpbf16ps", "tdpbssd", "tdpbsud", "tdpbusd",
                                               "tdpbuud"};

struct tile_job {
  uint8_t cfg[64];
  const void *a, *b, *c;
  long sa, sb, sc;
  void *out;
  long so;
};

static void make_cfg(uint8_t cfg[64], int M, int N, int K) {
  /* tmm0 = C (M x N dwords), tmm1 = A (M x K dwords), tmm2 = B (K x N dwords) */
  memset(cfg, 0, 64);
  cfg[0] = 1;
  const int colsb[3] = {4 * N, 4 * K, 4 * N}, rows[3] = {M, M, K};
  for (int t = 0; t < 3; t++) {
    cfg[16 + 2 * t] = (uint8_t)colsb[t];
    cfg[48 + t] = (uint8_t)rows[t];
  }
}

/* Load C, A, B, one dot product, store C. Tile numbers are immediates. */
AMX_TARGET static void native_tile_job(const struct tile_job *j, int op) {
  _tile_loadconfig(j->cfg);
  _tile_loadd(0, j->c, j->sc);
  _tile_loadd(1, j->a, j->sa);
  _tile_loadd(2, j->b, j->sb);
  switch (op) {
    case OP_BF16: _tile_dpbf16ps(0, 1, 2); break;
    case OP_SS: _tile_dpbssd(0, 1, 2); break;
    case OP_SU: _tile_dpbsud(0, 1, 2); break;
    case OP_US: _tile_dpbusd(0, 1, 2); break;
    case OP_UU: _tile_dpbuud(0, 1, 2); break;
    default: break;
  }
  _tile_stored(0, j->out, j->so);
  _tile_release();
}

static void model_tile_job(const struct tile_job *j, int op) {
  cm_amx_ldtilecfg(j->cfg);
  cm_amx_tileloadd(0, j->c, j->sc);
  cm_amx_tileloadd(1, j->a, j->sa);
  cm_amx_tileloadd(2, j->b, j->sb);
  if (op == OP_BF16)
    cm_amx_tdpbf16ps(0, 1, 2);
  else
    cm_amx_tdpb(0, 1, 2, op == OP_SS || op == OP_SU, op == OP_SS || op == OP_US);
  cm_amx_tilestored(0, j->out, j->so);
  cm_amx_tilerelease();
}

/* The SDM's tdpbf16ps against the Intrinsics Guide's reading of it: one chain per output
 * element from C, even then odd product per k. Returns C[m][n] by that reading. */
static uint32_t guide_reading(const struct tile_job *j, int m, int n, int K) {
  uint32_t acc, x, y;
  memcpy(&acc, (const char *)j->c + m * j->sc + 4 * n, 4);
  for (int k = 0; k < K; k++) {
    memcpy(&x, (const char *)j->a + m * j->sa + 4 * k, 4);
    memcpy(&y, (const char *)j->b + k * j->sb + 4 * n, 4);
    acc = cm_fma_step(acc, x << 16, y << 16);
    acc = cm_fma_step(acc, x & 0xffff0000u, y & 0xffff0000u);
  }
  return acc;
}

static uint8_t g_ta[16 * 128], g_tb[16 * 128], g_tc[16 * 128], g_out_hw[16 * 128],
    g_out_model[16 * 128];

static void fill_tiles(int op, int extremes) {
  static const uint8_t edge[] = {0x00, 0x01, 0x7f, 0x80, 0x81, 0xff};
  for (size_t i = 0; i < sizeof g_ta; i += 2) {
    uint16_t x = bf16_mix(), y = bf16_mix();
    if (op != OP_BF16) { /* bytes: random, or the extremes */
      x = extremes ? (uint16_t)(edge[rnd() % 6] | edge[rnd() % 6] << 8) : (uint16_t)rnd();
      y = extremes ? (uint16_t)(edge[rnd() % 6] | edge[rnd() % 6] << 8) : (uint16_t)rnd();
    }
    memcpy(g_ta + i, &x, 2);
    memcpy(g_tb + i, &y, 2);
  }
  for (size_t i = 0; i + 4 <= sizeof g_tc; i += 4) {
    uint32_t v = op == OP_BF16 ? f32_mix() : (uint32_t)rnd();
    if (op != OP_BF16 && extremes) /* next to the int32 limits, so that the sums wrap */
      v = (rnd() & 1 ? 0x7fffffffu : 0x80000000u) - (uint32_t)(rnd() % 4096) + 2048u;
    memcpy(g_tc + i, &v, 4);
  }
}

static void test_amx_products(void) {
  for (int op = 0; op < OP_COUNT; op++) {
    struct tally t = {op_names[op], 0, 0};
    long guide_differ = 0, guide_cases = 0;
    /* every shape M x N x K (dwords), several strides; then full tiles in bulk */
    const int rounds = op == OP_BF16 ? 4096 + 2048 : 4096 + 512;
    for (int r = 0; r < rounds; r++) {
      int M = r % 16 + 1, N = r / 16 % 16 + 1, K = r / 256 % 16 + 1;
      if (r >= 4096) M = N = K = 16;
      struct tile_job j;
      make_cfg(j.cfg, M, N, K);
      /* strides: tight, padded, odd (tileloadd takes any) */
      const long pad = (long)(rnd() % 3 == 0 ? 0 : rnd() % 61);
      j.sa = 4 * K + pad, j.sb = 4 * N + (long)(rnd() % 9), j.sc = 4 * N + (long)(rnd() % 5);
      j.so = 4 * N + (long)(rnd() % 7);
      j.a = g_ta, j.b = g_tb, j.c = g_tc;
      fill_tiles(op, op != OP_BF16 && r % 3 == 0);
      memset(g_out_hw, 0xa5, sizeof g_out_hw); /* bytes between rows must stay as they were */
      memset(g_out_model, 0xa5, sizeof g_out_model);
      j.out = g_out_hw;
      native_tile_job(&j, op);
      j.out = g_out_model;
      model_tile_job(&j, op);
      t.cases++;
      if (memcmp(g_out_hw, g_out_model, sizeof g_out_hw) != 0 && ++t.mismatches <= 6) {
        for (size_t i = 0; i < sizeof g_out_hw; i += 4)
          if (memcmp(g_out_hw + i, g_out_model + i, 4) != 0) {
            uint32_t h, m;
            memcpy(&h, g_out_hw + i, 4);
            memcpy(&m, g_out_model + i, 4);
            printf("  %s %dx%dx%d byte %zu (row %ld): hardware %08x model %08x\n", op_names[op], M,
                   N, K, i, (long)i / j.so, h, m);
            break;
          }
      }
      if (op == OP_BF16)
        for (int m = 0; m < M; m++)
          for (int n = 0; n < N; n++) {
            uint32_t h;
            memcpy(&h, g_out_hw + m * j.so + 4 * n, 4);
            guide_cases++;
            guide_differ += guide_reading(&j, m, n, K) != h;
          }
    }
    report(&t);
    if (op == OP_BF16)
      report_wrong_reading("one chain from C, even then odd per k", guide_cases, guide_differ);
  }
}

/* tdpbf16ps on hand-made 1 x 1 x 1 tiles: each exercises one rule (C's DAZ, FTZ inside the
 * even and odd sums, the sums starting from +0 rather than from C, NaN priorities between C,
 * the even and the odd sum). */
static void test_amx_bf16_special(void) {
  const uint16_t one = 0x3f80, inf = 0x7f80, ninf = 0xff80, zero = 0, nzero = 0x8000;
  const uint16_t qnan = 0x7fc1, nqnan = 0xffc3, tiny = bf16_of(0x1p-65f);
  const uint16_t p62 = bf16_of(0x1p-62f), p63 = bf16_of(0x1p-63f), p70 = bf16_of(0x1p-70f);
  const struct {
    uint32_t c, a, b;
  } cases[] = {
      {0x00200000u, pair(p62, zero), pair(p63, zero)}, /* a denormal C, DAZ: 2^-125 */
      {0x80200000u, pair(zero, p62), pair(zero, p63)},
      {0, pair(tiny, zero), pair(tiny, zero)},         /* 2^-130 flushed in the even sum */
      {0x03800000u, pair(p70, zero), pair(p70, zero)}, /* 2^-120 + 2^-140: the sum starts */
      {0x03800000u, pair(zero, p70), pair(zero, p70)}, /* at +0, flushes, C keeps 2^-120 */
      {0, pair(bf16_of(0x1.8p-63f), bf16_of(-0x1p-63f)), pair(p63, p63)}, /* even + odd tiny */
      {0x7fa00001u, pair(qnan, one), pair(one, one)}, /* C's NaN against the even sum's */
      {0x7fa00001u, pair(one, nqnan), pair(one, one)},
      {0x3f800000u, pair(qnan, nqnan), pair(one, one)}, /* even against odd */
      {0x3f800000u, pair(one, nqnan), pair(one, qnan)},
      {0x7fa00001u, pair(inf, one), pair(zero, one)},    /* inf * 0 in the even sum, NaN in C */
      {0x3f800000u, pair(inf, ninf), pair(one, one)},    /* even + odd = inf - inf */
      {0xff800000u, pair(inf, one), pair(one, one)},     /* C - inf + inf */
      {0x80000000u, pair(nzero, nzero), pair(one, one)}, /* signs of zero */
      {0x80000000u, pair(zero, zero), pair(zero, zero)},
  };
  struct tally t = {"tdpbf16ps (hand-made tiles)", 0, 0};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct tile_job j;
    make_cfg(j.cfg, 1, 1, 1);
    j.a = &cases[i].a, j.b = &cases[i].b, j.c = &cases[i].c, j.sa = j.sb = j.sc = j.so = 4;
    uint32_t hw = 0, model = 0;
    j.out = &hw;
    native_tile_job(&j, OP_BF16);
    j.out = &model;
    model_tile_job(&j, OP_BF16);
    t.cases++;
    if (hw != model && ++t.mismatches <= 8)
      printf("  C %08x A %08x B %08x: hardware %08x model %08x\n", cases[i].c, cases[i].a,
             cases[i].b, hw, model);
  }
  report(&t);
}

/* tileloadd / tilestored / tilezero of every shape, through the first seven tiles */
AMX_TARGET static void native_load_store(const uint8_t cfg[64], const void *src, long ss, void *dst,
                                         long sd, void *zeroed) {
  _tile_loadconfig(cfg);
  _tile_loadd(3, src, ss);
  _tile_stored(3, dst, sd);
  _tile_loadd(6, src, ss);
  _tile_zero(6);
  _tile_stored(6, zeroed, sd);
  _tile_release();
}

static void test_amx_load_store(void) {
  struct tally t = {"tileloadd/tilestored/tilezero", 0, 0};
  static uint8_t z_hw[16 * 128], z_model[16 * 128];
  for (int rows = 1; rows <= 16; rows++)
    for (int colsb = 4; colsb <= 64; colsb += 4) { /* others fault: test_amx_faults */
      uint8_t cfg[64] = {1};
      cfg[16 + 2 * 3] = cfg[16 + 2 * 6] = (uint8_t)colsb;
      cfg[48 + 3] = cfg[48 + 6] = (uint8_t)rows;
      for (size_t i = 0; i < sizeof g_ta; i++) g_ta[i] = (uint8_t)rnd();
      const long ss = colsb + (long)(rnd() % 64), sd = colsb + (long)(rnd() % 64);
      memset(g_out_hw, 0x5a, sizeof g_out_hw), memset(g_out_model, 0x5a, sizeof g_out_model);
      memset(z_hw, 0x5a, sizeof z_hw), memset(z_model, 0x5a, sizeof z_model);
      native_load_store(cfg, g_ta, ss, g_out_hw, sd, z_hw);
      cm_amx_ldtilecfg(cfg);
      cm_amx_tileloadd(3, g_ta, ss);
      cm_amx_tilestored(3, g_out_model, sd);
      cm_amx_tileloadd(6, g_ta, ss);
      cm_amx_tilezero(6);
      cm_amx_tilestored(6, z_model, sd);
      cm_amx_tilerelease();
      t.cases++;
      if ((memcmp(g_out_hw, g_out_model, sizeof g_out_hw) || memcmp(z_hw, z_model, sizeof z_hw)) &&
          ++t.mismatches <= 6)
        printf("  rows %d colsb %d strides %ld %ld: stored bytes differ\n", rows, colsb, ss, sd);
    }
  report(&t);
}

/* ldtilecfg again (the same configuration, or another): the tiles' data, and what sttilecfg
 * reads back */
AMX_TARGET static void native_reconfigure(const uint8_t cfg[64], const uint8_t cfg2[64],
                                          const void *src, void *out, uint8_t stored[64]) {
  _tile_loadconfig(cfg);
  _tile_loadd(0, src, 64);
  _tile_storeconfig(stored);
  _tile_loadconfig(cfg2);
  _tile_stored(0, out, 64);
  _tile_release();
}

static void test_amx_reconfigure(void) {
  struct tally t = {"ldtilecfg (again)/sttilecfg", 0, 0};
  static uint8_t out_hw[16 * 64], out_model[16 * 64];
  for (int same = 0; same < 2; same++) {
    uint8_t cfg[64] = {1}, cfg2[64] = {1}, st_hw[64], st_model[64];
    cfg[16] = cfg2[16] = 64, cfg[48] = cfg2[48] = 16; /* tmm0 16 x 64 */
    if (!same) cfg[18] = 8, cfg[49] = 3;              /* and tmm1 3 x 8 the first time */
    for (size_t i = 0; i < sizeof g_ta; i++) g_ta[i] = (uint8_t)(rnd() | 1);
    memset(out_hw, 0xee, sizeof out_hw), memset(out_model, 0xee, sizeof out_model);
    native_reconfigure(cfg, cfg2, g_ta, out_hw, st_hw);
    cm_amx_ldtilecfg(cfg);
    cm_amx_tileloadd(0, g_ta, 64);
    cm_amx_sttilecfg(st_model);
    cm_amx_ldtilecfg(cfg2);
    cm_amx_tilestored(0, out_model, 64);
    cm_amx_tilerelease();
    t.cases += 2;
    if (memcmp(out_hw, out_model, sizeof out_hw) && ++t.mismatches <= 4)
      printf("  tile data after ldtilecfg (%s configuration): hardware %s, model %s\n",
             same ? "same" : "another", out_hw[0] ? "kept" : "zeroed",
             out_model[0] ? "kept" : "zeroed");
    if (memcmp(st_hw, st_model, 64) && ++t.mismatches <= 4) printf("  sttilecfg differs\n");
  }
  report(&t);
}

/* ---- what faults ----------------------------------------------------------------------------- */

enum { FAULT_LOADCFG, FAULT_DP, FAULT_LOAD_UNCONFIGURED, FAULT_LOAD, FAULT_STORE, FAULT_ZERO };
struct fault_case {
  const char *what;
  int kind;
  uint8_t cfg[64];
};

AMX_TARGET static void native_fault_case(const struct fault_case *f) {
  static uint8_t buf[16 * 64];
  if (f->kind == FAULT_LOAD_UNCONFIGURED) {
    _tile_release();
    _tile_loadd(0, buf, 64);
    return;
  }
  _tile_loadconfig(f->cfg);
  if (f->kind == FAULT_LOAD) _tile_loadd(0, buf, 64);
  if (f->kind == FAULT_STORE) _tile_stored(0, buf, 64);
  if (f->kind == FAULT_ZERO) _tile_zero(0);
  if (f->kind == FAULT_DP) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_release();
}

/* 1 when the hardware faults (a signal kills the child) */
static int hardware_faults(const struct fault_case *f) {
  fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL), signal(SIGILL, SIG_DFL), signal(SIGBUS, SIG_DFL);
    native_fault_case(f);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static int model_refuses(const struct fault_case *f) {
  static uint8_t buf[16 * 64];
  g_fault_armed = 1;
  if (setjmp(g_fault_jump)) {
    g_fault_armed = 0;
    cm_amx_tilerelease();
    return 1;
  }
  if (f->kind == FAULT_LOAD_UNCONFIGURED) {
    cm_amx_tilerelease();
    cm_amx_tileloadd(0, buf, 64);
  } else {
    cm_amx_ldtilecfg(f->cfg);
    if (f->kind == FAULT_LOAD) cm_amx_tileloadd(0, buf, 64);
    if (f->kind == FAULT_STORE) cm_amx_tilestored(0, buf, 64);
    if (f->kind == FAULT_ZERO) cm_amx_tilezero(0);
    if (f->kind == FAULT_DP) {
      cm_amx_tilezero(0), cm_amx_tilezero(1), cm_amx_tilezero(2);
      cm_amx_tdpbf16ps(0, 1, 2);
    }
  }
  g_fault_armed = 0;
  cm_amx_tilerelease();
  return 0;
}

static void test_amx_faults(int native) {
  static struct fault_case cases[32];
  int n = 0;
#define CASE(text, k, M, N, K) \
  (cases[n].what = text, cases[n].kind = k, make_cfg(cases[n].cfg, M, N, K), &cases[n++])
  CASE("valid 16x16x16", FAULT_DP, 16, 16, 16);
  CASE("valid 1x1x1", FAULT_DP, 1, 1, 1);
  CASE("tilezero, colsb 6", FAULT_ZERO, 4, 4, 4)->cfg[16] = 6;
  const int valid = n;
  CASE("palette 2", FAULT_LOADCFG, 4, 4, 4)->cfg[0] = 2;
  CASE("reserved byte 5 set", FAULT_LOADCFG, 4, 4, 4)->cfg[5] = 1;
  CASE("colsb 65", FAULT_LOADCFG, 4, 4, 4)->cfg[16] = 65;
  CASE("rows 17", FAULT_LOADCFG, 4, 4, 4)->cfg[48] = 17;
  CASE("rows 0, colsb 16", FAULT_LOADCFG, 4, 4, 4)->cfg[48] = 0;
  CASE("rows 4, colsb 0", FAULT_LOADCFG, 4, 4, 4)->cfg[16] = 0;
  CASE("tile 8 colsb set", FAULT_LOADCFG, 4, 4, 4)->cfg[32] = 4;
  CASE("tile 8 rows set", FAULT_LOADCFG, 4, 4, 4)->cfg[56] = 1;
  CASE("C rows != A rows", FAULT_DP, 4, 4, 4)->cfg[48] = 3;
  CASE("C colsb != B colsb", FAULT_DP, 4, 4, 4)->cfg[16] = 12;
  CASE("A colsb != 4 * B rows", FAULT_DP, 4, 4, 4)->cfg[50] = 3;
  struct fault_case *c = CASE("A unconfigured", FAULT_DP, 4, 4, 4);
  c->cfg[18] = 0, c->cfg[49] = 0;
  CASE("tileloadd after tilerelease", FAULT_LOAD_UNCONFIGURED, 1, 1, 1);
  CASE("tileloadd, colsb 6", FAULT_LOAD, 4, 4, 4)->cfg[16] = 6;
  CASE("tilestored, colsb 62", FAULT_STORE, 4, 4, 4)->cfg[16] = 62;
  c = CASE("tdpbf16ps, colsb 6 (a partial dword) in A, B, C", FAULT_DP, 1, 1, 1);
  c->cfg[16] = 6, c->cfg[18] = 6, c->cfg[20] = 6, c->cfg[50] = 1;
  /* the model is stricter than the hardware here: the hardware's answer is printed, not held */
  const int strict_from = n;
  CASE("start_row 1 (the model does not resume)", FAULT_LOADCFG, 4, 4, 4)->cfg[1] = 1;
#undef CASE
  struct tally t = {"ldtilecfg/tdpbf16ps faults", 0, 0};
  for (int i = 0; i < n; i++) {
    const int model = model_refuses(&cases[i]);
    if (!native) {
      /* no hardware to ask: the verdict measured on it (the valid cases pass, others fault) */
      t.cases++;
      if (model != (i >= valid) && ++t.mismatches <= 8)
        printf("  %s: model %s\n", cases[i].what, model ? "refuses" : "accepts");
      continue;
    }
    const int hw = hardware_faults(&cases[i]);
    if (i >= strict_from) {
      printf("  %s: hardware %s, model %s\n", cases[i].what, hw ? "faults" : "accepts",
             model ? "refuses" : "accepts");
      continue;
    }
    t.cases++;
    if (hw != model && ++t.mismatches <= 8)
      printf("  %s: hardware %s, model %s\n", cases[i].what, hw ? "faults" : "accepts",
             model ? "refuses" : "accepts");
  }
  if (!native) t.name = "ldtilecfg/tdpbf16ps faults (model only, against verdicts measured on AMX)";
  report(&t);
}

/* ---- what the CPU and the OS offer ------------------------------------------------------ */

static uint64_t xcr0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t)hi << 32 | lo;
}

int main(void) {
  unsigned a, b, c, d;
  __builtin_cpu_init();
  const int osxsave = __get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1);
  const uint64_t xcr = osxsave ? xcr0() : 0;
  int bf16 = 0, amx = 0;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) bf16 = a >> 5 & 1;
  bf16 &= __builtin_cpu_supports("avx512f") != 0 && (xcr & 0xe6) == 0xe6;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d))
    amx = (d >> 24 & 1) && (d >> 22 & 1) && (d >> 25 & 1); /* tile, bf16, int8 */
  amx &= (xcr >> 17 & 3) == 3;
  /* Linux hands out the 8 KiB of tile state only on request */
  if (amx && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
    printf("conformance: the kernel refused AMX tile state (arch_prctl); AMX skipped\n");
    amx = 0;
  }

  if (bf16) {
    test_dpbf16();
    test_cvtne();
  } else {
    printf("conformance: no AVX512_BF16 here: vdpbf16ps and the conversions are skipped\n");
  }
  if (amx) {
    test_amx_bf16_special();
    test_amx_products();
    test_amx_load_store();
    test_amx_reconfigure();
  } else {
    printf("conformance: no AMX (tile, bf16, int8) here: the tile instructions are skipped\n");
  }
  test_amx_faults(amx);
  return g_failed ? 1 : 0;
}
