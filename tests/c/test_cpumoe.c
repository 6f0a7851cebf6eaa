/*
 * Test driver of the torch-free C core. It calls every public function of
 * cpumoe/cpumoe.h through that header only (no kernel headers) and checks the
 * results against scalar re-statements written here:
 *
 *   fused experts  UNQUANT (bf16 and fp16 activations), INT8 W8A8, FP8 W8A16, INT4 W4A8,
 *                  MXFP4
 *                  against a double-precision reference (tolerance relative to the output's
 *                  scale):
 *                  bias, silu, gelu, clamped swiglu and clamped silu, residual, int32/int64
 *                  topk_ids with -1
 *                  slots, f32/f64/bf16/f16 topk weights, NULL ids/weights, out aliasing x,
 *                  M = 0, 1 and more than one 1024-token chunk, K and N multiples of 32 but
 *                  not of 64; on every ISA tier the CPU runs (bit-identical to each other)
 *                  and with a pthread runner (bit-identical to serial); a workspace of
 *                  exactly the size asked for (malloc'd, so ASan sees any overrun),
 *                  aligned and not, filled with garbage; with out_f32, the fp32 sum
 *                  rounded once equals the 16-bit output bit for bit.
 *   activations    cpumoe_activation_values: every activation on every tier bit for bit
 *                  against scalar; the clamped silu against silu_mul and a restatement.
 *   packers        VNNI-2 (16-bit, 8-bit), VNNI-4 int8 + compensation, INT4 from AWQ and
 *                  GPTQ checkpoints, byte for byte against the formulas of docs/FORMATS.md.
 *   errors         each rejected input returns its documented status with a message of
 *                  its own naming the argument; an id out of range writes nothing.
 *   sizes          sizes whose products overflow int64/size_t are rejected.
 *   gating         the routing (cpumoe_gating) against a double-precision restatement
 *                  (ids where no rank is within 1e-5 of the cut, weights to 1e-5): softmax,
 *                  sigmoid, sqrt-softplus, bias, groups (max, top-2 sum, of one expert),
 *                  fused shared experts, scaling, padding rows, fp32/bf16/fp16 logits and
 *                  bias; every tier bit for bit against scalar, threads against serial;
 *                  its rejected problems (in the errors section).
 *   linear         the dense linear (cpumoe_linear) of every scheme against the same
 *                  double-precision matvec plus bias: M = 1, tails, two chunks; every tier
 *                  bit for bit against scalar, threads against serial, exact workspaces, M = 0;
 *                  its rejected problems (in the errors section).
 *   ISA, probes    tier names, cap, reason and feature strings; probe checksums and counts.
 *
 * Tiers: the sections that name a tier (fused, linear, probes) run once per tier under test; the
 * others run with the best tier under test active. A check counts for the tier under test
 * when it is made, and each tier under test gets one line, `tier <name> (native|emulated):
 * <N> checks, <F> failed`, before the summary line. Which tiers are under test depends on
 * the build:
 *   python tools/build_c_tests.py            every tier this CPU runs, natively;
 *   python tools/build_c_tests.py --emulate  the vector tiers this CPU lacks, their kernel
 *       sources compiled without their ISA flags through SIMDe (tests/c/emulate/), and this
 *       file with CPUMOE_EMULATE_TIERS: the core then supports every built tier and
 *       cpumoe_isa_native() tells which the CPU has. --emulate-all puts every vector tier
 *       under test (all of them run SIMDe's code in this build, so all say "emulated"); the
 *       scalar tier's bits, which every tier must reproduce, come from a run of it that
 *       counts for no tier. A CPU that lacks no tier has nothing to emulate: the driver says
 *       so and passes.
 *
 * Exits 1 on any failure. Optional arguments: the name of one section to run (packers,
 * fused, errors, sizes, isa, probes, gating, linear); -v prints each case's error; --emulate-all
 * (emulating build only).
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpumoe/cpumoe.h"

/* short names for the tables below */
#define BF16 CPUMOE_DTYPE_BF16
#define F16 CPUMOE_DTYPE_F16
#define F32 CPUMOE_DTYPE_F32
#define F64 CPUMOE_DTYPE_F64
#define I32 CPUMOE_DTYPE_I32
#define I64 CPUMOE_DTYPE_I64
#define UNQUANT CPUMOE_SCHEME_UNQUANT
#define INT8 CPUMOE_SCHEME_INT8_W8A8
#define FP8 CPUMOE_SCHEME_FP8_W8A16
#define INT4 CPUMOE_SCHEME_INT4_W4A8
#define MXFP4 CPUMOE_SCHEME_MXFP4

/* ---- checks ---------------------------------------------------------------------- */

static int g_checks, g_failures, g_verbose;

#ifdef CPUMOE_EMULATE_TIERS
static const int g_emulating_build = 1; /* vector tiers compiled through SIMDe */
#else
static const int g_emulating_build = 0;
#endif

/* Tiers under test, the one under test now (g_tier: every check counts for it), and the one
 * active outside the per-tier loops (g_home, the best under test). */
static int g_tested[CPUMOE_ISA_COUNT];
static cpumoe_isa g_tier, g_home;
static int g_tier_checks[CPUMOE_ISA_COUNT], g_tier_failures[CPUMOE_ISA_COUNT];

static void check_at(int line, int ok, const char *fmt, ...) {
  g_checks++;
  g_tier_checks[g_tier]++;
  if (ok) return;
  g_tier_failures[g_tier]++;
  if (++g_failures > 40) return; /* keep the log readable; the count stays exact */
  va_list args;
  va_start(args, fmt);
  fprintf(stderr, "FAIL (line %d): ", line);
  vfprintf(stderr, fmt, args);
  fputc('\n', stderr);
  va_end(args);
}
#define CHECK(cond, ...) check_at(__LINE__, (cond) != 0, __VA_ARGS__)

/* Puts `isa` under test: active, and the tier its checks count for. */
static void use_tier(cpumoe_isa isa) {
  g_tier = isa;
  cpumoe_set_isa_cap(isa);
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    exit(2);
  }
  return p;
}

/* ---- random numbers (splitmix64: reproducible, no libc state) ---------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15u;

static uint64_t rnd_u64(void) {
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}
static double rnd_uniform(double lo, double hi) {
  return lo + (hi - lo) * (double)(rnd_u64() >> 11) * 0x1p-53;
}
static int64_t rnd_below(int64_t n) {
  return (int64_t)(rnd_u64() % (uint64_t)n);
}

/* ---- number formats, restated from their definitions -------------------------------- */

/* v rounded to nearest even with `bits` significant bits; exponents below emin are
 * subnormal (fixed spacing 2^(emin + 1 - bits)). */
static double round_sig(double v, int bits, int emin) {
  if (v == 0.0 || !isfinite(v)) return v;
  int e;
  frexp(v, &e); /* |v| in [2^(e-1), 2^e) */
  if (e - 1 < emin) e = emin + 1;
  const double spacing = ldexp(1.0, e - bits);
  return nearbyint(v / spacing) * spacing;
}

static double bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint16_t bf16_bits(double v) { /* v rounded to bf16, then its top 16 bits */
  const float f = (float)round_sig(v, 8, -126);
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)(u >> 16);
}

static double f16_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return m ? NAN : s * INFINITY;
  return s * (e ? ldexp(1024 + m, e - 25) : ldexp(m, -24));
}
static uint16_t f16_bits(double v) {
  const double r = round_sig(v, 11, -14);
  const uint16_t sign = signbit(r) ? 0x8000 : 0;
  const double a = fabs(r);
  if (a > 65504.0) return sign | 0x7c00;
  if (a < 0x1p-14) return sign | (uint16_t)(a * 0x1p24); /* subnormal: exact multiple */
  int e;
  const double f = frexp(a, &e); /* a = f 2^e, f in [0.5, 1) */
  return sign | (uint16_t)((e + 14) << 10) | (uint16_t)((f * 2.0 - 1.0) * 1024.0);
}

static double act_value(cpumoe_dtype dt, uint16_t h) {
  return dt == CPUMOE_DTYPE_BF16 ? bf16_value(h) : f16_value(h);
}
static uint16_t act_bits(cpumoe_dtype dt, double v) {
  return dt == CPUMOE_DTYPE_BF16 ? bf16_bits(v) : f16_bits(v);
}
static double act_round(cpumoe_dtype dt, double v) {
  return act_value(dt, act_bits(dt, v));
}

/* e4m3fn: s.eeee.mmm, bias 7, subnormals m 2^-9, 0x7f/0xff NaN (never generated here) */
static double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e ? ldexp(8 + m, e - 10) : ldexp(m, -9);
  return (b & 0x80) ? -v : v;
}

/* MXFP4: e2m1 code s.ee.m (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^(scale - 127),
 * both zero codes +0 */
