/*
 * The micro-kernel table of each tier and the choice of the active one.
 *
 * The best tier the CPU supports is found once (cpuid + xgetbv); the environment
 * variable CPUMOE_ISA=scalar|avx2|avx512 caps it at load, cpumoe_set_isa_cap at
 * run time. Only function pointers live here: nothing tier-specific executes in
 * this baseline-compiled file.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/parallel.h"
#include "common/ukernels.h"
#include "dispatch/cpuinfo.h"

#define CM_TABLE(tier, tier_enum, mr_rows, int4_gemm)    \
  {                                                      \
      .isa = tier_enum,                                  \
      .mr = mr_rows,                                     \
      .gemm_bf16 = cm_bf16_gemm_f32acc_mrx32__##tier,    \
      .gemm_f16 = cm_f16_gemm_f32acc_mrx32__##tier,      \
      .silu_mul = cm_silu_mul__##tier,                   \
      .swiglu = cm_swiglu__##tier,                       \
      .widen_bf16 = cm_widen_bf16__##tier,               \
      .widen_f16 = cm_widen_f16__##tier,                 \
      .narrow_bf16 = cm_narrow_bf16__##tier,             \
      .narrow_f16 = cm_narrow_f16__##tier,               \
      .round_bf16 = cm_round_bf16__##tier,               \
      .round_f16 = cm_round_f16__##tier,                 \
      .axpy = cm_axpy__##tier,                           \
      .bias_scale = cm_bias_scale__##tier,               \
      .bias_scale_stream = cm_bias_scale_stream__##tier, \
      .probe_read = cm_probe_read_chunk__##tier,         \
      .probe_fma = cm_probe_fma_loop__##tier,            \
      .probe_int8 = cm_probe_int8_loop__##tier,          \
      .gemm_u8s8 = cm_u8s8_gemm_s32acc_mrx32__##tier,    \
      .dequant_u8s8 = cm_u8s8_dequant_mrx32__##tier,     \
      .gemm_fp8 = cm_fp8_gemm_f32acc_mrx32__##tier,      \
      .fp8_to_f32 = cm_fp8_to_f32__##tier,               \
      .gemm_f32b = cm_f32_gemm_f32acc_mrx32__##tier,     \
      .fp8_fold = cm_fp8_fold__##tier,                   \
      .gemm_int4 = int4_gemm,                            \
      .int4_unpack = cm_int4_unpack__##tier,             \
      .int4_dequant = cm_int4_dequant_mrx32__##tier,     \
      .absmax = cm_absmax__##tier,                       \
      .quantize_u8 = cm_quantize_u8__##tier,             \
  }

/* Rows per A panel: what each tier's GEMM tile holds (see the kernel headers). Only avx512
 * decodes INT4 in registers; the other tiers take the unpack path for every block. */
static const cm_ukernels cm_tables[CPUMOE_ISA_COUNT] = {
    [CPUMOE_ISA_SCALAR] = CM_TABLE(scalar, CPUMOE_ISA_SCALAR, 4, NULL),
    [CPUMOE_ISA_AVX2] = CM_TABLE(avx2, CPUMOE_ISA_AVX2, 4, NULL),
    [CPUMOE_ISA_AVX512] =
        CM_TABLE(avx512, CPUMOE_ISA_AVX512, 12, cm_int4_gemm_f32acc_mrx32__avx512),
};

static const char *const cm_isa_names[CPUMOE_ISA_COUNT] = {"scalar", "avx2", "avx512"};

typedef struct cm_dispatch_state {
  cm_cpu_features features;
  cpumoe_isa native; /* best tier the CPU runs itself */
  cpumoe_isa best;   /* = native, or every tier in an emulating test build */
  char features_text[256];
} cm_dispatch_state;

static cm_dispatch_state cm_state;
static atomic_int cm_state_ready; /* 0: not probed, 1: probing, 2: ready */
static atomic_int cm_active = -1; /* active tier, -1 until chosen */
static char cm_reason[160];

static void append_feature(char *text, size_t size, int present, const char *name) {
  if (!present) return;
  size_t len = strlen(text);
  snprintf(text + len, size - len, "%s%s", len ? " " : "", name);
}

