/*
 * Bit-for-bit checks of the MXFP4 kernels of every tier (schemes/mxfp4/) against plain-C
 * restatements of docs/FORMATS.md and docs/MATH.md:
 *   - decoding: every tier's chunk decoder against the definition e2m1(code) * 2^(s - 127)
 *     (exact bf16, +-inf beyond bf16's range, +0 for both zero codes) for all 16 codes and
 *     all 256 scales at every row and k position, with groups on the fast route and groups
 *     that leave it (one extreme scale among 32);
 *   - the register-decode kernels of the fp32-chain tiers (scalar, avx2, avx512) against
 *     fmaf chains over the decoded weights, scales of every kind (denormal weights and
 *     infinities too: those tiers compute the chain exactly);
 *   - the avx512bf16 vdpbf16ps kernel against chains of the vdpbf16ps lane model
 *     (emulate/bf16_amx_model.h), which flushes the denormal weights of scales 0 and 1;
 *   - on every tier, the decode route equal to the chunk route (the chunk decoder, then the
 *     tier's bf16 kernel), as the pipeline assumes: the amx group-by-group tile kernel
 *     against the bf16 tile kernel on decoded chunks.
 * Its own program, linked with the core's objects by tools/build_c_tests.py: natively it runs
 * the tiers the CPU has (and says which it skipped); the emulated build runs every tier.
 * Prints one line per group of checks; exits 1 when a check failed.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ukernels.h"
#include "emulate/bf16_amx_model.h" /* cm_dpbf16_lane; plain C */

#include "cpumoe/cpumoe.h"

#define KERNEL_TEST_SEED 0x2545f4914f6cdd1du
#include "kernel_test.h" /* rnd, xmalloc, the precondition hook */

enum { NR = 32, GROUP = 32, SLACK_ROWS = 16 };

static void check(int ok, const char *what, const char *tier, size_t mr, size_t k) {
  if (kernel_check_failed(ok))
    fprintf(stderr, "FAIL: %s [%s] (mr %zu, k %zu)\n", what, tier, mr, k);
}

/* ---- the definition ------------------------------------------------------------------------ */

/* bf16 bits of e2m1(code) * 2^(scale - 127): the value in double, then its bf16 bits, which
 * must be exact (checked); beyond bf16's largest finite value, infinity */