static double mxfp4_value(unsigned code, unsigned scale) {
  static const double magnitude[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if ((code & 7) == 0) return 0.0;
  const double v = ldexp(magnitude[code & 7], (int)scale - 127);
  return (code & 8) ? -v : v;
}

/* ---- packed layouts of docs/FORMATS.md ---------------------------------------------- */

/* VNNI-2 (16-bit and fp8): per expert, blocks of 32 rows (the last may be 16);
 * dst[32b*cols + (k/2)*2*nsz + 2n + k%2] = W[32b + n][k] */
static void ref_pack_vnni2(const void *src, void *dst, size_t elem, int64_t experts, int64_t rows,
                           int64_t cols) {
  const char *s = (const char *)src;
  char *d = (char *)dst;
  for (int64_t e = 0; e < experts; e++)
    for (int64_t row0 = 0; row0 < rows; row0 += 32) {
      const int64_t nsz = rows - row0 < 32 ? rows - row0 : 32;
      const int64_t base = (e * rows + row0) * cols;
      for (int64_t n = 0; n < nsz; n++)
        for (int64_t k = 0; k < cols; k++)
          memcpy(d + (size_t)(base + (k / 2) * 2 * nsz + 2 * n + k % 2) * elem,
                 s + (size_t)(base + n * cols + k) * elem, elem);
    }
}

/* VNNI-4 int8: per expert [rows][cols + 4] bytes; block b (32 rows) at byte 32b(cols+4):
 * dst[(k/4)*128 + 4n + k%4] = W[32b + n][k], then int32 comp[n] = 128 * sum_k W[32b + n][k] */
static void ref_pack_vnni4(const int8_t *src, int8_t *dst, int64_t experts, int64_t rows,
                           int64_t cols) {
  for (int64_t e = 0; e < experts; e++)
    for (int64_t b = 0; b < rows / 32; b++) {
      const int8_t *w = src + (e * rows + 32 * b) * cols;
      int8_t *out = dst + (e * rows + 32 * b) * (cols + 4);
      for (int64_t n = 0; n < 32; n++) {
        int32_t sum = 0;
        for (int64_t k = 0; k < cols; k++) {
          out[(k / 4) * 128 + 4 * n + k % 4] = w[n * cols + k];
          sum += w[n * cols + k];
        }
        const int32_t comp = 128 * sum;
        memcpy(out + 32 * cols + 4 * n, &comp, 4);
      }
    }
}

/* MXFP4 codes: per expert, w [rows][cols] one code (0..15) per element; blocks of 32 rows,
 * block b at byte (32b) * cols/2 stored [cols/2][32]: byte c*32 + j holds w[32b + j/2][2c + j%2]
 * in its low nibble and w[32b + 16 + j/2][2c + j%2] in its high nibble. */
static void ref_pack_mxfp4(const uint8_t *w, uint8_t *dst, int64_t experts, int64_t rows,
                           int64_t cols) {
  for (int64_t e = 0; e < experts; e++)
    for (int64_t b = 0; b < rows / 32; b++) {
      const uint8_t *wb = w + (e * rows + 32 * b) * cols;
      uint8_t *out = dst + (e * rows + 32 * b) * (cols / 2);
      for (int64_t c = 0; c < cols / 2; c++)
        for (int j = 0; j < 32; j++)
          out[c * 32 + j] = (uint8_t)(wb[(j / 2) * cols + 2 * c + j % 2] |
                                      wb[(16 + j / 2) * cols + 2 * c + j % 2] << 4);
    }
}

/* MXFP4 checkpoint bytes: element 2i of a row in the low nibble of byte i, 2i + 1 in the high */
static void mxfp4_checkpoint(const uint8_t *w, uint8_t *bytes, int64_t n) {
  for (int64_t i = 0; i < n / 2; i++) bytes[i] = (uint8_t)(w[2 * i] | w[2 * i + 1] << 4);
}

/* e8m0 scales [rows][groups] -> blocks of 32 rows [groups][32] */
static void ref_pack_e8m0(const uint8_t *s, uint8_t *dst, int64_t experts, int64_t rows,
                          int64_t groups) {
  for (int64_t e = 0; e < experts; e++)
    for (int64_t b = 0; b < rows / 32; b++)
      for (int64_t g = 0; g < groups; g++)
        for (int64_t n = 0; n < 32; n++)
          dst[(e * rows + 32 * b) * groups + g * 32 + n] = s[(e * rows + 32 * b + n) * groups + g];
}

/* INT4: per expert and 32 output columns (tile t), per block of bk = min(group, 128) k:
 * byte kk*64 + 4l + b holds w[k][32t + c(l)] in its low nibble and w[k][32t + c(l) + 8] in
 * its high nibble (k = 4kk + b in the block, c(l) = l < 8 ? l : l + 8), then int32
 * comp[n] = sum over the block's k of (w - zero); zeros int8 and scales fp32 [tile][G][32].
 * w: nibbles [E, rows, cols]; zero, scale: [E, rows, G]. */
static void ref_pack_int4(const uint8_t *w, const int8_t *zero, const float *scale, int64_t experts,
                          int64_t rows, int64_t cols, int64_t groups, uint8_t *packed,
                          int8_t *packed_zero, float *packed_scale) {
  const int64_t group = cols / groups, bk = group < 128 ? group : 128;
  for (int64_t e = 0; e < experts; e++)
    for (int64_t t = 0; t < rows / 32; t++) {
      const int64_t tile = e * (rows / 32) + t;
      for (int64_t g = 0; g < groups; g++)
        for (int64_t n = 0; n < 32; n++) {
          const int64_t i = (e * rows + 32 * t + n) * groups + g;
          packed_zero[(tile * groups + g) * 32 + n] = zero[i];
          packed_scale[(tile * groups + g) * 32 + n] = scale[i];
        }
      for (int64_t kb = 0; kb < cols / bk; kb++) {
        uint8_t *block = packed + (tile * (cols / bk) + kb) * (16 * bk + 128);
        for (int64_t k = 0; k < bk; k++)
          for (int l = 0; l < 16; l++) {
            const int64_t row = e * rows + 32 * t + (l < 8 ? l : l + 8);
            const int64_t kk = kb * bk + k;
            block[(k / 4) * 64 + 4 * l + k % 4] =
                (uint8_t)(w[row * cols + kk] | w[(row + 8) * cols + kk] << 4);
          }
        for (int64_t n = 0; n < 32; n++) {
          const int64_t row = e * rows + 32 * t + n;
          int32_t comp = 0;
          for (int64_t k = kb * bk; k < (kb + 1) * bk; k++)
            comp += w[row * cols + k] - zero[row * groups + k / group];
          memcpy(block + 16 * bk + 4 * n, &comp, 4);
        }
      }
    }
}

/* ---- a runner on pthreads: worker w on its own thread, w = 0 on the caller ---------- */

#define MAX_THREADS 8

typedef struct thread_job {
  cpumoe_worker_fn worker;
  void *arg;
  int64_t index;
} thread_job;

typedef struct runner_stats {
  int calls;       /* run() calls with more than one worker */
  int64_t workers; /* most workers asked for at once */
} runner_stats;

static void *thread_main(void *p) {
  thread_job *job = (thread_job *)p;
  job->worker(job->arg, job->index);
  return NULL;
}

static void pthread_run(void *ctx, int64_t n, cpumoe_worker_fn worker, void *arg) {
  runner_stats *stats = (runner_stats *)ctx;
  pthread_t threads[MAX_THREADS];
  thread_job jobs[MAX_THREADS];
  if (n > MAX_THREADS) abort(); /* the core asked for more than num_threads */
  stats->calls += n > 1;
  if (n > stats->workers) stats->workers = n;
  for (int64_t w = 1; w < n; w++) {
    jobs[w] = (thread_job){worker, arg, w};
    if (pthread_create(&threads[w], NULL, thread_main, &jobs[w]) != 0) abort();
  }
  worker(arg, 0);
  for (int64_t w = 1; w < n; w++) pthread_join(threads[w], NULL);
}

static runner_stats g_runner_stats;
static const cpumoe_runner g_threads = {pthread_run, &g_runner_stats, 3};

/* ---- error messages: each failing call must write its own ----------------------------- */

static char g_primed[512];

/* Sets a known message (through another failing call) so that a check can tell that
 * the call under test wrote its own. */
static void prime_error(void) {
  cpumoe_set_isa_cap((cpumoe_isa)77);
  snprintf(g_primed, sizeof g_primed, "%s", cpumoe_last_error());
}

static void check_error_at(int line, const char *what, cpumoe_status got, cpumoe_status want,
                           const char *needle) {
  const char *msg = cpumoe_last_error();
  check_at(line, got == want, "%s: status %d, expected %d (%s)", what, (int)got, (int)want, msg);
  check_at(line, msg && msg[0] && strcmp(msg, g_primed) != 0, "%s: no message of its own", what);
  check_at(line, msg && strstr(msg, needle) != NULL, "%s: message \"%s\" does not mention \"%s\"",
           what, msg, needle);
}
/* Runs `call` after priming the message, then checks its status and its own message. */
#define CHECK_ERROR(what, call, want, needle)           \
  do {                                                  \
    prime_error();                                      \
    const cpumoe_status got_ = (call);                  \
    check_error_at(__LINE__, what, got_, want, needle); \
  } while (0)

/* ---- packers ------------------------------------------------------------------------ */

/* The three weight packers under one signature, so that one check serves them all. */
typedef cpumoe_status (*packer_fn)(const void *src, void *dst, int64_t experts, int64_t rows,
                                   int64_t cols, const cpumoe_runner *runner);
static cpumoe_status pack_vnni2_16bit(const void *src, void *dst, int64_t experts, int64_t rows,
                                      int64_t cols, const cpumoe_runner *runner) {
  return cpumoe_pack_vnni2_16bit(src, dst, experts, rows, cols, runner);
}
static cpumoe_status pack_vnni2_8bit(const void *src, void *dst, int64_t experts, int64_t rows,
                                     int64_t cols, const cpumoe_runner *runner) {
  return cpumoe_pack_vnni2_8bit(src, dst, experts, rows, cols, runner);
}
static cpumoe_status pack_vnni4_int8(const void *src, void *dst, int64_t experts, int64_t rows,
                                     int64_t cols, const cpumoe_runner *runner) {
  return cpumoe_pack_vnni4_int8(src, dst, experts, rows, cols, runner);
}
static cpumoe_status pack_mxfp4(const void *src, void *dst, int64_t experts, int64_t rows,
                                int64_t cols, const cpumoe_runner *runner) {
  return cpumoe_pack_mxfp4(src, dst, experts, rows, cols, runner);
}
static cpumoe_status pack_e8m0(const void *src, void *dst, int64_t experts, int64_t rows,
                               int64_t cols, const cpumoe_runner *runner) {
  return cpumoe_pack_e8m0_scales(src, dst, experts, rows, cols, runner);
}

/* The packer's `bytes` of output equal `want`, serially and with threads. */
static void check_packer(const char *name, packer_fn pack, const void *src, const void *want,
                         size_t bytes, int64_t experts, int64_t rows, int64_t cols) {
  void *got = xmalloc(bytes);
  for (int threaded = 0; threaded < 2; threaded++) {
    memset(got, 0xab, bytes);
    const cpumoe_status st = pack(src, got, experts, rows, cols, threaded ? &g_threads : NULL);
    CHECK(st == CPUMOE_OK && memcmp(got, want, bytes) == 0,
          "%s E=%lld rows=%lld cols=%lld threaded=%d: bytes differ from FORMATS.md", name,
          (long long)experts, (long long)rows, (long long)cols, threaded);
  }
  free(got);
}

static void test_packers(void) {
  static const int64_t shapes2[][3] = {{1, 32, 32}, {2, 48, 64}, {3, 16, 96}, {2, 64, 160}};
  for (size_t s = 0; s < sizeof shapes2 / sizeof shapes2[0]; s++) {
    const int64_t E = shapes2[s][0], R = shapes2[s][1], C = shapes2[s][2];
    const size_t n = (size_t)(E * R * C);
    uint16_t *src = xmalloc(2 * n), *want = xmalloc(2 * n);
    for (size_t i = 0; i < n; i++) src[i] = (uint16_t)rnd_u64();
    ref_pack_vnni2(src, want, 2, E, R, C);
    check_packer("pack_vnni2_16bit", pack_vnni2_16bit, src, want, 2 * n, E, R, C);
    ref_pack_vnni2(src, want, 1, E, R, C); /* the first n bytes as 8-bit elements */
    check_packer("pack_vnni2_8bit", pack_vnni2_8bit, src, want, n, E, R, C);
    free(src), free(want);
  }

  /* int8: the widest reduction allowed, a row of -128s (the most negative compensation) */
  static const int64_t shapes4[][3] = {{1, 32, 32}, {2, 64, 96}, {3, 32, 160}, {1, 32, 65536}};
  for (size_t s = 0; s < sizeof shapes4 / sizeof shapes4[0]; s++) {
    const int64_t E = shapes4[s][0], R = shapes4[s][1], C = shapes4[s][2];
    const size_t n = (size_t)(E * R * C), packed = (size_t)(E * R * (C + 4));
    int8_t *src = xmalloc(n), *want = xmalloc(packed);
    for (size_t i = 0; i < n; i++) src[i] = (int8_t)rnd_u64();
    memset(src, 0x80, (size_t)C); /* row 0: all -128 */
    ref_pack_vnni4(src, want, E, R, C);
    check_packer("pack_vnni4_int8", pack_vnni4_int8, src, want, packed, E, R, C);
    free(src), free(want);
  }

  /* mxfp4: codes (cols = bytes per row, two codes each) and e8m0 scales (cols = groups) */
  static const int64_t shapes_mx[][3] = {{1, 32, 16}, {2, 64, 48}, {3, 96, 80}, {1, 32, 1440}};
  for (size_t s = 0; s < sizeof shapes_mx / sizeof shapes_mx[0]; s++) {
    const int64_t E = shapes_mx[s][0], R = shapes_mx[s][1], C = shapes_mx[s][2];
    const size_t n = (size_t)(E * R * C);
    uint8_t *codes = xmalloc(2 * n), *src = xmalloc(n), *want = xmalloc(n);
    for (size_t i = 0; i < 2 * n; i++) codes[i] = (uint8_t)rnd_below(16);
    mxfp4_checkpoint(codes, src, 2 * (int64_t)n);
    ref_pack_mxfp4(codes, want, E, R, 2 * C);
    check_packer("pack_mxfp4", pack_mxfp4, src, want, n, E, R, C);
    for (size_t i = 0; i < n; i++) src[i] = (uint8_t)rnd_u64();
    ref_pack_e8m0(src, want, E, R, C);
    check_packer("pack_e8m0_scales", pack_e8m0, src, want, n, E, R, C);
    free(codes), free(src), free(want);
  }

  /* no experts: nothing to do, nothing written */
  uint16_t a[32 * 32] = {0}, b[32 * 32];
  memset(b, 0x5a, sizeof b);
  CHECK(cpumoe_pack_vnni2_16bit(a, b, 0, 32, 32, NULL) == CPUMOE_OK &&
            cpumoe_pack_vnni2_8bit((uint8_t *)a, (uint8_t *)b, 0, 32, 32, NULL) == CPUMOE_OK &&
            cpumoe_pack_vnni4_int8((int8_t *)a, (int8_t *)b, 0, 32, 32, NULL) == CPUMOE_OK,
        "packing 0 experts must succeed");
  CHECK(b[0] == 0x5a5a && b[32 * 32 - 1] == 0x5a5a, "packing 0 experts wrote to dst");
}

/* INT4 checkpoints (cpumoe.h, FORMATS.md): AWQ qweight [IC][OC/8], column 8c + j in nibble
 * awq_nibble[j] of word c; GPTQ qweight [IC/8][OC], k = 8r + i in nibble i of row r; qzeros
 * [G][OC/8] in the same column order (AWQ: zero; GPTQ: zero - 1); scales [G][OC]. */
static const int awq_nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

static void test_pack_int4(void) {
  static const int64_t shapes[][4] = {
      {2, 64, 64, 2}, {1, 32, 256, 1}, {1, 32, 8, 2}, {1, 96, 96, 1}};
  static const cpumoe_dtype scale_dtypes[] = {BF16, F16, F32};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int gptq = 0; gptq < 2; gptq++)
      for (size_t sd = 0; sd < 3; sd++) {
        const int64_t E = shapes[s][0], OC = shapes[s][1], IC = shapes[s][2], G = shapes[s][3];
        const int64_t group = IC / G, bk = cpumoe_int4_block_k(group);
        const cpumoe_dtype dt = scale_dtypes[sd];
        uint8_t *w = xmalloc((size_t)(E * OC * IC));
        int8_t *zero = xmalloc((size_t)(E * OC * G));
        float *scale = xmalloc(sizeof(float) * (size_t)(E * OC * G));
        int32_t *qweight = calloc((size_t)(E * IC * OC / 8), 4);
        int32_t *qzeros = calloc((size_t)(E * G * OC / 8), 4);
        char *scales = xmalloc(4 * (size_t)(E * G * OC));
        if (!qweight || !qzeros) abort();
        for (int64_t e = 0; e < E; e++)
          for (int64_t n = 0; n < OC; n++) {
            for (int64_t k = 0; k < IC; k++) {
              const int v = (int)rnd_below(16);
              w[(e * OC + n) * IC + k] = (uint8_t)v;
              if (gptq)
                qweight[(e * IC / 8 + k / 8) * OC + n] |= (int32_t)((uint32_t)v << (4 * (k % 8)));
              else
                qweight[(e * IC + k) * (OC / 8) + n / 8] |=
                    (int32_t)((uint32_t)v << (4 * awq_nibble[n % 8]));
            }
            for (int64_t g = 0; g < G; g++) {
              const int z = (int)rnd_below(16); /* stored nibble */
              zero[(e * OC + n) * G + g] = (int8_t)(gptq ? z + 1 : z);
              qzeros[(e * G + g) * (OC / 8) + n / 8] |=
                  (int32_t)((uint32_t)z << (4 * (gptq ? n % 8 : awq_nibble[n % 8])));
              const int64_t i = (e * G + g) * OC + n;
              const double v = rnd_uniform(1e-3, 1e-1);
              if (dt == F32)
                ((float *)scales)[i] = (float)v;
              else
                ((uint16_t *)scales)[i] = act_bits(dt, v);
              scale[(e * OC + n) * G + g] =
                  dt == F32 ? (float)v : (float)act_value(dt, ((uint16_t *)scales)[i]);
            }
          }
        const size_t bytes = (size_t)(E * (OC / 32) * (IC / bk) * (16 * bk + 128));
        const size_t side = (size_t)(E * OC * G);
        uint8_t *want = xmalloc(bytes), *got = xmalloc(bytes);
        int8_t *want_z = xmalloc(side), *got_z = xmalloc(side);
        float *want_s = xmalloc(4 * side), *got_s = xmalloc(4 * side);
        ref_pack_int4(w, zero, scale, E, OC, IC, G, want, want_z, want_s);
        for (int threaded = 0; threaded < 2; threaded++) {
          memset(got, 0xab, bytes), memset(got_z, 0xab, side), memset(got_s, 0xab, 4 * side);
          const cpumoe_status st =
              cpumoe_pack_int4(gptq ? CPUMOE_INT4_GPTQ : CPUMOE_INT4_AWQ, qweight, qzeros, scales,
                               dt, E, OC, IC, G, got, got_z, got_s, threaded ? &g_threads : NULL);
          CHECK(st == CPUMOE_OK && memcmp(got, want, bytes) == 0 &&
                    memcmp(got_z, want_z, side) == 0 && memcmp(got_s, want_s, 4 * side) == 0,
                "pack_int4 %s E=%lld OC=%lld IC=%lld G=%lld scales %d threaded=%d: differs from "
                "FORMATS.md (status %d)",
                gptq ? "GPTQ" : "AWQ", (long long)E, (long long)OC, (long long)IC, (long long)G,
                (int)dt, threaded, (int)st);
        }
        free(w), free(zero), free(scale), free(qweight), free(qzeros), free(scales);
        free(want), free(got), free(want_z), free(got_z), free(want_s), free(got_s);
      }

  static const int64_t block_k[][2] = {{4, 4},     {32, 32}, {96, 96}, {128, 128}, {256, 128},
                                       {384, 128}, {192, 0}, {6, 0},   {0, 0},     {-4, 0}};
  for (size_t i = 0; i < sizeof block_k / sizeof block_k[0]; i++)
    CHECK(cpumoe_int4_block_k(block_k[i][0]) == block_k[i][1], "int4_block_k(%lld) = %lld",
          (long long)block_k[i][0], (long long)cpumoe_int4_block_k(block_k[i][0]));
}