static const cm_dispatch_state *dispatch_state(void) {
  if (atomic_load(&cm_state_ready) == 2) return &cm_state;
  int expected = 0;
  if (atomic_compare_exchange_strong(&cm_state_ready, &expected, 1)) {
    cm_cpu_features f = cm_detect_cpu_features();
    cm_state.features = f;
    cm_state.native = cm_cpu_supports_avx512_tier(&f) ? CPUMOE_ISA_AVX512
                      : cm_cpu_supports_avx2_tier(&f) ? CPUMOE_ISA_AVX2
                                                      : CPUMOE_ISA_SCALAR;
#ifdef CPUMOE_EMULATE_TIERS
    cm_state.best = (cpumoe_isa)(CPUMOE_ISA_COUNT - 1);
#else
    cm_state.best = cm_state.native;
#endif
    char *t = cm_state.features_text;
    const size_t n = sizeof cm_state.features_text;
    t[0] = '\0';
    append_feature(t, n, f.avx && f.os_avx, "avx");
    append_feature(t, n, f.avx2 && f.os_avx, "avx2");
    append_feature(t, n, f.fma && f.os_avx, "fma");
    append_feature(t, n, f.f16c && f.os_avx, "f16c");
    append_feature(t, n, f.avx512f && f.os_avx512, "avx512f");
    append_feature(t, n, f.avx512dq && f.os_avx512, "avx512dq");
    append_feature(t, n, f.avx512bw && f.os_avx512, "avx512bw");
    append_feature(t, n, f.avx512vl && f.os_avx512, "avx512vl");
    append_feature(t, n, f.avx512vnni && f.os_avx512, "avx512vnni");
    append_feature(t, n, f.avx512bf16 && f.os_avx512, "avx512bf16");
    append_feature(t, n, f.avx512fp16 && f.os_avx512, "avx512fp16");
    append_feature(t, n, f.amx_tile && f.os_amx, "amx-tile");
    append_feature(t, n, f.amx_bf16 && f.os_amx, "amx-bf16");
    append_feature(t, n, f.amx_int8 && f.os_amx, "amx-int8");
    atomic_store(&cm_state_ready, 2);
  } else {
    while (atomic_load(&cm_state_ready) != 2) {
    }
  }
  return &cm_state;
}

static cpumoe_isa choose_active(void) {
  const cpumoe_isa best = dispatch_state()->best;
  cpumoe_isa chosen = best;
  const char *env = getenv("CPUMOE_ISA");
  if (env && *env) {
    const cpumoe_isa cap = cpumoe_isa_from_name(env);
    if (cap == CPUMOE_ISA_COUNT) {
      snprintf(cm_reason, sizeof cm_reason,
               "%s (best supported; CPUMOE_ISA=%s is not a tier name, ignored)", cm_isa_names[best],
               env);
    } else if (cap < best) {
      chosen = cap;
      snprintf(cm_reason, sizeof cm_reason, "%s (capped by CPUMOE_ISA=%s; best supported: %s)",
               cm_isa_names[chosen], env, cm_isa_names[best]);
    } else {
      snprintf(cm_reason, sizeof cm_reason, "%s (best supported; CPUMOE_ISA=%s allows it)",
               cm_isa_names[best], env);
    }
  } else {
    snprintf(cm_reason, sizeof cm_reason, "%s (best supported by this CPU)", cm_isa_names[best]);
  }
  return chosen;
}

cpumoe_isa cpumoe_active_isa(void) {
  int active = atomic_load(&cm_active);
  if (active < 0) {
    int expected = -1;
    const int chosen = (int)choose_active();
    if (!atomic_compare_exchange_strong(&cm_active, &expected, chosen)) return (cpumoe_isa)expected;
    active = chosen;
  }
  return (cpumoe_isa)active;
}

const cm_ukernels *cm_active_ukernels(void) {
  return &cm_tables[cpumoe_active_isa()];
}

cpumoe_isa cpumoe_best_supported_isa(void) {
  return dispatch_state()->best;
}