static uint16_t mxfp4_bf16(unsigned code, unsigned scale) {
  static const double magnitude[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if ((code & 7) == 0) return 0; /* both zero codes: +0 */
  const uint16_t sign = (uint16_t)((code & 8) << 12);
  const double v = ldexp(magnitude[code & 7], (int)scale - 127);
  if (v >= 0x1p128) return sign | 0x7f80;
  const float f = (float)v;
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((double)f != v || (bits & 0xffff)) {
    fprintf(stderr, "code %u scale %u: not a bf16\n", code, scale);
    exit(2);
  }
  return (uint16_t)(sign | bits >> 16);
}

static float bf16_value(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* A 32-row block of k weights: codes[n][k] (0..15), scales[n][k / 32], and the packed form
 * the kernels read (common/mxfp4.h, docs/FORMATS.md) */
typedef struct block {
  size_t k;
  uint8_t *codes, *scales;
  uint8_t *packed, *packed_scales;
} block;

static uint16_t block_weight(const block *b, size_t n, size_t k) {
  return mxfp4_bf16(b->codes[n * b->k + k], b->scales[n * (b->k / GROUP) + k / GROUP]);
}

static void pack_block(block *b) {
  const size_t k = b->k, groups = k / GROUP;
  for (size_t kp = 0; kp < k / 2; kp++)
    for (size_t j = 0; j < 32; j++) {
      const size_t kk = 2 * kp + j % 2;
      b->packed[kp * 32 + j] =
          (uint8_t)(b->codes[(j / 2) * k + kk] | b->codes[(16 + j / 2) * k + kk] << 4);
    }
  for (size_t g = 0; g < groups; g++)
    for (size_t n = 0; n < 32; n++) b->packed_scales[g * 32 + n] = b->scales[n * groups + g];
}

/* Scale kinds: 0 moderate (the fast route), 1 any byte (denormal weights, infinities), 2
 * moderate with one extreme scale in some groups (those groups leave the fast route), 3 only
 * 0 and 1 (every nonzero weight a bf16 denormal). */
enum { SCALE_KINDS = 4 };
static uint8_t rnd_scale(int kind, int extreme) {
  if (kind == 1) return (uint8_t)rnd();
  if (kind == 3) return (uint8_t)(rnd() % 2);
  if (extreme) return (uint8_t)(rnd() % 2 ? rnd() % 2 : 253 + rnd() % 3);
  return (uint8_t)(120 + rnd() % 14);
}

static block make_block(size_t k, int kind) {
  block b = {k, xmalloc(32 * k), xmalloc(32 * (k / GROUP)), xmalloc(16 * k), xmalloc(k)};
  for (size_t i = 0; i < 32 * k; i++) b.codes[i] = (uint8_t)(rnd() % 16);
  for (size_t g = 0; g < k / GROUP; g++) {
    const size_t odd_row = kind == 2 && rnd() % 3 == 0 ? rnd() % 32 : 32;
    for (size_t n = 0; n < 32; n++) b.scales[n * (k / GROUP) + g] = rnd_scale(kind, n == odd_row);
  }
  pack_block(&b);
  return b;
}

static void free_block(block *b) {
  free(b->codes), free(b->scales), free(b->packed), free(b->packed_scales);
}

/* ---- the kernels of each tier ---------------------------------------------------------------- */

typedef struct tier_kernels {
  const char *name;
  cpumoe_isa isa;
  cm_mxfp4_decode_fn decode_chunk;
  cm_gemm_mxfp4_fn gemm_f32; /* register decode on fp32 panels (NULL: none) */
  size_t gemm_f32_rows;
  cm_gemm_fn bf16_f32; /* the tier's bf16-weight kernel on fp32 panels */
} tier_kernels;

static const tier_kernels g_tiers[] = {
    {"scalar", CPUMOE_ISA_SCALAR, cm_mxfp4_to_bf16__scalar, cm_mxfp4_gemm_f32acc_mrx32__scalar, 4,
     cm_bf16_gemm_f32acc_mrx32__scalar},
    {"avx2", CPUMOE_ISA_AVX2, cm_mxfp4_to_bf16__avx2, cm_mxfp4_gemm_f32acc_mrx32__avx2, 2,
     cm_bf16_gemm_f32acc_mrx32__avx2},
    {"avx512", CPUMOE_ISA_AVX512, cm_mxfp4_to_bf16__avx512, cm_mxfp4_gemm_f32acc_mrx32__avx512, 4,
     cm_bf16_gemm_f32acc_mrx32__avx512},
};

/* ---- decoding -------------------------------------------------------------------------------- */

/* Every code at every row and k parity, with every scale: group g has scale g at every row;
 * row n's code at k is (k + n) % 16, so each row sees each code at both k parities. Then
 * random blocks of the three scale kinds. */
static void check_decoders(void) {
  block all = make_block(256 * GROUP, 0);
  for (size_t n = 0; n < 32; n++)
    for (size_t k = 0; k < all.k; k++) {
      all.codes[n * all.k + k] = (uint8_t)((k + n) % 16);
      all.scales[n * 256 + k / GROUP] = (uint8_t)(k / GROUP);
    }
  pack_block(&all);
  block random[3] = {make_block(512, 0), make_block(512, 1), make_block(512, 2)};
  for (size_t t = 0; t < sizeof g_tiers / sizeof g_tiers[0]; t++) {
    const tier_kernels *tk = &g_tiers[t];
    if (!tier_runs(tk->isa)) {
      printf("mxfp4 decode: %s skipped, this CPU lacks the tier\n", tk->name);
      continue;
    }
    const int checks = g_checks;
    for (int which = 0; which < 4; which++) {
      const block *b = which == 0 ? &all : &random[which - 1];
      uint16_t *dst = xmalloc(2 * 32 * b->k);
      /* in chunks of 256 k (the pipeline's), the last one shorter when k is not a multiple */
      for (size_t k0 = 0; k0 < b->k; k0 += 256) {
        const size_t kc = b->k - k0 < 256 ? b->k - k0 : 256;
        tk->decode_chunk(kc, b->packed + 16 * k0, b->packed_scales + k0, dst + 32 * k0);
      }
      int ok = 1;
      for (size_t k = 0; k < b->k; k++)
        for (size_t n = 0; n < 32; n++)
          ok &= dst[(k / 2) * 64 + 2 * n + k % 2] == block_weight(b, n, k);
      check(ok, which == 0 ? "decode of every code and scale" : "decode of random blocks", tk->name,
            0, b->k);
      free(dst);
    }
    printf("mxfp4 decode: %s %d checks (16 codes x 256 scales at 32 rows x 2 k parities)\n",
           tk->name, g_checks - checks);
  }
  free_block(&all);
  for (int i = 0; i < 3; i++) free_block(&random[i]);
}

/* ---- GEMMs ----------------------------------------------------------------------------------- */

/* fp32 A panel [k][as] of bf16-exact values (as the pipeline's panels hold) */
static float *make_a_f32(size_t k, size_t as) {
  float *a = xmalloc(sizeof(float) * k * as);
  for (size_t i = 0; i < k * as; i++) {
    const uint16_t h = (uint16_t)((rnd() & 1) << 15 | (127 - 4 + rnd() % 9) << 7 | (rnd() & 0x7f));
    a[i] = bf16_value(h);
  }
  return a;
}

static int same_bits(float x, float y) {
  return f32_bits(x) == f32_bits(y) || (isnan(x) && isnan(y));
}

/* fp32-chain tiers: the decode kernel equals fmaf chains over the decoded weights, and the
 * chunk route (decoder, then the tier's bf16 kernel, 256 k at a time) equals both */
static void check_f32_gemms(void) {
  static const size_t ks[] = {32, 64, 288, 1024};
  for (size_t t = 0; t < sizeof g_tiers / sizeof g_tiers[0]; t++) {
    const tier_kernels *tk = &g_tiers[t];
    if (!tier_runs(tk->isa)) continue;
    const int checks = g_checks;
    for (int kind = 0; kind < SCALE_KINDS; kind++)
      for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
        for (size_t mr = 1; mr <= tk->gemm_f32_rows; mr++)
          for (int accumulate = 0; accumulate < 2; accumulate++) {
            const size_t k = ks[ki], as = mr + 1;
            block b = make_block(k, kind);
            float *a = make_a_f32(k, as);
            float c0[4 * NR], c[4 * NR], chunk_c[4 * NR];
            for (size_t i = 0; i < 4 * NR; i++) c0[i] = (float)(rnd() % 64) / 16.0f - 2.0f;
            memcpy(c, c0, sizeof c), memcpy(chunk_c, c0, sizeof c);
            tk->gemm_f32(mr, k, a, as, b.packed, b.packed_scales, c, accumulate);
            uint16_t *dec = xmalloc(2 * 256 * NR);
            for (size_t k0 = 0; k0 < k; k0 += 256) {
              const size_t kc = k - k0 < 256 ? k - k0 : 256;
              tk->decode_chunk(kc, b.packed + 16 * k0, b.packed_scales + k0, dec);
              tk->bf16_f32(mr, kc, a + k0 * as, as, dec, chunk_c, accumulate || k0 > 0,
                           CM_PREFETCH_SELF);
            }
            int ok = 1, ok_chunk = 1;
            for (size_t r = 0; r < mr; r++)
              for (size_t n = 0; n < NR; n++) {
                float want = accumulate ? c0[r * NR + n] : 0.0f;
                for (size_t kk = 0; kk < k; kk++)
                  want = fmaf(a[kk * as + r], bf16_value(block_weight(&b, n, kk)), want);
                ok &= same_bits(c[r * NR + n], want);
                ok_chunk &= same_bits(chunk_c[r * NR + n], want);
              }
            for (size_t i = mr * NR; i < 4 * NR; i++) ok &= f32_bits(c[i]) == f32_bits(c0[i]);
            check(ok, "decode kernel vs fmaf chain (rows past mr untouched)", tk->name, mr, k);
            check(ok_chunk, "chunk route vs fmaf chain", tk->name, mr, k);
            free(dec), free(a);
            free_block(&b);
          }
    printf("mxfp4 gemm: %s %d checks against fmaf chains (moderate, any, mixed, tiny scales)\n",
           tk->name, g_checks - checks);
  }
}

/* avx512bf16: the vdpbf16ps kernel against chains of the lane model, A in bf16 pairs with k
 * even high; the any-scale blocks give denormal weights (flushed) and infinities */
static void check_pairs_gemm(void) {
  if (!tier_runs(CPUMOE_ISA_AVX512BF16)) {
    printf("mxfp4 gemm: avx512bf16 skipped, this CPU lacks the tier\n");
    return;
  }
  static const size_t ks[] = {32, 96, 512};
  const int checks = g_checks;
  int flushed = 0;
  for (int kind = 0; kind < SCALE_KINDS; kind++)
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
      for (size_t mr = 1; mr <= 4; mr++)
        for (int accumulate = 0; accumulate < 2; accumulate++) {
          const size_t k = ks[ki], as = mr + 2;
          block b = make_block(k, kind);
          float *af = make_a_f32(k, as);
          uint32_t *a = xmalloc(4 * (k / 2) * as);
          for (size_t kp = 0; kp < k / 2; kp++)
            for (size_t r = 0; r < as; r++)
              a[kp * as + r] = (f32_bits(af[2 * kp * as + r]) & 0xffff0000u) |
                               f32_bits(af[(2 * kp + 1) * as + r]) >> 16;
          float c0[4 * NR], c[4 * NR];
          for (size_t i = 0; i < 4 * NR; i++) c0[i] = (float)(rnd() % 64) / 16.0f - 2.0f;
          memcpy(c, c0, sizeof c);
          cm_mxfp4_gemm_pairs_mrx32__avx512bf16(mr, k, a, as, b.packed, b.packed_scales, c,
                                                accumulate);
          int ok = 1;
          for (size_t r = 0; r < mr; r++)
            for (size_t n = 0; n < NR; n++) {
              uint32_t want = accumulate ? f32_bits(c0[r * NR + n]) : 0;
              float chain = accumulate ? c0[r * NR + n] : 0.0f;
              for (size_t kk = 0; kk < k; kk += 2) {
                const uint32_t w = (uint32_t)block_weight(&b, n, kk) << 16 |
                                   block_weight(&b, n, kk + 1); /* high first */
                want = cm_dpbf16_lane(want, a[(kk / 2) * as + r], w);
                chain = fmaf(af[kk * as + r], bf16_value(block_weight(&b, n, kk)), chain);
                chain = fmaf(af[(kk + 1) * as + r], bf16_value(block_weight(&b, n, kk + 1)), chain);
              }
              float wf;
              memcpy(&wf, &want, 4);
              ok &= same_bits(c[r * NR + n], wf);
              flushed += !same_bits(wf, chain);
            }
          check(ok, "vdpbf16ps kernel vs lane model", "avx512bf16", mr, k);
          free(a), free(af);
          free_block(&b);
        }
  printf(
      "mxfp4 gemm: avx512bf16 %d checks against the vdpbf16ps model (%d elements where it "
      "parts from the fmaf chain)\n",
      g_checks - checks, flushed);
  /* the any-scale blocks must reach weights the instruction flushes, or they test nothing the
   * moderate ones do not */
  check(flushed > 0, "denormal weights reach the flushing", "avx512bf16", 0, 0);
}

/* amx: the group-by-group tile kernel equals the chunk route (avx512's decoder, then the bf16
 * tile kernel), on BF16_ROWS panels with whole-tile slack */
static void check_amx_gemm(void) {
  if (!tier_runs(CPUMOE_ISA_AMX)) {
    printf("mxfp4 gemm: amx skipped, this CPU lacks the tier\n");
    return;
  }
  (void)cpumoe_active_isa(); /* on Linux: the tile data permission, asked at the first choice */
  static const size_t ks[] = {32, 288, 1024};
  static const size_t rows[] = {1, 2, 4, 5, 16, 17, 32};
  const int checks = g_checks;
  for (int kind = 0; kind < SCALE_KINDS; kind++)
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
      for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++)
        for (int accumulate = 0; accumulate < 2; accumulate++) {
          const size_t k = ks[ki], mr = rows[ri];
          block b = make_block(k, kind);
          uint16_t *a = xmalloc(2 * (mr + SLACK_ROWS) * k);
          for (size_t i = 0; i < (mr + SLACK_ROWS) * k; i++)
            a[i] = (uint16_t)((rnd() & 1) << 15 | (127 - 4 + rnd() % 9) << 7 | (rnd() & 0x7f));
          float c0[32 * NR], c[32 * NR], chunk_c[32 * NR];
          for (size_t i = 0; i < 32 * NR; i++) c0[i] = (float)(rnd() % 64) / 16.0f - 2.0f;
          memcpy(c, c0, sizeof c), memcpy(chunk_c, c0, sizeof c);
          cm_mxfp4_gemm_rows_mrx32__amx(mr, k, a, k, b.packed, b.packed_scales, c, accumulate);
          uint16_t *dec = xmalloc(2 * 256 * NR);
          for (size_t k0 = 0; k0 < k; k0 += 256) {
            const size_t kc = k - k0 < 256 ? k - k0 : 256;
            cm_mxfp4_to_bf16__avx512(kc, b.packed + 16 * k0, b.packed_scales + k0, dec);
            cm_bf16_gemm_rows_mrx32__amx(mr, kc, a + k0, k, dec, chunk_c, accumulate || k0 > 0,
                                         CM_PREFETCH_SELF);
          }
          int ok = 1;
          for (size_t i = 0; i < 32 * NR; i++) ok &= same_bits(c[i], chunk_c[i]);
          check(ok, "tile kernel vs chunk route (rows past mr untouched)", "amx", mr, k);
          free(a), free(dec);
          free_block(&b);
        }
  cm_amx_end_op__amx();
  printf("mxfp4 gemm: amx %d checks against the chunk route\n", g_checks - checks);
}

int main(void) {
  check_decoders();
  check_f32_gemms();
  check_pairs_gemm();
  check_amx_gemm();
  return kernel_test_summary();
}