static void test_packer_errors(void) {
  static uint8_t src[64 * 64 * 2], dst[64 * 68 * 2];
  static const struct {
    const char *what;
    packer_fn pack;
    int64_t experts, rows, cols;
    int null_src, null_dst;
    cpumoe_status status;
    const char *needle;
  } cases[] = {
      {"vnni2 experts=-1", pack_vnni2_16bit, -1, 32, 32, 0, 0, CPUMOE_EINVAL, "experts=-1"},
      {"vnni2 rows=0", pack_vnni2_16bit, 1, 0, 32, 0, 0, CPUMOE_EINVAL, "rows=0"},
      {"vnni2 cols=-32", pack_vnni2_16bit, 1, 32, -32, 0, 0, CPUMOE_EINVAL, "cols=-32"},
      {"vnni2 rows=24", pack_vnni2_16bit, 1, 24, 32, 0, 0, CPUMOE_EINVAL, "24"},
      {"vnni2 cols=48", pack_vnni2_16bit, 1, 32, 48, 0, 0, CPUMOE_EINVAL, "48"},
      {"vnni2 src NULL", pack_vnni2_16bit, 1, 32, 32, 1, 0, CPUMOE_EINVAL, "NULL"},
      {"vnni2 dst NULL", pack_vnni2_16bit, 1, 32, 32, 0, 1, CPUMOE_EINVAL, "NULL"},
      {"vnni2 8-bit rows=8", pack_vnni2_8bit, 1, 8, 32, 0, 0, CPUMOE_EINVAL, "8"},
      {"vnni2 8-bit dst NULL", pack_vnni2_8bit, 1, 32, 32, 0, 1, CPUMOE_EINVAL, "NULL"},
      {"vnni4 rows=48", pack_vnni4_int8, 1, 48, 32, 0, 0, CPUMOE_EINVAL, "48"},
      {"vnni4 cols=80", pack_vnni4_int8, 1, 32, 80, 0, 0, CPUMOE_EINVAL, "80"},
      {"vnni4 cols=65568", pack_vnni4_int8, 1, 32, 65568, 0, 0, CPUMOE_EUNSUPPORTED, "65568"},
      {"vnni4 experts=-2", pack_vnni4_int8, -2, 32, 32, 0, 0, CPUMOE_EINVAL, "experts=-2"},
      {"vnni4 src NULL", pack_vnni4_int8, 1, 32, 32, 1, 0, CPUMOE_EINVAL, "NULL"},
      {"mxfp4 rows=48", pack_mxfp4, 1, 48, 16, 0, 0, CPUMOE_EINVAL, "48"},
      {"mxfp4 cols=24", pack_mxfp4, 1, 32, 24, 0, 0, CPUMOE_EINVAL, "48"},
      {"mxfp4 experts=-1", pack_mxfp4, -1, 32, 16, 0, 0, CPUMOE_EINVAL, "experts=-1"},
      {"mxfp4 dst NULL", pack_mxfp4, 1, 32, 16, 0, 1, CPUMOE_EINVAL, "NULL"},
      {"e8m0 rows=16", pack_e8m0, 1, 16, 2, 0, 0, CPUMOE_EINVAL, "16"},
      {"e8m0 cols=0", pack_e8m0, 1, 32, 0, 0, 0, CPUMOE_EINVAL, "cols=0"},
      {"e8m0 src NULL", pack_e8m0, 1, 32, 2, 1, 0, CPUMOE_EINVAL, "NULL"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_ERROR(cases[i].what,
                cases[i].pack(cases[i].null_src ? NULL : src, cases[i].null_dst ? NULL : dst,
                              cases[i].experts, cases[i].rows, cases[i].cols, NULL),
                cases[i].status, cases[i].needle);

  /* INT4: qweight/qzeros/scales read from src, outputs written to dst (big enough for all) */
  const int32_t *q = (const int32_t *)src;
  uint8_t *pw = dst;
  int8_t *pz = (int8_t *)dst;
  float *ps = (float *)dst;
#define PACK4(fmt, dt, E, OC, IC, G) \
  cpumoe_pack_int4(fmt, q, q, src, dt, E, OC, IC, G, pw, pz, ps, NULL)
  CHECK_ERROR("int4 format", PACK4((cpumoe_int4_format)2, F32, 1, 32, 32, 1), CPUMOE_EINVAL, "2");
  CHECK_ERROR("int4 experts", PACK4(CPUMOE_INT4_AWQ, F32, -1, 32, 32, 1), CPUMOE_EINVAL,
              "experts=-1");
  CHECK_ERROR("int4 groups", PACK4(CPUMOE_INT4_AWQ, F32, 1, 32, 32, 0), CPUMOE_EINVAL, "groups=0");
  CHECK_ERROR("int4 out % 32", PACK4(CPUMOE_INT4_AWQ, F32, 1, 48, 32, 1), CPUMOE_EINVAL, "48");
  CHECK_ERROR("int4 in % groups", PACK4(CPUMOE_INT4_AWQ, F32, 1, 32, 32, 3), CPUMOE_EINVAL, "3");
  CHECK_ERROR("int4 group 192", PACK4(CPUMOE_INT4_AWQ, F32, 1, 32, 384, 2), CPUMOE_EUNSUPPORTED,
              "192");
  CHECK_ERROR("int4 GPTQ in % 8", PACK4(CPUMOE_INT4_GPTQ, F32, 1, 32, 4, 1), CPUMOE_EINVAL, "8");
  CHECK_ERROR("int4 scales dtype", PACK4(CPUMOE_INT4_AWQ, I32, 1, 32, 32, 1), CPUMOE_EINVAL,
              "scales");
#undef PACK4
  CHECK_ERROR("int4 NULL",
              cpumoe_pack_int4(CPUMOE_INT4_AWQ, q, NULL, src, F32, 1, 32, 32, 1, pw, pz, ps, NULL),
              CPUMOE_EINVAL, "NULL");
}

/* ---- fused experts: cases, data, reference ------------------------------------------ */

enum {
  BIAS = 1,         /* w1_bias and w2_bias */
  SWIGLU = 2,       /* clamped swiglu on interleaved gate/up rows, else silu(gate) * up */
  RESIDUAL = 4,     /* out += 0.75 * residual */
  NO_IDS = 8,       /* topk_ids NULL: every slot is expert 0 */
  NO_WEIGHTS = 16,  /* topk_weights NULL: every weight is 1 */
  OUT_IS_X = 32,    /* out (and residual, if any) alias x */
  ONE_EXPERT = 64,  /* every slot routed to expert E - 1 */
  GELU = 128,       /* gelu(gate) * up (erf form) instead of silu(gate) * up */
  SILU_CLAMP = 256, /* silu(min(gate, limit)) * clamp(up, -limit, limit) (limit without alpha) */
};

typedef struct moe_case {
  const char *name;
  cpumoe_scheme scheme;
  cpumoe_dtype act;
  int64_t M, K, N, E, topk;
  cpumoe_dtype ids_dtype, weights_dtype;
  double skip;    /* fraction of slots with id -1 */
  int64_t b1, b2; /* FP8: block_n, block_k; INT4: w1_group, w2_group */
  int flags;
} moe_case;

#define BIG_BLOCK (INT64_MAX - 1) /* one scale block per matrix, and ceil() must not overflow */

/* K and N of 96 or 160 are multiples of 32 but not of 64; 1100 tokens are two chunks.
 * "streamed": 600 slots of N = 160 and K = 288 fp32 values pass the 256 KiB up to which the
 * intermediate and y are stored normally (moe/stages.c), so both take the streaming stores.
 * "block of 40": one expert's 40 rows, two panels that the amx tier takes in one call.
 * INT4 groups: 4 (the smallest), 96 (<= 128, not a power of 2), 256 (two blocks a group). */
/* clang-format off */
static const moe_case g_cases[] = {
  /* name              scheme   act      M    K    N  E topk ids weights skip  b1,  b2,  flags */
  {"bf16 decode",      UNQUANT, BF16,    1,  64,  64, 4, 2, I32, F32,  0.0,  0,  0,  0},
  {"bf16 tails",       UNQUANT, BF16,   13,  96, 160, 5, 3, I64, BF16, 0.2,  0,  0,
   BIAS | RESIDUAL},
  {"fp16 swiglu",      UNQUANT, F16,    17, 160,  96, 6, 2, I32, F16,  0.2,  0,  0,
   BIAS | SWIGLU | RESIDUAL},
  {"fp16 2 chunks",    UNQUANT, F16,  1100,  32,  32, 3, 1, I64, F64,  0.1,  0,  0,  RESIDUAL},
  {"bf16 one expert",  UNQUANT, BF16,   70,  32,  64, 3, 1, I32, F32,  0.0,  0,  0,
   BIAS | ONE_EXPERT},
  {"bf16 streamed",    UNQUANT, BF16,  300, 288, 160, 4, 2, I32, F32,  0.0,  0,  0,  BIAS},
  {"bf16 block of 40", UNQUANT, BF16,   40,  96,  64, 2, 1, I32, F32,  0.0,  0,  0,
   BIAS | ONE_EXPERT},
  {"bf16 dense",       UNQUANT, BF16,    5,  64,  32, 1, 1, I32, F32,  0.0,  0,  0,
   NO_IDS | NO_WEIGHTS},
  {"bf16 in place",    UNQUANT, BF16,    9,  96,  32, 3, 2, I64, F32,  0.0,  0,  0,
   BIAS | RESIDUAL | OUT_IS_X},
  {"fp16 decode 2 rows", UNQUANT, F16,   2,  96,  64, 2, 2, I32, F32,  0.0,  0,  0,  BIAS},
  {"bf16 gelu",        UNQUANT, BF16,   21,  96,  64, 4, 2, I64, F32,  0.1,  0,  0,
   BIAS | GELU | RESIDUAL},
  {"bf16 silu clamp",  UNQUANT, BF16,   21,  96,  64, 4, 2, I32, F32,  0.1,  0,  0,
   BIAS | SILU_CLAMP | RESIDUAL},
  {"fp16 silu clamp decode", UNQUANT, F16, 1, 64, 96, 3, 2, I64, F32,  0.0,  0,  0,  SILU_CLAMP},
  {"fp16 all skipped", UNQUANT, F16,     4,  32,  32, 2, 2, I32, F32,  1.0,  0,  0,  RESIDUAL},
  {"int8 decode",      INT8,    BF16,    1,  32,  96, 3, 2, I32, F32,  0.0,  0,  0,  0},
  {"int8 decode 2 rows", INT8,  F16,     2,  64,  96, 2, 2, I32, F32,  0.0,  0,  0,  BIAS},
  {"int8 tails",       INT8,    F16,    50,  96, 160, 4, 4, I64, BF16, 0.25, 0,  0,
   BIAS | SWIGLU | RESIDUAL},
  {"int8 gelu",       INT8,    BF16,    3,  64,  32, 2, 2, I32, F32,  0.0,  0,  0,  GELU},
  {"int8 silu clamp",  INT8,    F16,    19,  96,  64, 3, 2, I64, F32,  0.1,  0,  0,
   BIAS | SILU_CLAMP},
  {"int8 2 chunks",    INT8,    BF16, 1100,  32,  32, 2, 1, I32, F16,  0.0,  0,  0,
   BIAS | RESIDUAL},
  {"int8 streamed",    INT8,    F16,   300, 288, 160, 4, 2, I64, F32,  0.1,  0,  0,  RESIDUAL},
  {"int8 in place",    INT8,    F16,     6,  64,  64, 2, 2, I32, F64,  0.0,  0,  0,
   RESIDUAL | OUT_IS_X},
  {"fp8 decode",       FP8,     BF16,    3,  96,  96, 3, 2, I32, F32,  0.0,  32, 64, BIAS},
  {"fp8 odd blocks",   FP8,     F16,    20, 160,  64, 4, 2, I64, F16,  0.2,  48, 6,
   SWIGLU | RESIDUAL},
  {"fp8 gelu",        FP8,     F16,    30,  64,  64, 3, 2, I32, F32,  0.0,  32, 32, BIAS | GELU},
  {"fp8 silu clamp",   FP8,     BF16,   12,  64,  96, 3, 2, I32, F32,  0.0,  32, 64,
   SILU_CLAMP | RESIDUAL},
  {"fp8 2 chunks",     FP8,     BF16, 1100,  32,  32, 2, 1, I64, F64,  0.1,  16, 16,
   BIAS | RESIDUAL},
  {"fp8 huge blocks",  FP8,     BF16,    7,  64,  96, 2, 2, I32, F32,  0.0,  BIG_BLOCK, BIG_BLOCK,
   BIAS},
  {"fp8 dense",        FP8,     F16,     2,  32,  32, 1, 1, I32, F32,  0.0,  16, 2,
   RESIDUAL | NO_IDS | NO_WEIGHTS},
  {"int4 decode",      INT4,    BF16,    1,  64,  32, 3, 2, I32, F32,  0.0,  32, 32,  0},
  {"int4 tails",       INT4,    F16,    23,  96, 160, 4, 3, I64, BF16, 0.2,  96, 4,
   BIAS | SWIGLU | RESIDUAL},
  {"int4 group 256",   INT4,    BF16,    9, 256,  64, 2, 2, I32, F16,  0.0,  256, 64, RESIDUAL},
  {"int4 gelu",       INT4,    F16,     1,  64,  64, 2, 2, I32, F32,  0.0,  32, 64, GELU},
  {"int4 silu clamp",  INT4,    BF16,   15,  64,  96, 3, 2, I32, F32,  0.1,  32, 32,
   BIAS | SILU_CLAMP},
  {"int4 2 chunks",    INT4,    BF16, 1100,  32,  32, 2, 1, I32, F32,  0.1,  32, 32,  BIAS},
  {"mxfp4 decode",     MXFP4,   BF16,    1,  64,  96, 3, 2, I32, F32,  0.0,  0,  0,  BIAS},
  {"mxfp4 4 rows",     MXFP4,   BF16,    2,  96,  64, 3, 2, I64, F32,  0.0,  0,  0,
   BIAS | SWIGLU | ONE_EXPERT},
  {"mxfp4 fp16 decode", MXFP4,  F16,     2,  64,  64, 2, 2, I32, F32,  0.0,  0,  0,  0},
  {"mxfp4 silu clamp", MXFP4,   BF16,   17,  96,  64, 3, 2, I64, F32,  0.1,  0,  0,
   BIAS | SILU_CLAMP},
  {"mxfp4 tails",      MXFP4,   F16,    37, 160,  96, 4, 2, I64, BF16, 0.2,  0,  0,
   BIAS | SWIGLU | RESIDUAL},
  {"mxfp4 partial chunk", MXFP4, BF16,  40, 288,  32, 1, 1, I32, F32,  0.0,  0,  0,
   RESIDUAL | NO_IDS | NO_WEIGHTS},
  {"mxfp4 2 chunks",   MXFP4,   BF16, 1100,  32,  64, 2, 1, I32, F16,  0.1,  0,  0,
   BIAS | RESIDUAL},
};
/* clang-format on */

/* One weight matrix [E, rows, cols] of a case: its logical values, and the packed tensors
 * the op reads. */
typedef struct matrix {
  int64_t rows, cols, group; /* group: INT4 group size */
  double *w;                 /* dequantized values (UNQUANT, FP8, MXFP4) */
  int8_t *q;                 /* INT8: int8 values; INT4: nibbles 0..15 */
  int8_t *zero;              /* INT4: [E, rows, cols / group] zero points */
  float *scale;              /* INT8 [E, rows]; FP8 block scales; INT4 [E, rows, groups] */
  void *packed;
  float *packed_scale; /* what the op gets as w*_scale */
  int8_t *packed_zero; /* INT4: what the op gets as w*_zero */
  uint8_t *e8m0;       /* MXFP4: [E, rows, cols / 32] scales, then packed: w*_scale_e8m0 */
} matrix;

typedef struct moe_data {
  cpumoe_moe_problem p;
  const moe_case *c;
  uint16_t *x, *x_saved, *out; /* x_saved: x before an in-place run */
  matrix w1, w2;               /* [E, 2N, K], [E, K, N] */
  float *b1, *b2;
  uint16_t *residual;
  void *ids, *weights;
  double *expected; /* [M, K] unrounded */
} moe_data;

static int64_t slot_id(const moe_data *d, int64_t s) {
  if (!d->p.topk_ids) return 0;
  return d->p.topk_ids_dtype == I32 ? ((const int32_t *)d->ids)[s] : ((const int64_t *)d->ids)[s];
}

static double slot_weight(const moe_data *d, int64_t s) {
  if (!d->p.topk_weights) return 1.0;
  switch (d->p.topk_weights_dtype) {
    case F32: return ((const float *)d->weights)[s];
    case F64: return ((const double *)d->weights)[s];
    default: return act_value(d->p.topk_weights_dtype, ((const uint16_t *)d->weights)[s]);
  }
}

/* fp8 code with a value in [-3.75, 3.75] (exponent field <= 8), never NaN; zero and
 * subnormals included */
static uint8_t rnd_e4m3(void) {
  const uint8_t b = (uint8_t)rnd_u64();
  return (uint8_t)((b & 0x87) | (uint8_t)(rnd_below(9) << 3));
}

/* Random weights of one matrix for the case's scheme, and their packed form. */
static void make_weights(const moe_case *c, matrix *m) {
  const int64_t E = c->E, rows = m->rows, cols = m->cols, n = E * rows * cols;
  const double range = 1.0 / sqrt((double)cols);
  if (c->scheme == UNQUANT) {
    uint16_t *bits = xmalloc(2 * (size_t)n);
    m->w = xmalloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
      bits[i] = act_bits(c->act, rnd_uniform(-range, range));
      m->w[i] = act_value(c->act, bits[i]);
    }
    m->packed = xmalloc(2 * (size_t)n);
    ref_pack_vnni2(bits, m->packed, 2, E, rows, cols);
    free(bits);
  } else if (c->scheme == INT8) {
    m->q = xmalloc((size_t)n);
    m->scale = xmalloc(sizeof(float) * (size_t)(E * rows));
    for (int64_t i = 0; i < n; i++) m->q[i] = (int8_t)rnd_u64();
    for (int64_t i = 0; i < E * rows; i++)
      m->scale[i] = (float)(rnd_uniform(0.5, 1.5) * range / 127);
    m->packed = xmalloc((size_t)(E * rows * (cols + 4)));
    ref_pack_vnni4(m->q, m->packed, E, rows, cols);
    m->packed_scale = m->scale;
  } else if (c->scheme == FP8) {
    /* scale blocks: a block larger than the matrix is one block */
    const int64_t bn = c->b1 < rows ? c->b1 : rows, bk = c->b2 < cols ? c->b2 : cols;
    const int64_t nb = (rows + bn - 1) / bn, kb = (cols + bk - 1) / bk;
    uint8_t *codes = xmalloc((size_t)n);
    m->w = xmalloc(sizeof(double) * (size_t)n);
    m->scale = xmalloc(sizeof(float) * (size_t)(E * nb * kb));
    for (int64_t i = 0; i < E * nb * kb; i++) m->scale[i] = (float)(rnd_uniform(0.5, 1.5) * range);
    for (int64_t e = 0; e < E; e++)
      for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) {
          const int64_t i = (e * rows + r) * cols + k;
          codes[i] = rnd_e4m3();
          /* FORMATS.md: e4m3(code) * scale, rounded once to fp32 */
          m->w[i] = (float)e4m3_value(codes[i]) * m->scale[(e * nb + r / bn) * kb + k / bk];
        }
    m->packed = xmalloc((size_t)n);
    ref_pack_vnni2(codes, m->packed, 1, E, rows, cols);
    m->packed_scale = m->scale;
    free(codes);
  } else if (c->scheme == MXFP4) {
    /* scales near 2^-2 of the matrix's range (largest code 6) with a spread of 4 */
    const int64_t groups = cols / 32, base = 127 + (int64_t)floor(log2(range)) - 3;
    uint8_t *codes = xmalloc((size_t)n), *scales = xmalloc((size_t)(E * rows * groups));
    m->w = xmalloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < E * rows * groups; i++) scales[i] = (uint8_t)(base + rnd_below(4));
    for (int64_t i = 0; i < n; i++) {
      codes[i] = (uint8_t)rnd_below(16);
      m->w[i] = mxfp4_value(codes[i], scales[i / 32]); /* (e, row, group) = i / 32 */
    }
    m->packed = xmalloc((size_t)n / 2);
    ref_pack_mxfp4(codes, m->packed, E, rows, cols);
    m->e8m0 = xmalloc((size_t)(E * rows * groups));
    ref_pack_e8m0(scales, m->e8m0, E, rows, groups);
    free(codes), free(scales);
  } else { /* INT4: nibbles 0..15, zero points 0..16 (AWQ and GPTQ ranges) */
    const int64_t groups = cols / m->group, bk = cpumoe_int4_block_k(m->group);
    m->q = xmalloc((size_t)n);
    m->zero = xmalloc((size_t)(E * rows * groups));
    m->scale = xmalloc(sizeof(float) * (size_t)(E * rows * groups));
    for (int64_t i = 0; i < n; i++) m->q[i] = (int8_t)rnd_below(16);
    for (int64_t i = 0; i < E * rows * groups; i++) {
      m->zero[i] = (int8_t)rnd_below(17);
      m->scale[i] = (float)(rnd_uniform(0.5, 1.5) * range / 8);
    }
    m->packed = xmalloc((size_t)(E * (rows / 32) * (cols / bk) * (16 * bk + 128)));
    m->packed_zero = xmalloc((size_t)(E * rows * groups));
    m->packed_scale = xmalloc(sizeof(float) * (size_t)(E * rows * groups));
    ref_pack_int4((const uint8_t *)m->q, m->zero, m->scale, E, rows, cols, groups, m->packed,
                  m->packed_zero, m->packed_scale);
  }
}

static void free_matrix(matrix *m) {
  if (m->packed_scale != m->scale) free(m->packed_scale);
  free(m->w), free(m->q), free(m->zero), free(m->scale), free(m->packed), free(m->packed_zero);
  free(m->e8m0);
}

/* INT8 and INT4 activations, as documented: per row, amax = max |v| (at least 1e-7),
 * scale = amax / 127, q = clamp(round_half_even(v * 127 / amax), -127, 127); fp32. */
static float quantize_row(const double *v, int64_t n, int32_t *q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf((float)v[i]));
  if (!(amax >= 1e-7f)) amax = 1e-7f;
  const float inv = 127.0f / amax;
  for (int64_t i = 0; i < n; i++) {
    float r = nearbyintf((float)v[i] * inv);
    q[i] = (int32_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
  }
  return amax / 127.0f;
}