const char *cpumoe_isa_name(cpumoe_isa isa) {
  return (unsigned)isa < CPUMOE_ISA_COUNT ? cm_isa_names[isa] : "unknown";
}

cpumoe_isa cpumoe_isa_from_name(const char *name) {
  for (int i = 0; i < CPUMOE_ISA_COUNT; i++)
    if (name && strcmp(name, cm_isa_names[i]) == 0) return (cpumoe_isa)i;
  return CPUMOE_ISA_COUNT;
}

cpumoe_status cpumoe_set_isa_cap(cpumoe_isa isa) {
  if ((unsigned)isa >= CPUMOE_ISA_COUNT)
    return cm_fail(CPUMOE_EINVAL, "unknown ISA tier %d (expected scalar, avx2 or avx512)",
                   (int)isa);
  const cpumoe_isa best = cpumoe_best_supported_isa();
  const cpumoe_isa chosen = isa < best ? isa : best;
  if (isa > best)
    snprintf(cm_reason, sizeof cm_reason, "%s (requested %s, which this CPU cannot run)",
             cm_isa_names[chosen], cm_isa_names[isa]);
  else
    snprintf(cm_reason, sizeof cm_reason, "%s (set by cpumoe.set_isa; best supported: %s)",
             cm_isa_names[chosen], cm_isa_names[best]);
  atomic_store(&cm_active, (int)chosen);
  return CPUMOE_OK;
}

int cpumoe_isa_native(cpumoe_isa isa) {
  return (unsigned)isa < CPUMOE_ISA_COUNT && isa <= dispatch_state()->native;
}

const char *cpumoe_isa_numerics(cpumoe_isa isa) {
  /* every tier so far: one sequential fp32 FMA chain per output, exact integer sums */
  return (unsigned)isa < CPUMOE_ISA_COUNT ? "fp32-chain" : NULL;
}

const char *cpumoe_isa_reason(void) {
  (void)cpumoe_active_isa();
  return cm_reason;
}

const char *cpumoe_cpu_features(void) {
  return dispatch_state()->features_text;
}

/* ---- probes: the active tier's loops, run once on every worker ---- */

typedef struct probe_job {
  const char *buffer;
  size_t bytes_per_worker;
  int64_t passes, iterations;
  double result[CM_MAX_WORKERS];
} probe_job;

static void probe_read_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  const cm_ukernels *uk = cm_active_ukernels();
  double s = 0;
  for (int64_t p = 0; p < job->passes; p++)
    s += uk->probe_read(job->buffer + (size_t)w * job->bytes_per_worker, job->bytes_per_worker);
  job->result[w] = s;
}

static void probe_fma_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  job->result[w] = cm_active_ukernels()->probe_fma(job->iterations);
}

static double run_probe(const cpumoe_runner *runner, cpumoe_worker_fn fn, probe_job *job) {
  const int64_t workers = cm_worker_count(runner, CM_MAX_WORKERS);
  if (job->buffer) job->bytes_per_worker = (job->bytes_per_worker / (size_t)workers) & ~(size_t)511;
  cm_run_workers(runner, workers, fn, job);
  double total = 0;
  for (int64_t w = 0; w < workers; w++) total += job->result[w];
  return total;
}

double cpumoe_probe_read(const void *buffer, size_t bytes, int64_t passes,
                         const cpumoe_runner *runner) {
  if (!buffer) return 0.0; /* nothing to read (run_probe takes a NULL buffer for "no buffer") */
  probe_job job = {.buffer = (const char *)buffer, .bytes_per_worker = bytes, .passes = passes};
  return run_probe(runner, probe_read_worker, &job);
}

static void probe_int8_worker(void *arg, int64_t w) {
  probe_job *job = (probe_job *)arg;
  job->result[w] = cm_active_ukernels()->probe_int8(job->iterations);
}

double cpumoe_probe_int8(int64_t iterations, const cpumoe_runner *runner) {
  probe_job job = {.iterations = iterations};
  return run_probe(runner, probe_int8_worker, &job);
}

double cpumoe_probe_fma(int64_t iterations, const cpumoe_runner *runner) {
  probe_job job = {.iterations = iterations};
  return run_probe(runner, probe_fma_worker, &job);
}