/* out = W[e] @ v in double; INT8 and INT4 quantize v first */
static void matvec(const moe_case *c, const matrix *m, int64_t e, const double *v, double *out) {
  const int64_t rows = m->rows, cols = m->cols;
  if (c->scheme == INT8 || c->scheme == INT4) {
    int32_t *q = xmalloc(sizeof(int32_t) * (size_t)cols);
    const double vs = quantize_row(v, cols, q);
    for (int64_t r = 0; r < rows; r++) {
      const int64_t row = e * rows + r;
      const int8_t *w = m->q + row * cols;
      double acc = 0.0;
      if (c->scheme == INT8) {
        for (int64_t k = 0; k < cols; k++) acc += (double)q[k] * w[k];
        acc *= m->scale[row];
      } else { /* (w - zero) * scale per group */
        const int64_t groups = cols / m->group;
        for (int64_t k = 0; k < cols; k++)
          acc += (double)q[k] * (w[k] - m->zero[row * groups + k / m->group]) *
                 m->scale[row * groups + k / m->group];
      }
      out[r] = acc * vs;
    }
    free(q);
    return;
  }
  const double *w = m->w + e * rows * cols;
  for (int64_t r = 0; r < rows; r++) {
    double acc = 0.0;
    for (int64_t k = 0; k < cols; k++) acc += w[r * cols + k] * v[k];
    out[r] = acc;
  }
}

static double sigmoid(double x) {
  return 1.0 / (1.0 + exp(-x));
}

/* docs/MATH.md, with the rounding points of cpumoe.h: act(h) rounded to the
 * activation dtype; everything else exact (double). */
static void reference(moe_data *d) {
  const moe_case *c = d->c;
  const cpumoe_moe_problem *p = &d->p;
  const int64_t K = c->K, N = c->N;
  double *x = xmalloc(sizeof(double) * (size_t)K), *h = xmalloc(sizeof(double) * (size_t)(2 * N));
  double *a = xmalloc(sizeof(double) * (size_t)N), *y = xmalloc(sizeof(double) * (size_t)K);
  const uint16_t *residual = (c->flags & OUT_IS_X) ? d->x_saved : d->residual;
  for (int64_t m = 0; m < c->M; m++) {
    double *acc = d->expected + m * K;
    for (int64_t k = 0; k < K; k++) {
      x[k] = act_value(c->act, d->x_saved[m * K + k]);
      acc[k] = p->residual ? p->residual_scale * act_value(c->act, residual[m * K + k]) : 0.0;
    }
    for (int64_t j = 0; j < c->topk; j++) {
      const int64_t e = slot_id(d, m * c->topk + j);
      if (e < 0) continue;
      matvec(c, &d->w1, e, x, h);
      for (int64_t r = 0; r < 2 * N; r++) h[r] += d->b1 ? d->b1[e * 2 * N + r] : 0.0;
      for (int64_t n = 0; n < N; n++) {
        if (c->flags & SWIGLU) { /* interleaved rows: gate 2n, up 2n + 1 */
          const double g = fmin(h[2 * n], p->limit);
          const double u = fmax(fmin(h[2 * n + 1], p->limit), -p->limit);
          a[n] = g * sigmoid(p->alpha * g) * (u + 1.0);
        } else if (c->flags & SILU_CLAMP) { /* [gate; up] rows */
          const double g = fmin(h[n], p->limit);
          a[n] = g * sigmoid(g) * fmax(fmin(h[N + n], p->limit), -p->limit);
        } else if (c->flags & GELU) {
          a[n] = h[n] * 0.5 * erfc(-h[n] * 0.70710678118654752440) * h[N + n];
        } else {
          a[n] = h[n] * sigmoid(h[n]) * h[N + n];
        }
        a[n] = act_round(c->act, a[n]);
      }
      matvec(c, &d->w2, e, a, y);
      const double g = slot_weight(d, m * c->topk + j);
      for (int64_t k = 0; k < K; k++) acc[k] += (y[k] + (d->b2 ? d->b2[e * K + k] : 0.0)) * g;
    }
  }
  free(x), free(h), free(a), free(y);
}

static void make_data(const moe_case *c, moe_data *d) {
  memset(d, 0, sizeof *d);
  d->c = c;
  const int64_t M = c->M, K = c->K, N = c->N, E = c->E, slots = M * c->topk;
  d->x = xmalloc(2 * (size_t)(M * K));
  d->x_saved = xmalloc(2 * (size_t)(M * K));
  for (int64_t i = 0; i < M * K; i++) d->x[i] = act_bits(c->act, rnd_uniform(-1.0, 1.0));
  memcpy(d->x_saved, d->x, 2 * (size_t)(M * K));
  d->out = (c->flags & OUT_IS_X) ? d->x : xmalloc(2 * (size_t)(M * K));
  d->w1 = (matrix){.rows = 2 * N, .cols = K, .group = c->b1};
  d->w2 = (matrix){.rows = K, .cols = N, .group = c->b2};
  make_weights(c, &d->w1);
  make_weights(c, &d->w2);
  if (c->flags & BIAS) {
    d->b1 = xmalloc(sizeof(float) * (size_t)(E * 2 * N));
    d->b2 = xmalloc(sizeof(float) * (size_t)(E * K));
    for (int64_t i = 0; i < E * 2 * N; i++) d->b1[i] = (float)rnd_uniform(-0.5, 0.5);
    for (int64_t i = 0; i < E * K; i++) d->b2[i] = (float)rnd_uniform(-0.5, 0.5);
  }
  if ((c->flags & RESIDUAL) && !(c->flags & OUT_IS_X)) {
    d->residual = xmalloc(2 * (size_t)(M * K));
    for (int64_t i = 0; i < M * K; i++) d->residual[i] = act_bits(c->act, rnd_uniform(-2.0, 2.0));
  }
  if (!(c->flags & NO_IDS)) {
    d->ids = xmalloc(8 * (size_t)slots);
    for (int64_t s = 0; s < slots; s++) {
      const int64_t e = rnd_uniform(0, 1) < c->skip ? -1
                        : (c->flags & ONE_EXPERT)   ? E - 1
                                                    : rnd_below(E);
      if (c->ids_dtype == I32)
        ((int32_t *)d->ids)[s] = (int32_t)e;
      else
        ((int64_t *)d->ids)[s] = e;
    }
  }
  if (!(c->flags & NO_WEIGHTS)) {
    d->weights = xmalloc(8 * (size_t)slots);
    for (int64_t s = 0; s < slots; s++) {
      const double w = rnd_uniform(0.1, 1.0);
      switch (c->weights_dtype) {
        case F32: ((float *)d->weights)[s] = (float)w; break;
        case F64: ((double *)d->weights)[s] = w; break;
        default: ((uint16_t *)d->weights)[s] = act_bits(c->weights_dtype, w);
      }
    }
  }
  d->p = (cpumoe_moe_problem){
      .M = M,
      .K = K,
      .N = N,
      .E = E,
      .topk = c->topk,
      .scheme = c->scheme,
      .act_dtype = c->act,
      .activation = (c->flags & SWIGLU)       ? CPUMOE_ACT_SWIGLU_CLAMP
                    : (c->flags & GELU)       ? CPUMOE_ACT_GELU_MUL
                    : (c->flags & SILU_CLAMP) ? CPUMOE_ACT_SILU_CLAMP
                                              : CPUMOE_ACT_SILU_MUL,
      .alpha = 1.702f,
      .limit = 0.5f, /* small enough that the clamps act on these magnitudes */
      .x = d->x,
      .w1 = d->w1.packed,
      .w2 = d->w2.packed,
      .w1_scale = d->w1.packed_scale,
      .w2_scale = d->w2.packed_scale,
      .block_n = c->scheme == FP8 ? c->b1 : 0,
      .block_k = c->scheme == FP8 ? c->b2 : 0,
      .w1_zero = d->w1.packed_zero,
      .w2_zero = d->w2.packed_zero,
      .w1_group = c->scheme == INT4 ? c->b1 : 0,
      .w2_group = c->scheme == INT4 ? c->b2 : 0,
      .w1_scale_e8m0 = d->w1.e8m0,
      .w2_scale_e8m0 = d->w2.e8m0,
      .topk_ids = d->ids,
      .topk_ids_dtype = c->ids_dtype,
      .topk_weights = d->weights,
      .topk_weights_dtype = c->weights_dtype,
      .w1_bias = d->b1,
      .w2_bias = d->b2,
      .residual = !(c->flags & RESIDUAL)  ? NULL
                  : (c->flags & OUT_IS_X) ? d->x
                                          : d->residual,
      .residual_scale = 0.75f,
      .out = d->out,
  };
  d->expected = xmalloc(sizeof(double) * (size_t)(M * K));
  reference(d);
}

static void free_data(moe_data *d) {
  if (d->out != d->x) free(d->out);
  free_matrix(&d->w1), free_matrix(&d->w2);
  free(d->x), free(d->x_saved), free(d->b1), free(d->b2), free(d->residual), free(d->ids);
  free(d->weights), free(d->expected);
}

/* Runs the op with a fresh workspace of exactly the size asked for, `offset` bytes past a
 * malloc'd block (so it ends where the block ends), filled with garbage; out starts as
 * NaNs so an element the op forgot is caught. */
static cpumoe_status run_op(moe_data *d, const cpumoe_runner *runner, size_t offset) {
  const size_t bytes = cpumoe_fused_experts_workspace_size(&d->p);
  CHECK(bytes > 0, "%s: workspace size 0 for a valid problem (%s)", d->c->name,
        cpumoe_last_error());
  char *block = xmalloc(bytes + offset);
  memset(block, 0xff, bytes + offset);
  const size_t out_bytes = 2 * (size_t)(d->c->M * d->c->K);
  if (d->out == d->x)
    memcpy(d->x, d->x_saved, out_bytes);
  else
    memset(d->out, 0xff, out_bytes);
  const cpumoe_status st = cpumoe_fused_experts(&d->p, block + offset, bytes, runner);
  free(block);
  return st;
}

/* Largest |out - expected| over the output, relative to the output's scale (max |expected|). */
static double relative_error(const moe_data *d) {
  const int64_t n = d->c->M * d->c->K;
  double scale = 1e-3, worst = 0.0;
  for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(d->expected[i]));
  for (int64_t i = 0; i < n; i++) {
    const double err = fabs(act_value(d->c->act, d->out[i]) - d->expected[i]) / scale;
    if (!(err <= worst)) worst = err; /* NaN sticks */
  }
  return worst;
}

/* Error budget in units of the output scale, from the ulp at 1 of the activation dtype
 * (2^-8 bf16, 2^-11 fp16): rounding the output takes up to half an ulp, rounding act(h) a
 * little more; INT8 and INT4 get twice the budget for quantization codes that land on the other
 * side of a rounding boundary (the reference restates the quantization itself). */
static double tolerance(const moe_case *c) {
  const double ulp = c->act == BF16 ? 0x1p-8 : 0x1p-11;
  return c->scheme == INT8 || c->scheme == INT4 ? 4 * ulp : 2 * ulp;
}

/* The scalar tier's bits for the case, made without checks (so that they count for no tier)
 * when scalar is not under test; its status is checked with the first comparison. */
static cpumoe_status scalar_reference(moe_data *d, uint16_t *bits) {
  cpumoe_set_isa_cap(CPUMOE_ISA_SCALAR);
  const size_t bytes = cpumoe_fused_experts_workspace_size(&d->p);
  char *ws = xmalloc(bytes);
  if (d->out == d->x) memcpy(d->x, d->x_saved, 2 * (size_t)(d->c->M * d->c->K));
  const cpumoe_status st = cpumoe_fused_experts(&d->p, ws, bytes, NULL);
  free(ws);
  memcpy(bits, d->out, 2 * (size_t)(d->c->M * d->c->K));
  cpumoe_set_isa_cap(g_tier);
  return st;
}

/* Whether two tiers must give the same bits: the same numerics class, or fp32-chain-daz
 * against fp32-chain, which differ only where a denormal occurs (docs/NUMERICS.md) and the
 * cases here make none. Across other classes the tolerance against the reference is the
 * check. */
static int same_bits_expected(cpumoe_isa a, cpumoe_isa b) {
  const char *ca = cpumoe_isa_numerics(a), *cb = cpumoe_isa_numerics(b);
  const size_t chain = strlen("fp32-chain");
  return strcmp(ca, cb) == 0 ||
         (strncmp(ca, "fp32-chain", chain) == 0 && strncmp(cb, "fp32-chain", chain) == 0 &&
          (strcmp(ca + chain, "-daz") == 0 || strcmp(cb + chain, "-daz") == 0));
}

/* The case again with out_f32 (into a buffer of its own): the fp32 sum, rounded once here,
 * must give `bits`, the 16-bit output of the same tier; serial and threaded alike. */
static void check_out_f32(moe_data *d, const uint16_t *bits, const char *tier) {
  const int64_t n = d->c->M * d->c->K;
  float *sums = xmalloc(sizeof(float) * (size_t)n);
  cpumoe_moe_problem p = d->p;
  p.out = sums;
  p.out_f32 = 1;
  if (d->out == d->x) memcpy(d->x, d->x_saved, 2 * (size_t)n); /* x (and residual) as given */
  const size_t bytes = cpumoe_fused_experts_workspace_size(&p);
  char *ws = xmalloc(bytes);
  for (int threaded = 0; threaded < 2; threaded++) {
    memset(sums, 0xff, sizeof(float) * (size_t)n); /* NaN: an element not written shows */
    const cpumoe_status st = cpumoe_fused_experts(&p, ws, bytes, threaded ? &g_threads : NULL);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += act_bits(d->c->act, sums[i]) != bits[i];
    CHECK(st == CPUMOE_OK && differ == 0,
          "%s [%s]: the float32 out rounded once differs from the 16-bit out in %lld of %lld "
          "elements (%s, status %d)",
          d->c->name, tier, (long long)differ, (long long)n, threaded ? "threaded" : "serial",
          (int)st);
  }
  free(ws);
  free(sums);
}

static void test_case(const moe_case *c) {
  moe_data d;
  make_data(c, &d);
  const size_t out_bytes = 2 * (size_t)(c->M * c->K);
  uint16_t *first = NULL; /* scalar tier's output: every tier must give these bits */
  cpumoe_status first_status = CPUMOE_OK;
  for (int isa = CPUMOE_ISA_SCALAR; isa < CPUMOE_ISA_COUNT; isa++) {
    if (!g_tested[isa]) continue;
    use_tier((cpumoe_isa)isa);
    const char *tier = cpumoe_isa_name((cpumoe_isa)isa);
    if (!first && isa != CPUMOE_ISA_SCALAR) {
      first = xmalloc(out_bytes);
      first_status = scalar_reference(&d, first);
    }
    CHECK(cpumoe_active_isa() == (cpumoe_isa)isa, "cap %s not applied", tier);
    cpumoe_status st = run_op(&d, NULL, 0);
    CHECK(st == CPUMOE_OK, "%s [%s]: status %d (%s)", c->name, tier, (int)st, cpumoe_last_error());
    const double err = relative_error(&d);
    if (g_verbose)
      printf("  %-18s %-7s max error %.2e of scale (tolerance %.1e), cpu %.2f s\n", c->name, tier,
             err, tolerance(c), (double)clock() / CLOCKS_PER_SEC);
    CHECK(err <= tolerance(c), "%s [%s]: error %.3g of the output scale > %.3g", c->name, tier, err,
          tolerance(c));
    if (!first) {
      first = xmalloc(out_bytes);
      memcpy(first, d.out, out_bytes);
    } else {
      CHECK(first_status == CPUMOE_OK && (!same_bits_expected((cpumoe_isa)isa, CPUMOE_ISA_SCALAR) ||
                                          memcmp(first, d.out, out_bytes) == 0),
            "%s: tier %s differs from scalar (scalar's status %d)", c->name, tier,
            (int)first_status);
    }
    /* several threads, unaligned workspace: the same bits */
    uint16_t *serial = xmalloc(out_bytes);
    memcpy(serial, d.out, out_bytes);
    g_runner_stats = (runner_stats){0, 0};
    st = run_op(&d, &g_threads, 1);
    CHECK(st == CPUMOE_OK && memcmp(serial, d.out, out_bytes) == 0,
          "%s [%s]: threaded run differs from serial (status %d)", c->name, tier, (int)st);
    check_out_f32(&d, serial, tier);
    free(serial);
    CHECK(c->M * c->topk < 2 || g_runner_stats.calls > 0, "%s: the runner was never used", c->name);
  }
  use_tier(g_home);
  free(first);
  free_data(&d);
}

static void test_fused(void) {
  for (size_t i = 0; i < sizeof g_cases / sizeof g_cases[0]; i++) test_case(&g_cases[i]);

  /* M = 0: nothing to do for any scheme; NULL tensors allowed, nothing written */
  static const cpumoe_scheme schemes[] = {UNQUANT, INT8, FP8, INT4, MXFP4};
  float scale = 1.0f;
  int8_t zero = 0;
  uint8_t e8m0 = 127;
  uint16_t sentinel = 0x1234;
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
    const cpumoe_moe_problem p = {
        .M = 0,
        .K = 32,
        .N = 32,
        .E = 2,
        .topk = 2,
        .scheme = schemes[i],
        .act_dtype = BF16,
        .w1_scale = &scale,
        .w2_scale = &scale,
        .block_n = 128,
        .block_k = 128,
        .w1_zero = &zero,
        .w2_zero = &zero,
        .w1_group = 32,
        .w2_group = 32,
        .w1_scale_e8m0 = &e8m0,
        .w2_scale_e8m0 = &e8m0,
        .out = &sentinel,
    };
    const size_t bytes = cpumoe_fused_experts_workspace_size(&p);
    CHECK(bytes > 0, "M=0 scheme %d: workspace size 0 (%s)", (int)schemes[i], cpumoe_last_error());
    void *ws = xmalloc(bytes);
    CHECK(cpumoe_fused_experts(&p, ws, bytes, &g_threads) == CPUMOE_OK && sentinel == 0x1234,
          "M=0 scheme %d failed or wrote (%s)", (int)schemes[i], cpumoe_last_error());
    free(ws);
  }
}

/* ---- activations (cpumoe_activation_values) ------------------------------------------- */

static int same_float_bits(float a, float b) { /* any NaN matches any NaN */
  uint32_t ua, ub;
  memcpy(&ua, &a, sizeof ua), memcpy(&ub, &b, sizeof ub);
  return ua == ub || (a != a && b != b);
}

/* Every activation on a grid of (gate, up) pairs (around +-limit, zeros, infinities, NaN):
 * each tier gives the scalar tier's bits. The clamped silu gives silu_mul's bits where
 * nothing is clamped, NaN where gate or up is NaN, and elsewhere its double restatement
 * (gates below -80 left out: there the kernels' exp clamps its argument, as for silu_mul).
 * A NaN or negative limit and an unknown activation are rejected. */
static void test_activations(void) {
  enum { SIDE = 24, COUNT = SIDE * SIDE, ACTS = 4 };
  const float limit = 1.5f;
  const float side[SIDE] = {NAN,
                            INFINITY,
                            -INFINITY,
                            0.0f,
                            -0.0f,
                            limit,
                            -limit,
                            nextafterf(limit, 0.0f),
                            nextafterf(limit, 2.0f),
                            nextafterf(-limit, 0.0f),
                            nextafterf(-limit, -2.0f),
                            0.25f,
                            -0.25f,
                            1.0f,
                            -1.0f,
                            3.0f,
                            -3.0f,
                            10.0f,
                            -10.0f,
                            50.0f,
                            -50.0f,
                            1e-30f,
                            -1e-30f,
                            3e38f};
  static const cpumoe_activation acts[ACTS] = {CPUMOE_ACT_SILU_MUL, CPUMOE_ACT_SWIGLU_CLAMP,
                                               CPUMOE_ACT_GELU_MUL, CPUMOE_ACT_SILU_CLAMP};
  static float gate[COUNT], up[COUNT], out[COUNT], silu[COUNT], scalar[ACTS][COUNT];
  for (int i = 0; i < COUNT; i++) gate[i] = side[i / SIDE], up[i] = side[i % SIDE];
  int have_scalar = 0;
  for (int isa = CPUMOE_ISA_SCALAR; isa < CPUMOE_ISA_COUNT; isa++) {
    if (!g_tested[isa]) continue;
    use_tier((cpumoe_isa)isa);
    const char *tier = cpumoe_isa_name((cpumoe_isa)isa);
    if (!have_scalar) { /* the scalar tier's bits, counting for no tier */
      cpumoe_set_isa_cap(CPUMOE_ISA_SCALAR);
      for (int a = 0; a < ACTS; a++)
        CHECK(cpumoe_activation_values(acts[a], 1.702f, limit, COUNT, gate, up, scalar[a]) ==
                  CPUMOE_OK,
              "activation %d [scalar]: %s", (int)acts[a], cpumoe_last_error());
      cpumoe_set_isa_cap((cpumoe_isa)isa);
      have_scalar = 1;
    }
    for (int a = 0; a < ACTS; a++) {
      const cpumoe_status st =
          cpumoe_activation_values(acts[a], 1.702f, limit, COUNT, gate, up, out);
      int differ = 0;
      for (int i = 0; i < COUNT; i++) differ += !same_float_bits(out[i], scalar[a][i]);
      CHECK(st == CPUMOE_OK && differ == 0,
            "activation %d [%s]: %d of %d values differ from scalar (status %d)", (int)acts[a],
            tier, differ, COUNT, (int)st);
    }
    cpumoe_activation_values(CPUMOE_ACT_SILU_MUL, 0.0f, 0.0f, COUNT, gate, up, silu);
    cpumoe_activation_values(CPUMOE_ACT_SILU_CLAMP, 0.0f, limit, COUNT, gate, up, out);
    int wrong = 0;
    for (int i = 0; i < COUNT; i++) {
      const float g = gate[i], u = up[i];
      if (g != g || u != u) {
        wrong += out[i] == out[i];
      } else if (g <= limit && fabsf(u) <= limit) {
        wrong += !same_float_bits(out[i], silu[i]);
      } else if (g > -80.0f) {
        const double gc = fmin(g, limit), uc = fmax(fmin(u, limit), -limit);
        const double want = gc * sigmoid(gc) * uc;
        wrong += !(fabs(out[i] - want) <= 1e-6 * fabs(want) + 1e-37);
      }
    }
    CHECK(wrong == 0, "clamped silu [%s]: %d of %d values wrong", tier, wrong, COUNT);
  }
  use_tier(g_home);
  CHECK_ERROR("activation_values NaN limit",
              cpumoe_activation_values(CPUMOE_ACT_SILU_CLAMP, 0.0f, NAN, 4, gate, up, out),
              CPUMOE_EINVAL, "limit must be >= 0");
  CHECK_ERROR("activation_values limit < 0",
              cpumoe_activation_values(CPUMOE_ACT_SILU_CLAMP, 0.0f, -0.5f, 4, gate, up, out),
              CPUMOE_EINVAL, "got -0.5");
  CHECK_ERROR("activation_values unknown",
              cpumoe_activation_values((cpumoe_activation)9, 0.0f, 1.0f, 4, gate, up, out),
              CPUMOE_EINVAL, "activation 9");
}

/* ---- fused experts: rejected inputs --------------------------------------------------- */

static void test_fused_errors(void) {
  const moe_case c = {"errors", UNQUANT, BF16, 2, 32, 32, 2, 2, I32, F32, 0.0, 0, 0, 0};
  moe_data d;
  make_data(&c, &d);
  const cpumoe_moe_problem good = d.p;
  cpumoe_moe_problem p;
  const size_t bytes = cpumoe_fused_experts_workspace_size(&good);
  char *ws = xmalloc(bytes);
  float scale = 1.0f, bias = 0.0f;
  float f32_out[2 * 32]; /* an fp32 out [M, K] of its own */
  int8_t zero = 0;

  /* Each mutation of the good problem: the status, a word of the message, and that the
   * workspace query says 0. */
#define REJECT(what, mutation, status, needle)                                             \
  do {                                                                                     \
    p = good;                                                                              \
    mutation;                                                                              \
    CHECK(cpumoe_fused_experts_workspace_size(&p) == 0, "%s: workspace size not 0", what); \
    CHECK_ERROR(what, cpumoe_fused_experts(&p, ws, bytes, NULL), status, needle);          \
  } while (0)

  CHECK(cpumoe_fused_experts_workspace_size(NULL) == 0, "NULL problem: workspace size not 0");
  CHECK_ERROR("NULL problem", cpumoe_fused_experts(NULL, ws, bytes, NULL), CPUMOE_EINVAL, "NULL");
  REJECT("M<0", p.M = -1, CPUMOE_EINVAL, "M");
  REJECT("K=0", p.K = 0, CPUMOE_EINVAL, "K=0");
  REJECT("N<0", p.N = -32, CPUMOE_EINVAL, "N=-32");
  REJECT("E=0", p.E = 0, CPUMOE_EINVAL, "E=0");
  REJECT("topk=0", p.topk = 0, CPUMOE_EINVAL, "topk=0");
  REJECT("K%32", p.K = 48, CPUMOE_EUNSUPPORTED, "K=48");
  REJECT("N%32", p.N = 80, CPUMOE_EUNSUPPORTED, "N=80");
  REJECT("scheme", p.scheme = (cpumoe_scheme)99, CPUMOE_EUNSUPPORTED, "99");
  REJECT("act dtype", p.act_dtype = F32, CPUMOE_EINVAL, "activations");
  REJECT("activation", p.activation = (cpumoe_activation)7, CPUMOE_EINVAL, "activation 7");
  REJECT("silu clamp NaN limit", (p.activation = CPUMOE_ACT_SILU_CLAMP, p.limit = NAN),
         CPUMOE_EINVAL, "limit must be >= 0");
  REJECT("silu clamp limit < 0", (p.activation = CPUMOE_ACT_SILU_CLAMP, p.limit = -1.0f),
         CPUMOE_EINVAL, "got -1");
  REJECT("w1_bias only", p.w1_bias = &bias, CPUMOE_EINVAL, "w1_bias");
  REJECT("w2_bias only", p.w2_bias = &bias, CPUMOE_EINVAL, "w2_bias");
  REJECT("ids dtype", p.topk_ids_dtype = F32, CPUMOE_EINVAL, "topk_ids");
  REJECT("weights dtype", p.topk_weights_dtype = I64, CPUMOE_EINVAL, "topk_weights");
  REJECT("x NULL", p.x = NULL, CPUMOE_EINVAL, "NULL");
  REJECT("w1 NULL", p.w1 = NULL, CPUMOE_EINVAL, "NULL");
  REJECT("w2 NULL", p.w2 = NULL, CPUMOE_EINVAL, "NULL");
  REJECT("out NULL", p.out = NULL, CPUMOE_EINVAL, "NULL");
  REJECT("out_f32 2", p.out_f32 = 2, CPUMOE_EINVAL, "out_f32");
  REJECT("f32 out is x", (p.out_f32 = 1, p.out = d.x), CPUMOE_EINVAL, "overlap");
  REJECT("f32 out overlaps x", (p.out_f32 = 1, p.out = d.x + 32), CPUMOE_EINVAL, "overlap");
  REJECT("f32 out overlaps residual", (p.out_f32 = 1, p.out = f32_out, p.residual = f32_out + 3),
         CPUMOE_EINVAL, "overlap");
  REJECT("int8 no w1_scale", (p.scheme = INT8, p.w2_scale = &scale), CPUMOE_EINVAL, "w1_scale");
  REJECT("int8 no w2_scale", (p.scheme = INT8, p.w1_scale = &scale), CPUMOE_EINVAL, "w2_scale");
  REJECT("int8 K>65536", (p.scheme = INT8, p.w1_scale = p.w2_scale = &scale, p.K = 65568),
         CPUMOE_EUNSUPPORTED, "65568");
  REJECT("int8 N>65536", (p.scheme = INT8, p.w1_scale = p.w2_scale = &scale, p.N = 65568),
         CPUMOE_EUNSUPPORTED, "65568");
  REJECT("fp8 no scales", (p.scheme = FP8, p.block_n = p.block_k = 128), CPUMOE_EINVAL, "scale");
  REJECT("fp8 block_k odd",
         (p.scheme = FP8, p.w1_scale = p.w2_scale = &scale, p.block_n = 128, p.block_k = 127),
         CPUMOE_EUNSUPPORTED, "127");
  REJECT("fp8 block_k 0",
         (p.scheme = FP8, p.w1_scale = p.w2_scale = &scale, p.block_n = 128, p.block_k = 0),
         CPUMOE_EUNSUPPORTED, "block");
  REJECT("fp8 block_n 0",
         (p.scheme = FP8, p.w1_scale = p.w2_scale = &scale, p.block_n = 0, p.block_k = 128),
         CPUMOE_EUNSUPPORTED, "block");
  REJECT("int4 no zeros",
         (p.scheme = INT4, p.w1_scale = p.w2_scale = &scale, p.w1_group = p.w2_group = 32),
         CPUMOE_EINVAL, "w1_zero");
  REJECT("int4 group 6",
         (p.scheme = INT4, p.w1_scale = p.w2_scale = &scale, p.w1_zero = p.w2_zero = &zero,
          p.w1_group = 6, p.w2_group = 32),
         CPUMOE_EUNSUPPORTED, "group sizes 6");
  REJECT("int4 group > K",
         (p.scheme = INT4, p.w1_scale = p.w2_scale = &scale, p.w1_zero = p.w2_zero = &zero,
          p.w1_group = 64, p.w2_group = 32),
         CPUMOE_EUNSUPPORTED, "K=32");
  uint8_t e8m0 = 127;
  REJECT("mxfp4 no w1 scales", (p.scheme = MXFP4, p.w2_scale_e8m0 = &e8m0), CPUMOE_EINVAL,
         "w1_scale_e8m0");
  REJECT("mxfp4 no w2 scales", (p.scheme = MXFP4, p.w1_scale_e8m0 = &e8m0), CPUMOE_EINVAL,
         "w2_scale_e8m0");
#undef REJECT

  /* ids out of range: found before any kernel runs, so out keeps its contents */
  static const int64_t bad_ids[] = {2, -2, INT64_C(1) << 40, INT64_MIN};
  for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++)
    for (int wide = 0; wide < 2; wide++) {
      if (!wide && (bad_ids[i] > INT32_MAX || bad_ids[i] < INT32_MIN)) continue;
      int32_t ids32[4] = {0, 1, 1, 0};
      int64_t ids64[4] = {0, 1, 1, 0};
      ids32[3] = (int32_t)bad_ids[i], ids64[3] = bad_ids[i];
      p = good;
      p.topk_ids = wide ? (const void *)ids64 : (const void *)ids32;
      p.topk_ids_dtype = wide ? I64 : I32;
      memset(d.out, 0x33, 2 * 2 * 32);
      CHECK_ERROR("id out of range", cpumoe_fused_experts(&p, ws, bytes, NULL), CPUMOE_EINVAL,
                  "topk_ids[1, 1]");
      int untouched = 1;
      for (int k = 0; k < 2 * 32; k++) untouched &= d.out[k] == 0x3333;
      CHECK(untouched, "id %lld out of range: out was written", (long long)bad_ids[i]);
    }

  /* workspace: missing or one byte short fails; exactly the size asked for works */
  CHECK_ERROR("workspace NULL", cpumoe_fused_experts(&good, NULL, bytes, NULL), CPUMOE_EWORKSPACE,
              "workspace");
  CHECK_ERROR("workspace short", cpumoe_fused_experts(&good, ws, bytes - 1, NULL),
              CPUMOE_EWORKSPACE, "workspace");
  CHECK(cpumoe_fused_experts(&good, ws, bytes, NULL) == CPUMOE_OK, "exact workspace: %s",
        cpumoe_last_error());
  free(ws);
  free_data(&d);
}

/* ---- dense linear (cpumoe_linear) ----------------------------------------------------
 * One packed weight [N, K] per case, made as the single expert of a fused case's w1
 * (make_weights); the reference is matvec (which quantizes x for INT8 and INT4 as
 * documented) plus bias, in double, rounded nowhere. */

typedef struct linear_case {
  const char *name;
  cpumoe_scheme scheme;
  cpumoe_dtype act;
  int64_t M, K, N;
  int64_t b1, b2; /* FP8: block_n, block_k; INT4: group (b1) */
  int bias;
} linear_case;

/* 1030 and 1100 rows are two chunks; INT4 group 4 makes blocks of 4 k; FP8 blocks that
 * divide neither dimension; the "streamed" cases have more than CM_CACHED_RESULT_BYTES of
 * output (256 KiB), which is written with streaming stores; 45 rows are two panels that the
 * amx tier takes in one call. */
/* clang-format off */
static const linear_case g_linear_cases[] = {
  /* name               scheme   act     M     K    N   b1  b2  bias */
  {"bf16 decode",       UNQUANT, BF16,    1,  64,  96,  0,  0, 1},
  {"fp16 tails",        UNQUANT, F16,    61,  96, 160,  0,  0, 1},
  {"bf16 2 chunks",     UNQUANT, BF16, 1100,  32,  64,  0,  0, 0},
  {"bf16 streamed",     UNQUANT, BF16,  600,  64, 288,  0,  0, 1},
  {"bf16 block of 45",  UNQUANT, BF16,   45, 128,  64,  0,  0, 1},
  {"int8 decode",       INT8,    BF16,    1,  96,  64,  0,  0, 1},
  {"int8 rows",         INT8,    F16,    50, 160,  32,  0,  0, 0},
  {"int8 streamed",     INT8,    F16,   520,  96, 256,  0,  0, 1},
  {"fp8 decode",        FP8,     BF16,    2,  96,  96, 32, 64, 1},
  {"fp8 odd blocks",    FP8,     F16,    37, 160,  64, 48,  6, 1},
  {"int4 decode",       INT4,    BF16,    1, 256,  64, 128, 0, 1},
  {"int4 group 4",      INT4,    F16,    29,  96, 160,  4,  0, 0},
  {"int4 2 chunks",     INT4,    BF16, 1030,  64,  32, 32,  0, 1},
};
/* clang-format on */

typedef struct linear_data {
  cpumoe_linear_problem p;
  const linear_case *c;
  moe_case weights_case; /* the case make_weights and matvec read: one expert */
  matrix w;              /* [N, K] */
  uint16_t *x, *out;
  float *bias;
  double *expected; /* [M, N] unrounded */
} linear_data;

static void make_linear_data(const linear_case *c, linear_data *d) {
  memset(d, 0, sizeof *d);
  d->c = c;
  const int64_t M = c->M, K = c->K, N = c->N;
  d->weights_case = (moe_case){.name = c->name,
                               .scheme = c->scheme,
                               .act = c->act,
                               .M = M,
                               .K = K,
                               .N = N,
                               .E = 1,
                               .topk = 1,
                               .b1 = c->b1,
                               .b2 = c->b2};
  d->w = (matrix){.rows = N, .cols = K, .group = c->b1};
  make_weights(&d->weights_case, &d->w);
  d->x = xmalloc(2 * (size_t)(M * K) + 2);
  d->out = xmalloc(2 * (size_t)(M * N) + 2);
  for (int64_t i = 0; i < M * K; i++) d->x[i] = act_bits(c->act, rnd_uniform(-1.0, 1.0));
  if (c->bias) {
    d->bias = xmalloc(sizeof(float) * (size_t)N);
    for (int64_t n = 0; n < N; n++) d->bias[n] = (float)rnd_uniform(-0.5, 0.5);
  }
  d->p = (cpumoe_linear_problem){
      .M = M,
      .K = K,
      .N = N,
      .scheme = c->scheme,
      .act_dtype = c->act,
      .x = d->x,
      .w = d->w.packed,
      .w_scale = d->w.packed_scale,
      .block_n = c->scheme == FP8 ? c->b1 : 0,
      .block_k = c->scheme == FP8 ? c->b2 : 0,
      .w_zero = d->w.packed_zero,
      .w_group = c->scheme == INT4 ? c->b1 : 0,
      .bias = d->bias,
      .out = d->out,
  };
  d->expected = xmalloc(sizeof(double) * (size_t)(M * N));
  double *row = xmalloc(sizeof(double) * (size_t)K);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t k = 0; k < K; k++) row[k] = act_value(c->act, d->x[m * K + k]);
    double *e = d->expected + m * N;
    matvec(&d->weights_case, &d->w, 0, row, e);
    for (int64_t n = 0; n < N; n++) e[n] += d->bias ? d->bias[n] : 0.0;
  }
  free(row);
}

static void free_linear_data(linear_data *d) {
  free_matrix(&d->w);
  free(d->x), free(d->out), free(d->bias), free(d->expected);
}

/* cpumoe_linear with a fresh workspace of exactly the size asked for, `offset` bytes into
 * a garbage-filled block; out starts as NaNs. */
static cpumoe_status run_linear(linear_data *d, const cpumoe_runner *runner, size_t offset) {
  const size_t bytes = cpumoe_linear_workspace_size(&d->p);
  CHECK(bytes > 0, "%s: linear workspace size 0 for a valid problem (%s)", d->c->name,
        cpumoe_last_error());
  char *block = xmalloc(bytes + offset);
  memset(block, 0xff, bytes + offset);
  memset(d->out, 0xff, 2 * (size_t)(d->c->M * d->c->N));
  const cpumoe_status st = cpumoe_linear(&d->p, block + offset, bytes, runner);
  free(block);
  return st;
}

static double linear_relative_error(const linear_data *d) {
  const int64_t n = d->c->M * d->c->N;
  double scale = 1e-3, worst = 0.0;
  for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(d->expected[i]));
  for (int64_t i = 0; i < n; i++) {
    const double err = fabs(act_value(d->c->act, d->out[i]) - d->expected[i]) / scale;
    if (!(err <= worst)) worst = err; /* NaN sticks */
  }
  return worst;
}

static void test_linear_case(const linear_case *c) {
  linear_data d;
  make_linear_data(c, &d);
  const size_t out_bytes = 2 * (size_t)(c->M * c->N);
  const double tol = tolerance(&d.weights_case);
  uint16_t *first = NULL; /* the scalar tier's bits */
  cpumoe_status first_status = CPUMOE_OK;
  for (int isa = CPUMOE_ISA_SCALAR; isa < CPUMOE_ISA_COUNT; isa++) {
    if (!g_tested[isa]) continue;
    use_tier((cpumoe_isa)isa);
    const char *tier = cpumoe_isa_name((cpumoe_isa)isa);
    if (!first && isa != CPUMOE_ISA_SCALAR) { /* scalar's bits, counting for no tier */
      first = xmalloc(out_bytes);
      cpumoe_set_isa_cap(CPUMOE_ISA_SCALAR);
      const size_t bytes = cpumoe_linear_workspace_size(&d.p);
      char *ws = xmalloc(bytes);
      first_status = cpumoe_linear(&d.p, ws, bytes, NULL);
      free(ws);
      memcpy(first, d.out, out_bytes);
      cpumoe_set_isa_cap(g_tier);
    }
    cpumoe_status st = run_linear(&d, NULL, 0);
    CHECK(st == CPUMOE_OK, "linear %s [%s]: status %d (%s)", c->name, tier, (int)st,
          cpumoe_last_error());
    const double err = linear_relative_error(&d);
    if (g_verbose)
      printf("  linear %-16s %-7s max error %.2e of scale (tolerance %.1e)\n", c->name, tier, err,
             tol);
    CHECK(err <= tol, "linear %s [%s]: error %.3g of the output scale > %.3g", c->name, tier, err,
          tol);
    if (!first) {
      first = xmalloc(out_bytes);
      memcpy(first, d.out, out_bytes);
    } else {
      CHECK(first_status == CPUMOE_OK && (!same_bits_expected((cpumoe_isa)isa, CPUMOE_ISA_SCALAR) ||
                                          memcmp(first, d.out, out_bytes) == 0),
            "linear %s: tier %s differs from scalar (scalar's status %d)", c->name, tier,
            (int)first_status);
    }
    uint16_t *serial = xmalloc(out_bytes);
    memcpy(serial, d.out, out_bytes);
    g_runner_stats = (runner_stats){0, 0};
    st = run_linear(&d, &g_threads, 1);
    CHECK(st == CPUMOE_OK && memcmp(serial, d.out, out_bytes) == 0,
          "linear %s [%s]: threaded run differs from serial (status %d)", c->name, tier, (int)st);
    CHECK(g_runner_stats.calls > 0, "linear %s: the runner was never used", c->name);
    free(serial);
  }
  use_tier(g_home);
  free(first);
  free_linear_data(&d);
}

static void test_linear(void) {
  for (size_t i = 0; i < sizeof g_linear_cases / sizeof g_linear_cases[0]; i++)
    test_linear_case(&g_linear_cases[i]);

  /* M = 0: nothing to do for any scheme; NULL x allowed, nothing written */
  static const cpumoe_scheme schemes[] = {UNQUANT, INT8, FP8, INT4};
  float scale = 1.0f;
  int8_t zero = 0;
  uint16_t sentinel = 0x1234;
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
    const cpumoe_linear_problem p = {.M = 0,
                                     .K = 32,
                                     .N = 32,
                                     .scheme = schemes[i],
                                     .act_dtype = F16,
                                     .w_scale = &scale,
                                     .block_n = 128,
                                     .block_k = 128,
                                     .w_zero = &zero,
                                     .w_group = 32,
                                     .out = &sentinel};
    const size_t bytes = cpumoe_linear_workspace_size(&p);
    CHECK(bytes > 0, "linear M=0 scheme %d: workspace size 0 (%s)", (int)schemes[i],
          cpumoe_last_error());
    void *ws = xmalloc(bytes);
    CHECK(cpumoe_linear(&p, ws, bytes, &g_threads) == CPUMOE_OK && sentinel == 0x1234,
          "linear M=0 scheme %d failed or wrote (%s)", (int)schemes[i], cpumoe_last_error());
    free(ws);
  }
}

static void test_linear_errors(void) {
  linear_data d;
  make_linear_data(&g_linear_cases[0], &d); /* bf16, M = 1, K = 64, N = 96, bias */
  const cpumoe_linear_problem good = d.p;
  cpumoe_linear_problem p;
  const size_t bytes = cpumoe_linear_workspace_size(&good);
  char *ws = xmalloc(bytes);
  float scale = 1.0f;
  int8_t zero = 0;

#define REJECT_LINEAR(what, mutation, status, needle)                                      \
  do {                                                                                     \
    p = good;                                                                              \
    mutation;                                                                              \
    CHECK(cpumoe_linear_workspace_size(&p) == 0, "linear %s: workspace size not 0", what); \
    CHECK_ERROR(what, cpumoe_linear(&p, ws, bytes, NULL), status, needle);                 \
  } while (0)

  CHECK(cpumoe_linear_workspace_size(NULL) == 0, "linear NULL problem: workspace size not 0");
  CHECK_ERROR("linear NULL problem", cpumoe_linear(NULL, ws, bytes, NULL), CPUMOE_EINVAL, "NULL");
  REJECT_LINEAR("linear M<0", p.M = -1, CPUMOE_EINVAL, "M must");
  REJECT_LINEAR("linear K=0", p.K = 0, CPUMOE_EINVAL, "K=0");
  REJECT_LINEAR("linear N<0", p.N = -32, CPUMOE_EINVAL, "N=-32");
  REJECT_LINEAR("linear K%32", p.K = 48, CPUMOE_EUNSUPPORTED, "K=48");
  REJECT_LINEAR("linear N%32", p.N = 80, CPUMOE_EUNSUPPORTED, "N=80");
  REJECT_LINEAR("linear K>2^30", p.K = INT64_C(1) << 31, CPUMOE_EUNSUPPORTED, "2^30");
  REJECT_LINEAR("linear bytes", (p.M = INT64_C(1) << 62, p.K = 1024), CPUMOE_EINVAL, "bytes");
  REJECT_LINEAR("linear scheme", p.scheme = (cpumoe_scheme)99, CPUMOE_EUNSUPPORTED, "99");
  REJECT_LINEAR("linear act dtype", p.act_dtype = F32, CPUMOE_EINVAL, "activations");
  REJECT_LINEAR("linear x NULL", p.x = NULL, CPUMOE_EINVAL, "NULL");
  REJECT_LINEAR("linear w NULL", p.w = NULL, CPUMOE_EINVAL, "NULL");
  REJECT_LINEAR("linear out NULL", p.out = NULL, CPUMOE_EINVAL, "NULL");
  REJECT_LINEAR("linear int8 no scale", p.scheme = INT8, CPUMOE_EINVAL, "w1_scale");
  REJECT_LINEAR("linear int8 K>65536", (p.scheme = INT8, p.w_scale = &scale, p.K = 65568),
                CPUMOE_EUNSUPPORTED, "65568");
  REJECT_LINEAR("linear fp8 block_k odd",
                (p.scheme = FP8, p.w_scale = &scale, p.block_n = 32, p.block_k = 7),
                CPUMOE_EUNSUPPORTED, "7]");
  REJECT_LINEAR("linear int4 no zeros", (p.scheme = INT4, p.w_scale = &scale, p.w_group = 32),
                CPUMOE_EINVAL, "w1_zero");
  REJECT_LINEAR("linear int4 group 6",
                (p.scheme = INT4, p.w_scale = &scale, p.w_zero = &zero, p.w_group = 6),
                CPUMOE_EUNSUPPORTED, "group sizes 6");
#undef REJECT_LINEAR

  CHECK_ERROR("linear workspace NULL", cpumoe_linear(&good, NULL, bytes, NULL), CPUMOE_EWORKSPACE,
              "workspace");
  CHECK_ERROR("linear workspace short", cpumoe_linear(&good, ws, bytes - 1, NULL),
              CPUMOE_EWORKSPACE, "workspace");
  CHECK(cpumoe_linear(&good, ws, bytes, NULL) == CPUMOE_OK, "linear exact workspace: %s",
        cpumoe_last_error());
  free(ws);
  free_linear_data(&d);
}

/* ---- sizes whose products overflow --------------------------------------------------- */

static void test_sizes(void) {
  /* Non-NULL pointers to nothing: each problem must be rejected before any is read. */
  static char dummy[64];
  const cpumoe_moe_problem base = {
      .M = 1,
      .K = 32,
      .N = 32,
      .E = 2,
      .topk = 1,
      .scheme = UNQUANT,
      .act_dtype = BF16,
      .x = dummy,
      .w1 = dummy,
      .w2 = dummy,
      .out = dummy,
      .topk_ids = dummy,
      .topk_ids_dtype = I64,
      .residual_scale = 1.0f,
  };
  static char ws[64];
  cpumoe_moe_problem p;
  const int64_t big = INT64_C(1) << 30;
#define REJECT_SIZE(what, mutation, status, needle)                                        \
  do {                                                                                     \
    p = base;                                                                              \
    mutation;                                                                              \
    CHECK(cpumoe_fused_experts_workspace_size(&p) == 0, "%s: workspace size not 0", what); \
    CHECK_ERROR(what, cpumoe_fused_experts(&p, ws, sizeof ws, NULL), status, needle);      \
  } while (0)
  REJECT_SIZE("x bytes", (p.M = INT64_MAX / 4, p.K = 64), CPUMOE_EINVAL, "M=2305843009213693951");
  REJECT_SIZE("ids bytes", (p.M = INT64_C(1) << 50, p.topk = 16384), CPUMOE_EINVAL, "topk=16384");
  REJECT_SIZE("topk", p.topk = 16385, CPUMOE_EUNSUPPORTED, "topk=16385");
  REJECT_SIZE("K", p.K = 2 * big, CPUMOE_EUNSUPPORTED, "K=2147483648");
  REJECT_SIZE("N", p.N = 2 * big, CPUMOE_EUNSUPPORTED, "N=2147483648");
  REJECT_SIZE("E", p.E = INT64_MAX, CPUMOE_EUNSUPPORTED, "E=9223372036854775807");
  REJECT_SIZE("E int32", p.E = INT64_C(1) << 31, CPUMOE_EUNSUPPORTED, "E=2147483648");
  REJECT_SIZE("w1 bytes", (p.E = INT32_MAX, p.N = big, p.K = big), CPUMOE_EINVAL, "w1");
  REJECT_SIZE("int8 w1 bytes",
              (p.scheme = INT8, p.w1_scale = p.w2_scale = (const float *)dummy, p.E = INT32_MAX,
               p.N = 65536, p.K = 65536 - 32),
              CPUMOE_EINVAL, "w1");
  /* fp8 weights fit (2^62 bytes) but their 2x2 block scales would need 2^63 */
  REJECT_SIZE(
      "fp8 scale bytes",
      (p.scheme = FP8, p.w1_scale = p.w2_scale = (const float *)dummy, p.block_n = 1, p.block_k = 2,
       p.E = INT64_C(1) << 26, p.N = INT64_C(1) << 15, p.K = INT64_C(1) << 20),
      CPUMOE_EINVAL, "w1_scale");
  REJECT_SIZE("int4 w1 bytes",
              (p.scheme = INT4, p.w1_scale = p.w2_scale = (const float *)dummy,
               p.w1_zero = p.w2_zero = (const int8_t *)dummy, p.w1_group = p.w2_group = 128,
               p.E = INT32_MAX, p.N = big, p.K = big),
              CPUMOE_EINVAL, "w1");
#undef REJECT_SIZE

  /* at the limits, the workspace query works and its size has not wrapped: it holds at
   * least the fp32 A panel and y of a full chunk, 2 x 4 bytes x 2^24 slots x K */
  p = base;
  p.M = 1024, p.topk = 16384, p.K = big, p.N = big, p.E = 1;
  const size_t bytes = cpumoe_fused_experts_workspace_size(&p);
  CHECK(bytes >= (size_t)8 << 54, "workspace at the size limits: %zu bytes (%s)", bytes,
        cpumoe_last_error());

  /* packers: E x rows x cols more bytes than any tensor */
  CHECK_ERROR("vnni2 bytes",
              cpumoe_pack_vnni2_16bit((const uint16_t *)dummy, (uint16_t *)ws, INT64_C(1) << 40,
                                      65536, 65536, NULL),
              CPUMOE_EINVAL, "65536");
  CHECK_ERROR("vnni2 8-bit bytes",
              cpumoe_pack_vnni2_8bit((const uint8_t *)dummy, (uint8_t *)ws, INT64_C(1) << 40,
                                     INT64_C(1) << 30, 65536, NULL),
              CPUMOE_EINVAL, "65536");
  CHECK_ERROR("int4 pack bytes",
              cpumoe_pack_int4(CPUMOE_INT4_AWQ, (const int32_t *)dummy, (const int32_t *)dummy,
                               dummy, F32, INT64_C(1) << 40, 65536, 65536, 512, (uint8_t *)ws,
                               (int8_t *)ws, (float *)ws, NULL),
              CPUMOE_EINVAL, "experts=1099511627776");
  CHECK_ERROR("vnni4 bytes",
              cpumoe_pack_vnni4_int8((const int8_t *)dummy, (int8_t *)ws, INT64_C(1) << 40,
                                     INT64_C(1) << 30, 32768, NULL),
              CPUMOE_EINVAL, "32768");
}

/* ---- routing (gating) ------------------------------------------------------------------ */

typedef struct gating_case {
  const char *name;
  int64_t M, E, topk, groups, topk_groups;
  cpumoe_gating_score score;
  cpumoe_group_score group_score;
  cpumoe_dtype logits_dtype;
  int biased;
  cpumoe_dtype bias_dtype;
  int renormalize;
  int64_t num_shared;
  float factor; /* 0: none */
  int scale_output;
  int64_t padding; /* rows at the end that are padding */
  int hashed;      /* hash routing: the ids from a tid2eid table of random ids (repeats too) */
} gating_case;

#define SOFTMAX CPUMOE_SCORE_SOFTMAX
#define SIGMOID CPUMOE_SCORE_SIGMOID
#define SQRTSP CPUMOE_SCORE_SQRTSOFTPLUS
#define GMAX CPUMOE_GROUP_MAX
#define GTOP2 CPUMOE_GROUP_TOP2_SUM

/* The models' routings (Qwen3, DeepSeek-V2/V3/V4, Kimi-K2) and shapes SGLang's kernels do not
 * serve: odd E, topk = E, groups of one expert, E = 1. */
static const gating_case g_gating_cases[] = {
    {"qwen3 softmax", 33, 128, 8, 1, 1, SOFTMAX, GMAX, BF16, 0, F32, 1, 0, 0, 0, 0, 0},
    {"dsv2 grouped", 20, 160, 6, 8, 3, SOFTMAX, GMAX, F16, 0, F32, 0, 0, 16.0f, 1, 3, 0},
    {"dsv3 biased", 40, 256, 8, 8, 4, SIGMOID, GTOP2, BF16, 1, F32, 1, 0, 2.5f, 1, 0, 0},
    {"dsv3 shared", 17, 256, 9, 8, 4, SIGMOID, GTOP2, F32, 1, BF16, 1, 3, 2.5f, 1, 6, 0},
    {"dsv4 sqrtsoftplus", 9, 384, 7, 1, 1, SQRTSP, GMAX, F32, 1, F16, 1, 1, 1.5f, 0, 0, 0},
    {"kimi sigmoid", 5, 384, 8, 1, 1, SIGMOID, GMAX, BF16, 1, F32, 0, 0, 0, 0, 0, 0},
    {"odd E, topk = E", 6, 7, 7, 7, 7, SIGMOID, GTOP2, F32, 1, F32, 1, 0, 0, 0, 0, 0},
    {"groups of one", 12, 24, 5, 24, 6, SIGMOID, GTOP2, BF16, 1, F32, 0, 0, 0, 0, 0, 0},
    {"E = 1", 3, 1, 1, 1, 1, SOFTMAX, GMAX, F16, 0, F32, 1, 0, 0, 0, 0, 0},
    {"many tokens", 300, 64, 6, 8, 2, SOFTMAX, GMAX, F32, 0, F32, 1, 0, 0, 0, 0, 0},
    {"dsv4 hash", 37, 256, 7, 1, 1, SQRTSP, GMAX, BF16, 0, F32, 1, 1, 1.5f, 0, 0, 1},
    {"hash softmax", 20, 64, 6, 1, 1, SOFTMAX, GMAX, F16, 0, F32, 0, 0, 0, 0, 0, 1},
    {"hash R > E", 9, 5, 9, 1, 1, SIGMOID, GMAX, F32, 0, F32, 1, 3, 2.0f, 0, 0, 1},
};

typedef struct gating_data {
  const gating_case *c;
  cpumoe_gating_problem p;
  void *logits, *bias;
  double *x, *b;  /* the values, as the op reads them */
  int32_t *table; /* [M, R] the hash table's rows, or NULL */
  float *weights; /* out */
  int32_t *ids;   /* out */
} gating_data;

/* Logits 0.02 apart (a permutation per token), so that no two round to the same 16-bit value
 * and ranks are well apart; a bias of whole numbers (which reorders the experts) plus a small
 * part. */
static void make_gating_data(const gating_case *c, gating_data *d) {
  const int64_t M = c->M, E = c->E;
  const size_t elem = c->logits_dtype == F32 ? 4 : 2;
  d->c = c;
  d->logits = xmalloc((size_t)(M * E) * elem);
  d->x = xmalloc((size_t)(M * E) * sizeof(double));
  int64_t *perm = xmalloc((size_t)E * sizeof(int64_t));
  for (int64_t m = 0; m < M; m++) {
    for (int64_t e = 0; e < E; e++) perm[e] = e;
    for (int64_t e = E - 1; e > 0; e--) {
      const int64_t j = rnd_below(e + 1), t = perm[e];
      perm[e] = perm[j], perm[j] = t;
    }
    for (int64_t e = 0; e < E; e++) {
      const double v = 0.02 * (double)(perm[e] - E / 2) + rnd_uniform(0, 0.002);
      const int64_t i = m * E + e;
      if (c->logits_dtype == F32) {
        ((float *)d->logits)[i] = (float)v;
        d->x[i] = (float)v;
      } else {
        ((uint16_t *)d->logits)[i] = act_bits(c->logits_dtype, v);
        d->x[i] = act_value(c->logits_dtype, ((uint16_t *)d->logits)[i]);
      }
    }
  }
  free(perm);
  d->bias = d->b = NULL;
  if (c->biased) {
    d->bias = xmalloc((size_t)E * 4);
    d->b = xmalloc((size_t)E * sizeof(double));
    for (int64_t e = 0; e < E; e++) {
      const double v = (double)rnd_below(3) + rnd_uniform(-0.01, 0.01);
      if (c->bias_dtype == F32) {
        ((float *)d->bias)[e] = (float)v;
        d->b[e] = (float)v;
      } else {
        ((uint16_t *)d->bias)[e] = act_bits(c->bias_dtype, v);
        d->b[e] = act_value(c->bias_dtype, ((uint16_t *)d->bias)[e]);
      }
    }
  }
  const int64_t R = c->topk - (c->num_shared > 0);
  d->table = c->hashed ? xmalloc((size_t)(M * R) * sizeof(int32_t)) : NULL;
  for (int64_t i = 0; c->hashed && i < M * R; i++) d->table[i] = (int32_t)rnd_below(E);
  d->weights = xmalloc((size_t)(M * c->topk) * sizeof(float));
  d->ids = xmalloc((size_t)(M * c->topk) * sizeof(int32_t));
  d->p = (cpumoe_gating_problem){
      .M = M,
      .M_valid = M - c->padding,
      .E = E,
      .topk = c->topk,
      .score = c->score,
      .logits = d->logits,
      .logits_dtype = c->logits_dtype,
      .bias = d->bias,
      .bias_dtype = c->bias_dtype,
      .groups = c->groups,
      .topk_groups = c->topk_groups,
      .group_score = c->group_score,
      .renormalize = c->renormalize,
      .num_shared = c->num_shared,
      .has_routed_scaling_factor = c->factor != 0,
      .routed_scaling_factor = c->factor,
      .scale_output = c->scale_output,
      .topk_weights = d->weights,
      .topk_ids = d->ids,
      .tid2eid = d->table,
  };
}

static void free_gating_data(gating_data *d) {
  free(d->logits), free(d->x), free(d->bias), free(d->b), free(d->table), free(d->weights);
  free(d->ids);
}

static double score_of(cpumoe_gating_score score, double x) {
  if (score == SIGMOID) return 1.0 / (1.0 + exp(-x));
  if (score == SQRTSP) return sqrt(fmax(x, 0.0) + log1p(exp(-fabs(x))));
  return exp(x); /* softmax: normalized by the caller */
}

/* The routing restated in double: the expert ids best first (ids[R]; a hashed case's table
 * row) and each expert's score (s[E]); returns the smallest gap between a kept and a dropped
 * rank (group and expert), below which the op's fp32 ranks may order differently. */
static double gating_restated(const gating_data *d, int64_t m, int32_t *ids, double *s) {
  const gating_case *c = d->c;
  const int64_t E = c->E, gs = E / c->groups, R = c->topk - (c->num_shared > 0);
  const double *x = d->x + m * E;
  double sum = 0.0;
  for (int64_t e = 0; e < E; e++) sum += s[e] = score_of(c->score, x[e]);
  if (c->score == SOFTMAX)
    for (int64_t e = 0; e < E; e++) s[e] /= sum;
  if (c->hashed) {
    for (int64_t j = 0; j < R; j++) ids[j] = d->table[m * R + j];
    return INFINITY;
  }
  double *rank = xmalloc((size_t)E * sizeof(double));
  for (int64_t e = 0; e < E; e++) rank[e] = c->biased ? s[e] + d->b[e] : x[e];
  /* groups kept: selection by repeated max (ties: lower index) */
  int *kept = xmalloc((size_t)c->groups * sizeof(int));
  double *gscore = xmalloc((size_t)c->groups * sizeof(double));
  for (int64_t g = 0; g < c->groups; g++) {
    double best = -INFINITY, second = -INFINITY;
    for (int64_t e = g * gs; e < (g + 1) * gs; e++)
      if (rank[e] > best)
        second = best, best = rank[e];
      else if (rank[e] > second)
        second = rank[e];
    gscore[g] = c->group_score == GMAX || gs == 1 ? best : best + second;
    kept[g] = c->topk_groups == c->groups;
  }
  double gap = INFINITY, last = INFINITY;
  for (int64_t k = 0; k < c->topk_groups && c->topk_groups < c->groups; k++) {
    int64_t pick = -1;
    for (int64_t g = 0; g < c->groups; g++)
      if (!kept[g] && (pick < 0 || gscore[g] > gscore[pick])) pick = g;
    kept[pick] = 1, last = gscore[pick];
  }
  for (int64_t g = 0; g < c->groups; g++)
    if (!kept[g]) gap = fmin(gap, last - gscore[g]);
  /* experts of the kept groups */
  int *taken = xmalloc((size_t)E * sizeof(int));
  for (int64_t e = 0; e < E; e++) taken[e] = !kept[e / gs]; /* not a candidate */
  for (int64_t j = 0; j < R; j++) {
    int64_t pick = -1;
    for (int64_t e = 0; e < E; e++)
      if (!taken[e] && (pick < 0 || rank[e] > rank[pick])) pick = e;
    taken[pick] = 1, ids[j] = (int32_t)pick, last = rank[pick];
  }
  for (int64_t e = 0; e < E; e++)
    if (!taken[e]) gap = fmin(gap, last - rank[e]);
  free(rank), free(kept), free(gscore), free(taken);
  return gap;
}

/* Runs the problem with a workspace of exactly the size asked for, `offset` bytes into a
 * malloc'd block filled with garbage; outputs start as garbage too. */
static cpumoe_status run_gating(gating_data *d, const cpumoe_runner *runner, size_t offset) {
  const size_t bytes = cpumoe_gating_workspace_size(&d->p, runner);
  CHECK(bytes > 0, "%s: workspace size 0 for a valid problem (%s)", d->c->name,
        cpumoe_last_error());
  char *block = xmalloc(bytes + offset);
  memset(block, 0xff, bytes + offset);
  memset(d->weights, 0xff, (size_t)(d->c->M * d->c->topk) * sizeof(float));
  memset(d->ids, 0x7f, (size_t)(d->c->M * d->c->topk) * sizeof(int32_t));
  const cpumoe_status st = cpumoe_gating(&d->p, block + offset, bytes, runner);
  free(block);
  return st;
}

/* The op's result against the restatement: ids (where no rank lies within 1e-5 of the
 * boundary), weights within 1e-5 relative of the double ones of the ids chosen, the shared
 * slot, the padding rows. Returns the number of rows whose ids were not compared. */
static int64_t check_gating_result(const gating_data *d, const char *tier) {
  const gating_case *c = d->c;
  const int64_t E = c->E, topk = c->topk, R = topk - (c->num_shared > 0);
  int32_t *ids = xmalloc((size_t)topk * sizeof(int32_t));
  double *s = xmalloc((size_t)E * sizeof(double));
  int64_t skipped = 0;
  for (int64_t m = 0; m < c->M; m++) {
    const float *w = d->weights + m * topk;
    const int32_t *id = d->ids + m * topk;
    if (m >= c->M - c->padding) {
      for (int64_t j = 0; j < topk; j++)
        CHECK(id[j] == -1 && w[j] == 0.0f, "%s [%s]: padding row %lld slot %lld: %d %g", c->name,
              tier, (long long)m, (long long)j, id[j], (double)w[j]);
      continue;
    }
    const double gap = gating_restated(d, m, ids, s);
    if (gap > 1e-5) {
      for (int64_t j = 0; j < R; j++)
        CHECK(id[j] == ids[j], "%s [%s]: row %lld slot %lld: id %d, expected %d", c->name, tier,
              (long long)m, (long long)j, id[j], ids[j]);
    } else {
      skipped++;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < R; j++) {
      CHECK(id[j] >= 0 && id[j] < E, "%s [%s]: row %lld: id %d out of range", c->name, tier,
            (long long)m, id[j]);
      if (id[j] >= 0 && id[j] < E) sum += s[id[j]];
    }
    const double f = c->scale_output ? c->factor : 1.0;
    const double scale = c->renormalize ? f / sum : f;
    for (int64_t j = 0; j < topk; j++) {
      const int shared = j == R;
      const double want =
          shared ? sum / c->factor * scale : s[id[j] >= 0 && id[j] < E ? id[j] : 0] * scale;
      CHECK(fabs(w[j] - want) <= 1e-5 * fabs(want),
            "%s [%s]: row %lld slot %lld: weight %.9g, "
            "expected %.9g",
            c->name, tier, (long long)m, (long long)j, (double)w[j], want);
      if (shared)
        CHECK(id[j] == E + m % c->num_shared, "%s [%s]: row %lld: shared id %d", c->name, tier,
              (long long)m, id[j]);
    }
  }
  free(ids), free(s);
  return skipped;
}

static void test_gating_case(const gating_case *c) {
  gating_data d;
  make_gating_data(c, &d);
  const size_t w_bytes = (size_t)(c->M * c->topk) * sizeof(float);
  const size_t id_bytes = (size_t)(c->M * c->topk) * sizeof(int32_t);
  float *first_w = NULL; /* the scalar tier's: every tier must give these bits */
  int32_t *first_ids = NULL;
  for (int isa = CPUMOE_ISA_SCALAR; isa < CPUMOE_ISA_COUNT; isa++) {
    if (!g_tested[isa]) continue;
    use_tier((cpumoe_isa)isa);
    const char *tier = cpumoe_isa_name((cpumoe_isa)isa);
    if (!first_w) { /* the scalar tier's bits, counting for no tier */
      cpumoe_set_isa_cap(CPUMOE_ISA_SCALAR);
      const cpumoe_status st = run_gating(&d, NULL, 0);
      cpumoe_set_isa_cap((cpumoe_isa)isa);
      CHECK(st == CPUMOE_OK, "%s [scalar]: status %d (%s)", c->name, (int)st, cpumoe_last_error());
      first_w = xmalloc(w_bytes), first_ids = xmalloc(id_bytes);
      memcpy(first_w, d.weights, w_bytes), memcpy(first_ids, d.ids, id_bytes);
    }
    cpumoe_status st = run_gating(&d, NULL, 0);
    CHECK(st == CPUMOE_OK, "%s [%s]: status %d (%s)", c->name, tier, (int)st, cpumoe_last_error());
    const int64_t skipped = check_gating_result(&d, tier);
    CHECK(skipped * 10 <= c->M, "%s [%s]: %lld of %lld rows had near ties", c->name, tier,
          (long long)skipped, (long long)c->M);
    if (g_verbose)
      printf("  %-18s %-7s ids compared on %lld of %lld rows\n", c->name, tier,
             (long long)(c->M - skipped), (long long)c->M);
    CHECK(memcmp(first_w, d.weights, w_bytes) == 0 && memcmp(first_ids, d.ids, id_bytes) == 0,
          "%s: tier %s differs from scalar", c->name, tier);
    /* several threads, unaligned workspace: the same bits */
    g_runner_stats = (runner_stats){0, 0};
    st = run_gating(&d, &g_threads, 3);
    CHECK(st == CPUMOE_OK && memcmp(first_w, d.weights, w_bytes) == 0 &&
              memcmp(first_ids, d.ids, id_bytes) == 0,
          "%s [%s]: threaded run differs (status %d)", c->name, tier, (int)st);
    CHECK(c->M <= 32 || g_runner_stats.calls > 0, "%s: the runner was never used", c->name);
  }
  use_tier(g_home);
  free(first_w), free(first_ids);
  free_gating_data(&d);
}

static void test_gating(void) {
  for (size_t i = 0; i < sizeof g_gating_cases / sizeof g_gating_cases[0]; i++)
    test_gating_case(&g_gating_cases[i]);

  /* M = 0: nothing read or written, NULL tensors allowed */
  const cpumoe_gating_problem empty = {.E = 8, .topk = 2, .groups = 1, .topk_groups = 1};
  const size_t bytes = cpumoe_gating_workspace_size(&empty, &g_threads);
  void *ws = xmalloc(bytes);
  CHECK(bytes > 0 && cpumoe_gating(&empty, ws, bytes, &g_threads) == CPUMOE_OK,
        "M=0 routing failed (%s)", cpumoe_last_error());
  free(ws);
}

/* Each rejected routing problem: its status and a message of its own naming the field. */
static void test_gating_errors(void) {
  static float logits[4 * 8], weights[4 * 2];
  static int32_t ids[4 * 2], table[4 * 2] = {0, 1, 2, 3, 4, 5, 6, 7};
  static char ws[1 << 16];
  const cpumoe_gating_problem base = {
      .M = 4,
      .M_valid = 4,
      .E = 8,
      .topk = 2,
      .score = SIGMOID,
      .logits = logits,
      .logits_dtype = F32,
      .groups = 4,
      .topk_groups = 2,
      .group_score = GTOP2,
      .topk_weights = weights,
      .topk_ids = ids,
  };
  cpumoe_gating_problem p = base;
  CHECK(cpumoe_gating(&p, ws, sizeof ws, NULL) == CPUMOE_OK, "routing baseline rejected (%s)",
        cpumoe_last_error());
#define REJECT_GATING(what, mutation, status, needle)                                     \
  do {                                                                                    \
    p = base;                                                                             \
    mutation;                                                                             \
    CHECK(cpumoe_gating_workspace_size(&p, NULL) == 0, "%s: workspace size not 0", what); \
    CHECK_ERROR(what, cpumoe_gating(&p, ws, sizeof ws, NULL), status, needle);            \
  } while (0)
  CHECK_ERROR("NULL problem", cpumoe_gating(NULL, ws, sizeof ws, NULL), CPUMOE_EINVAL, "NULL");
  REJECT_GATING("M", p.M = -1, CPUMOE_EINVAL, "M must");
  REJECT_GATING("M_valid", p.M_valid = 5, CPUMOE_EINVAL, "M_valid");
  REJECT_GATING("E", p.E = 0, CPUMOE_EINVAL, "E must");
  REJECT_GATING("E int32", p.E = INT64_C(1) << 31, CPUMOE_EINVAL, "E must");
  REJECT_GATING("score", p.score = (cpumoe_gating_score)9, CPUMOE_EINVAL, "score");
  REJECT_GATING("logits dtype", p.logits_dtype = I32, CPUMOE_EINVAL, "logits");
  REJECT_GATING("bias dtype", (p.bias = logits, p.bias_dtype = F64), CPUMOE_EINVAL, "bias");
  REJECT_GATING("groups", p.groups = 3, CPUMOE_EINVAL, "groups = 3");
  REJECT_GATING("groups 0", p.groups = 0, CPUMOE_EINVAL, "groups = 0");
  REJECT_GATING("topk_groups", p.topk_groups = 5, CPUMOE_EINVAL, "topk_groups");
  REJECT_GATING("group score", p.group_score = (cpumoe_group_score)4, CPUMOE_EINVAL, "group");
  REJECT_GATING("factor", (p.has_routed_scaling_factor = 1, p.routed_scaling_factor = 0.0f),
                CPUMOE_EINVAL, "routed_scaling_factor");
  REJECT_GATING("factor inf", (p.has_routed_scaling_factor = 1, p.routed_scaling_factor = INFINITY),
                CPUMOE_EINVAL, "routed_scaling_factor");
  REJECT_GATING("scale without factor", p.scale_output = 1, CPUMOE_EINVAL, "scale_output");
  REJECT_GATING("num_shared", p.num_shared = -1, CPUMOE_EINVAL, "num_shared");
  REJECT_GATING("shared without factor", p.num_shared = 1, CPUMOE_EINVAL, "routed_scaling_factor");
  REJECT_GATING("topk 0", p.topk = 0, CPUMOE_EINVAL, "topk = 0");
  REJECT_GATING("topk above candidates", p.topk = 5, CPUMOE_EINVAL, "topk = 5");
  REJECT_GATING("topk 1 with shared",
                (p.topk = 1, p.num_shared = 1, p.has_routed_scaling_factor = 1,
                 p.routed_scaling_factor = 2.5f),
                CPUMOE_EINVAL, "shared slot");
  REJECT_GATING("NULL logits", p.logits = NULL, CPUMOE_EINVAL, "NULL");
  REJECT_GATING("tid2eid with groups", p.tid2eid = table, CPUMOE_EINVAL, "no groups");
  REJECT_GATING("tid2eid with a bias",
                (p.tid2eid = table, p.groups = p.topk_groups = 1, p.bias = logits), CPUMOE_EINVAL,
                "no bias");
  REJECT_GATING("tid2eid topk 1 with shared",
                (p.tid2eid = table, p.groups = p.topk_groups = 1, p.topk = 1, p.num_shared = 1,
                 p.has_routed_scaling_factor = 1, p.routed_scaling_factor = 2.5f),
                CPUMOE_EINVAL, "shared slot");
  table[5] = 8; /* row 2, slot 1: E */
  REJECT_GATING("tid2eid id E", (p.tid2eid = table, p.groups = p.topk_groups = 1), CPUMOE_EINVAL,
                "tid2eid[2, 1] = 8");
  table[5] = -1;
  REJECT_GATING("tid2eid id -1", (p.tid2eid = table, p.groups = p.topk_groups = 1), CPUMOE_EINVAL,
                "tid2eid[2, 1] = -1");
  table[5] = 5;
  REJECT_GATING("sizes", (p.M = INT64_C(1) << 61, p.M_valid = 0, p.groups = 1, p.topk_groups = 1),
                CPUMOE_EINVAL, "bytes");
#undef REJECT_GATING
  p = base;
  const size_t need = cpumoe_gating_workspace_size(&p, NULL);
  CHECK_ERROR("workspace small", cpumoe_gating(&p, ws, need - 1, NULL), CPUMOE_EWORKSPACE,
              "workspace");
  CHECK_ERROR("workspace NULL", cpumoe_gating(&p, NULL, need, NULL), CPUMOE_EWORKSPACE,
              "workspace");
}

/* ---- ISA queries -------------------------------------------------------------------- */

/* `name` is one of the space-separated words of `features` */
static int has_feature(const char *features, const char *name) {
  const size_t n = strlen(name);
  for (const char *p = features; (p = strstr(p, name)) != NULL; p += n)
    if ((p == features || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\0')) return 1;
  return 0;
}

/* The tier tree of cpumoe/tiers.h: each tier's parent, and the tiers in rank order. */
static cpumoe_isa tier_parent(cpumoe_isa isa) {
  static const char *const parents[CPUMOE_ISA_COUNT] = {
#define PARENT_NAME(ENUM, name, id, parent, ...) [id] = #parent,
      CPUMOE_FOR_EACH_TIER(PARENT_NAME)
#undef PARENT_NAME
  };
  return cpumoe_isa_from_name(parents[isa]);
}
static const cpumoe_isa g_tier_rank[CPUMOE_ISA_COUNT] = {
#define RANK_ID(ENUM, ...) CPUMOE_ISA_##ENUM,
    CPUMOE_FOR_EACH_TIER(RANK_ID)
#undef RANK_ID
};

static int tier_supported(cpumoe_isa isa) {
  return g_emulating_build || cpumoe_isa_native(isa);
}

static void test_isa(void) {
  const cpumoe_isa best = cpumoe_best_supported_isa();
  CHECK(best >= CPUMOE_ISA_SCALAR && best < CPUMOE_ISA_COUNT, "best tier %d", (int)best);
  for (int i = 0; i < CPUMOE_ISA_COUNT; i++) {
    const char *name = cpumoe_isa_name((cpumoe_isa)i);
    CHECK(name && name[0] && cpumoe_isa_from_name(name) == (cpumoe_isa)i,
          "tier %d: name \"%s\" does not parse back", i, name ? name : "(null)");
  }
  CHECK(strcmp(cpumoe_isa_name(CPUMOE_ISA_SCALAR), "scalar") == 0 &&
            strcmp(cpumoe_isa_name(CPUMOE_ISA_AVX2), "avx2") == 0 &&
            strcmp(cpumoe_isa_name(CPUMOE_ISA_AVX512), "avx512") == 0,
        "tier names");
  CHECK(strcmp(cpumoe_isa_name(CPUMOE_ISA_COUNT), "unknown") == 0, "name of an unknown tier");
  CHECK(cpumoe_isa_from_name("avx9") == CPUMOE_ISA_COUNT &&
            cpumoe_isa_from_name("") == CPUMOE_ISA_COUNT &&
            cpumoe_isa_from_name(NULL) == CPUMOE_ISA_COUNT,
        "unknown tier names must give CPUMOE_ISA_COUNT");

  /* native tiers: exactly those whose features the CPU and OS have; supported ones: the
   * native ones, or every tier in the emulating build */
  const char *features = cpumoe_cpu_features();
  CHECK(features != NULL, "cpu features NULL");
  if (features) {
    const int avx2 = has_feature(features, "avx") && has_feature(features, "avx2") &&
                     has_feature(features, "fma") && has_feature(features, "f16c");
    const int avx512 = avx2 && has_feature(features, "avx512f") &&
                       has_feature(features, "avx512dq") && has_feature(features, "avx512bw") &&
                       has_feature(features, "avx512vl") && has_feature(features, "avx512vnni");
    CHECK(cpumoe_isa_native(CPUMOE_ISA_SCALAR) == 1, "scalar tier not native");
    CHECK(cpumoe_isa_native(CPUMOE_ISA_AVX2) == avx2, "avx2 native %d, features \"%s\"",
          cpumoe_isa_native(CPUMOE_ISA_AVX2), features);
    CHECK(cpumoe_isa_native(CPUMOE_ISA_AVX512) == avx512, "avx512 native %d, features \"%s\"",
          cpumoe_isa_native(CPUMOE_ISA_AVX512), features);
    const int avx2vnni = avx2 && has_feature(features, "avx-vnni");
    CHECK(cpumoe_isa_native(CPUMOE_ISA_AVX2VNNI) == avx2vnni, "avx2vnni native %d, features \"%s\"",
          cpumoe_isa_native(CPUMOE_ISA_AVX2VNNI), features);
  }
  CHECK(!cpumoe_isa_native(CPUMOE_ISA_COUNT) && !cpumoe_isa_native((cpumoe_isa)-1),
        "an unknown tier is native");
  /* a tier runs only where its parent runs; the best is the last supported one in rank
   * order (the tiers form a tree: avx2vnni and avx512 both build on avx2) */
  cpumoe_isa last_supported = CPUMOE_ISA_SCALAR;
  for (int r = 0; r < CPUMOE_ISA_COUNT; r++) {
    const cpumoe_isa isa = g_tier_rank[r];
    CHECK(!cpumoe_isa_native(isa) || cpumoe_isa_native(tier_parent(isa)),
          "tier %d native without its parent %d", (int)isa, (int)tier_parent(isa));
    if (tier_supported(isa)) last_supported = isa;
  }
  CHECK(best == last_supported, "best supported %d, expected %d (the last in rank order)",
        (int)best, (int)last_supported);

  for (int i = 0; i < CPUMOE_ISA_COUNT; i++) {
    CHECK(cpumoe_set_isa_cap((cpumoe_isa)i) == CPUMOE_OK, "cap %d refused", i);
    cpumoe_isa want = (cpumoe_isa)i; /* the cap, or its nearest supported ancestor */
    while (!tier_supported(want)) want = tier_parent(want);
    CHECK(cpumoe_active_isa() == want, "cap %d: active %d, expected %d", i,
          (int)cpumoe_active_isa(), (int)want);
    const char *reason = cpumoe_isa_reason();
    CHECK(reason && strncmp(reason, cpumoe_isa_name(want), strlen(cpumoe_isa_name(want))) == 0,
          "cap %d: reason \"%s\" does not start with the active tier", i, reason ? reason : "");
  }
  const cpumoe_isa capped = cpumoe_active_isa();
  char last_id[16]; /* the message names the valid range 0..count - 1 */
  snprintf(last_id, sizeof last_id, "..%d", CPUMOE_ISA_COUNT - 1);
  CHECK_ERROR("cap COUNT", cpumoe_set_isa_cap(CPUMOE_ISA_COUNT), CPUMOE_EINVAL, last_id);
  CHECK_ERROR("cap -1", cpumoe_set_isa_cap((cpumoe_isa)-1), CPUMOE_EINVAL, "-1");
  CHECK(cpumoe_active_isa() == capped, "a refused cap changed the active tier");
  use_tier(g_home);
}

/* ---- probes (tiny sizes) ---------------------------------------------------------------- */

static void test_probes(void) {
  enum { WORDS = 1024 };
  static uint64_t buffer[WORDS];
  for (int i = 0; i < WORDS; i++) buffer[i] = (uint64_t)i + 1;
  for (int isa = CPUMOE_ISA_SCALAR; isa < CPUMOE_ISA_COUNT; isa++) {
    if (!g_tested[isa]) continue;
    use_tier((cpumoe_isa)isa);
    const char *tier = cpumoe_isa_name((cpumoe_isa)isa);
    /* each of n workers reads its share, rounded down to 512 bytes, `passes` times */
    for (int threaded = 0; threaded < 2; threaded++) {
      const int64_t workers = threaded ? g_threads.num_threads : 1;
      const int64_t share = (int64_t)((sizeof buffer / (size_t)workers) & ~(size_t)511) / 8;
      double want = 0.0;
      for (int64_t i = 0; i < workers * share; i++) want += (double)buffer[i];
      const double got = cpumoe_probe_read(buffer, sizeof buffer, 3, threaded ? &g_threads : NULL);
      CHECK(got == 3 * want, "probe_read [%s] threads=%lld: checksum %.0f, expected %.0f", tier,
            (long long)workers, got, 3 * want);
    }
    CHECK(cpumoe_probe_read(NULL, sizeof buffer, 1, &g_threads) == 0.0, "probe_read(NULL)");
    const double fma1 = cpumoe_probe_fma(1000, NULL), fma2 = cpumoe_probe_fma(2000, NULL);
    CHECK(fma1 > 0 && fma2 == 2 * fma1, "probe_fma [%s]: %.0f then %.0f flops", tier, fma1, fma2);
    CHECK(cpumoe_probe_fma(1000, &g_threads) == 3 * fma1, "probe_fma [%s]: 3 workers", tier);
    /* the amx tier's loops run on the software tile unit when emulated: keep them short */
    const int slow = g_emulating_build && isa == CPUMOE_ISA_AMX; /* even on an AMX CPU */
    const int64_t n = slow ? 10 : 1000;
    const double int1 = cpumoe_probe_int8(n, NULL), int2 = cpumoe_probe_int8(2 * n, NULL);
    CHECK(int1 > 0 && int2 == 2 * int1, "probe_int8 [%s]: %.0f then %.0f ops", tier, int1, int2);
    CHECK(cpumoe_probe_int8(n, &g_threads) == 3 * int1, "probe_int8 [%s]: 3 workers", tier);
    const double i4_1 = cpumoe_probe_int4(n, NULL), i4_2 = cpumoe_probe_int4(2 * n, NULL);
    CHECK(i4_1 > 0 && i4_2 == 2 * i4_1, "probe_int4 [%s]: %.0f then %.0f ops", tier, i4_1, i4_2);
    CHECK(cpumoe_probe_int4(n, &g_threads) == 3 * i4_1, "probe_int4 [%s]: 3 workers", tier);
    const double bf1 = cpumoe_probe_bf16(n, NULL), bf2 = cpumoe_probe_bf16(2 * n, NULL);
    CHECK(bf1 > 0 && bf2 == 2 * bf1, "probe_bf16 [%s]: %.0f then %.0f ops", tier, bf1, bf2);
    CHECK(cpumoe_probe_bf16(n, &g_threads) == 3 * bf1, "probe_bf16 [%s]: 3 workers", tier);
    /* long enough that 32-bit accumulators wrap (the benchmark runs ~1e8 iterations) */
    const int64_t long_iters = slow ? 3 * n : 12000000;
    const double long_run = cpumoe_probe_int8(long_iters, NULL);
    CHECK(long_run == (double)(long_iters / n) * int1,
          "probe_int8 [%s]: %.0f ops in %lld iterations", tier, long_run, (long long)long_iters);
  }
  use_tier(g_home);
}

int main(int argc, char **argv) {
  static const struct {
    const char *name;
    void (*run)(void);
  } sections[] = {
      {"packers", test_packers},
      {"packers", test_pack_int4},
      {"packers", test_packer_errors},
      {"fused", test_fused},
      {"activations", test_activations},
      {"errors", test_fused_errors},
      {"sizes", test_sizes},
      {"isa", test_isa},
      {"probes", test_probes},
      {"gating", test_gating},
      {"errors", test_gating_errors},
      {"linear", test_linear},
      {"errors", test_linear_errors},
  };
  setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines survive a sanitizer abort */
  const char *only = NULL;
  int emulate_all = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "-v") == 0)
      g_verbose = 1;
    else if (strcmp(argv[i], "--emulate-all") == 0)
      emulate_all = 1;
    else
      only = argv[i];
  }
  if (emulate_all && !g_emulating_build) {
    fprintf(stderr, "--emulate-all needs the emulating build (tools/build_c_tests.py --emulate)\n");
    return 2;
  }

  /* the tiers under test: see the header */
  int tested = 0;
  for (int r = 0; r < CPUMOE_ISA_COUNT; r++) { /* rank order: the home is the best tested */
    const cpumoe_isa isa = g_tier_rank[r];
    g_tested[isa] = tier_supported(isa) &&
                    (!g_emulating_build ||
                     (isa != CPUMOE_ISA_SCALAR && (emulate_all || !cpumoe_isa_native(isa))));
    if (g_tested[isa]) g_home = isa, tested++;
  }
  if (!tested) {
    printf("no tier to emulate: this CPU runs every tier natively (--emulate-all emulates them)\n");
    printf("cpumoe C tests: 0 checks, 0 failed (tier %s, best %s)\n",
           cpumoe_isa_name(cpumoe_active_isa()), cpumoe_isa_name(cpumoe_best_supported_isa()));
    return 0;
  }
  use_tier(g_home);

  int ran = 0;
  for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
    if (only && strcmp(only, sections[i].name) != 0) continue;
    sections[i].run();
    ran++;
  }
  if (!ran) {
    fprintf(stderr, "no section named %s\n", only);
    return 2;
  }
  for (int isa = CPUMOE_ISA_SCALAR; isa < CPUMOE_ISA_COUNT; isa++) {
    if (!g_tested[isa]) continue;
    /* in the emulating build every vector tier runs SIMDe's code, native CPU or not */
    const int emulated =
        !cpumoe_isa_native((cpumoe_isa)isa) || (g_emulating_build && isa != CPUMOE_ISA_SCALAR);
    printf("tier %s (%s): %d checks, %d failed\n", cpumoe_isa_name((cpumoe_isa)isa),
           emulated ? "emulated" : "native", g_tier_checks[isa], g_tier_failures[isa]);
  }
  printf("cpumoe C tests: %d checks, %d failed (tier %s, best %s)\n", g_checks, g_failures,
         cpumoe_isa_name(cpumoe_active_isa()), cpumoe_isa_name(cpumoe_best_supported_isa()));
  return g_failures ? 1 : 0;
}
