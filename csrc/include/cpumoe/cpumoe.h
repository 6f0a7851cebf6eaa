/*
 * cpumoe — public C API of the torch-free core.
 *
 * Everything the PyTorch binding calls, usable from plain C programs:
 *   - enums for dtypes, weight schemes, activations, ISA tiers and status codes;
 *   - the MoE problem description and its two entry points (workspace size, run);
 *   - the dense linear (one packed weight, the MoE's kernels) with its two entry points;
 *   - the routing (gating) problem before the experts, with its two entry points;
 *   - the weight packers (byte layouts in docs/FORMATS.md);
 *   - the parallel-for hook through which the caller supplies threads;
 *   - CPU feature / ISA tier queries and the tier cap (CPUMOE_ISA).
 *
 * Conventions: sizes are int64_t element counts; tensors are dense row-major;
 * 16-bit floats travel as raw uint16_t bits. No function allocates memory:
 * ops ask for a workspace size, the caller passes that many bytes.
 * On failure a function returns a non-zero status and cpumoe_last_error()
 * returns a message for the calling thread.
 */
#ifndef CPUMOE_CPUMOE_H
#define CPUMOE_CPUMOE_H

#include <stddef.h>
#include <stdint.h>

#include "cpumoe/tiers.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cpumoe_status {
  CPUMOE_OK = 0,
  CPUMOE_EINVAL = 1,       /* an argument is out of its documented range */
  CPUMOE_EUNSUPPORTED = 2, /* valid, but not implemented (size, scheme) */
  CPUMOE_EWORKSPACE = 3,   /* workspace missing or smaller than asked for */
} cpumoe_status;

typedef enum cpumoe_dtype {
  CPUMOE_DTYPE_BF16 = 0,
  CPUMOE_DTYPE_F16 = 1,
  CPUMOE_DTYPE_F32 = 2,
  CPUMOE_DTYPE_F64 = 3,
  CPUMOE_DTYPE_I8 = 4,
  CPUMOE_DTYPE_U8 = 5,
  CPUMOE_DTYPE_F8E4M3 = 6,
  CPUMOE_DTYPE_I32 = 7,
  CPUMOE_DTYPE_I64 = 8,
} cpumoe_dtype;

/* moe_comp_method values of SGLang's schema. */
typedef enum cpumoe_scheme {
  CPUMOE_SCHEME_UNQUANT = 0, /* bf16/fp16 weights in the activation dtype */
  CPUMOE_SCHEME_INT8_W8A8 = 1,
  CPUMOE_SCHEME_FP8_W8A16 = 2,
  CPUMOE_SCHEME_INT4_W4A8 = 3,
  CPUMOE_SCHEME_MXFP4 = 4, /* OCP MX fp4 (gpt-oss): e2m1 weights, an e8m0 scale per 32 k */
} cpumoe_scheme;

typedef enum cpumoe_activation {
  /* w1 rows are [gate; up]: a = silu(h[:N]) * h[N:] */
  CPUMOE_ACT_SILU_MUL = 0,
  /* GPT-OSS: w1 rows interleave gate/up (h[0::2], h[1::2]);
   * g = min(g, limit), u = clamp(u, -limit, limit), a = g*sigmoid(alpha*g)*(u+1) */
  CPUMOE_ACT_SWIGLU_CLAMP = 1,
  /* w1 rows are [gate; up]: a = gelu(h[:N]) * h[N:], gelu(x) = x Phi(x) with the exact
   * normal CDF Phi (erf form, not the tanh approximation) */
  CPUMOE_ACT_GELU_MUL = 2,
  /* DeepSeek-V4: w1 rows are [gate; up] (not interleaved), no alpha:
   * g = min(gate, limit), u = clamp(up, -limit, limit), a = silu(g) * u.
   * limit must be >= 0 (+inf clamps nothing); NaN or negative is CPUMOE_EINVAL.
   * A NaN gate or up gives a NaN result (the clamp passes NaN on, as torch.clamp). */
  CPUMOE_ACT_SILU_CLAMP = 3,
} cpumoe_activation;

/* ISA tiers (the list and their ids: cpumoe/tiers.h). A tier is usable when the CPU has
 * every feature it and its ancestors need and the OS saves their register state. */
typedef enum cpumoe_isa {
#define CPUMOE_ISA_ENUMERATOR(ENUM, name, id, ...) CPUMOE_ISA_##ENUM = id,
  CPUMOE_FOR_EACH_TIER(CPUMOE_ISA_ENUMERATOR)
#undef CPUMOE_ISA_ENUMERATOR
#define CPUMOE_ISA_PLUS_ONE(...) +1
  /* the number of tiers; also what cpumoe_isa_from_name returns for an unknown name */
  CPUMOE_ISA_COUNT = 0 CPUMOE_FOR_EACH_TIER(CPUMOE_ISA_PLUS_ONE),
#undef CPUMOE_ISA_PLUS_ONE
} cpumoe_isa;

/* ---- threads ---------------------------------------------------------------
 * The core never starts threads. An op splits its work into independent tasks
 * and asks the runner to call `worker(arg, w)` once for each w in [0, n_workers),
 * concurrently where it can; workers claim tasks from each other's queues, so which
 * thread runs which task never changes any result. A worker may wait for tasks that
 * other workers have already started, never for a worker to start, so a runner that
 * calls the workers one after another is correct too. A NULL runner means serial. */
typedef void (*cpumoe_worker_fn)(void *arg, int64_t worker_index);
typedef struct cpumoe_runner {
  void (*run)(void *runner_ctx, int64_t n_workers, cpumoe_worker_fn worker, void *arg);
  void *runner_ctx;
  int64_t num_threads; /* how many workers to ask for (>= 1) */
} cpumoe_runner;

/* ---- fused MoE ---------------------------------------------------------------
 * out[m] = sum_j topk_weights[m,j] * W2[e] @ act(W1[e] @ x[m] + b1[e]) + b2[e] ...
 * with e = topk_ids[m,j], slots with id -1 skipped (docs/MATH.md states it in full).
 * Rounding points: h in fp32, act(h) rounded to the activation dtype, y in fp32,
 * g*y and the sum over slots in fp32, one rounding of the final sum (none with out_f32). */
typedef struct cpumoe_moe_problem {
  int64_t M;    /* tokens (>= 0) */
  int64_t K;    /* hidden size, multiple of 32, <= 2^30 */
  int64_t N;    /* intermediate size per expert, multiple of 32, <= 2^30 */
  int64_t E;    /* experts, < 2^31 */
  int64_t topk; /* slots per token, 1..16384 */
  /* Every tensor's byte count must fit in ptrdiff_t (else CPUMOE_EINVAL). */
  cpumoe_scheme scheme;
  cpumoe_dtype act_dtype; /* BF16 or F16: x, out, residual */
  cpumoe_activation activation;
  float alpha, limit; /* SWIGLU_CLAMP: both; SILU_CLAMP: limit */

  const void *x;  /* [M, K] act_dtype */
  const void *w1; /* packed [E, 2N, K] (layout per scheme, docs/FORMATS.md) */
  const void *w2; /* packed [E, K, N] */

  /* INT8_W8A8: per output channel fp32 scales, w1_scale [E, 2N], w2_scale [E, K].
   * FP8_W8A16: 2-D block scales (multiplied), w1_scale [E, ceil(2N/block_n),
   * ceil(K/block_k)], w2_scale [E, ceil(K/block_n), ceil(N/block_k)]. */
  const float *w1_scale;
  const float *w2_scale;
  int64_t block_n, block_k; /* FP8_W8A16: block_n >= 1, block_k >= 2 and even */

  /* INT4_W4A8 (AWQ/GPTQ, packed by cpumoe_pack_int4; docs/FORMATS.md): w1 is
   * [E, 2N/32, K/bk1, 16*bk1 + 128] bytes with bk1 = min(w1_group, 128), w2 likewise over N;
   * w1_scale fp32 and w1_zero int8 are [E, 2N/32, K/w1_group, 32] (w2: [E, K/32,
   * N/w2_group, 32]). Real weight = (nibble - zero) * scale. Group sizes: multiples of 4
   * up to 128, or multiples of 128; they must divide the reduction. */
  const int8_t *w1_zero;
  const int8_t *w2_zero;
  int64_t w1_group, w2_group;

  /* MXFP4 (packed by cpumoe_pack_mxfp4 and cpumoe_pack_e8m0_scales; docs/FORMATS.md): w1 is
   * [E, 2N, K/2] bytes, w2 [E, K, N/2], two e2m1 codes per byte; w1_scale_e8m0 is
   * [E, 2N, K/32] and w2_scale_e8m0 [E, K, N/32], one e8m0 byte per output row and 32
   * consecutive k. Real weight = e2m1(code) * 2^(scale - 127), decoded exactly to bf16
   * (zero codes give +0, a value beyond bf16's range +-inf; docs/MATH.md). */
  const uint8_t *w1_scale_e8m0;
  const uint8_t *w2_scale_e8m0;

  /* Routing. topk_ids NULL means every slot picks expert 0 (a dense MLP);
   * topk_weights NULL means every weight is 1. */
  const void *topk_ids; /* [M, topk] I32 or I64; -1 = skip the slot */
  cpumoe_dtype topk_ids_dtype;
  const void *topk_weights; /* [M, topk] F32, F64, BF16 or F16 */
  cpumoe_dtype topk_weights_dtype;

  const float *w1_bias; /* [E, 2N] or NULL (both or neither) */
  const float *w2_bias; /* [E, K] or NULL */

  /* out = result + residual_scale * residual (fp32, before the one rounding) */
  const void *residual; /* [M, K] act_dtype or NULL */
  float residual_scale;

  void *out; /* [M, K] act_dtype; may alias x */
  /* 1: out is float32 [M, K] instead and holds the fp32 sum before that one rounding (the
   * sum over slots, plus the residual), so that partial results, e.g. one per rank of
   * expert parallelism, can be added and rounded once; it must not overlap x or residual.
   * 0 (the default): out is act_dtype. */
  int out_f32;
} cpumoe_moe_problem;

/* Bytes of workspace cpumoe_fused_experts needs for this problem with the
 * active ISA tier; 0 when the problem is invalid (see cpumoe_last_error). */
size_t cpumoe_fused_experts_workspace_size(const cpumoe_moe_problem *problem);

/* Runs the fused MoE. `workspace` needs no particular alignment or content. */
cpumoe_status cpumoe_fused_experts(const cpumoe_moe_problem *problem, void *workspace,
                                   size_t workspace_bytes, const cpumoe_runner *runner);

/* ---- dense linear ------------------------------------------------------------------
 * out[m] = round16(W @ x[m] + bias) for one packed weight W [N, K] (SGLang's
 * weight_packed_linear, int8_scaled_mm_with_quant, fp8_scaled_mm_cpu, int4_scaled_mm_cpu):
 * the first GEMM of cpumoe_fused_experts on a single expert, with its kernels and its bits.
 * W @ x[m] in fp32 (INT8/INT4: x[m] quantized per row to int8 first, as fused_experts does),
 * plus bias in fp32, then one rounding to the activation dtype (docs/MATH.md). */
typedef struct cpumoe_linear_problem {
  int64_t M; /* rows of x (>= 0) */
  int64_t K; /* input features, multiple of 32, <= 2^30 */
  int64_t N; /* output features, multiple of 32, <= 2^30 */
  /* Every tensor's byte count must fit in ptrdiff_t (else CPUMOE_EINVAL). */
  cpumoe_scheme scheme;
  cpumoe_dtype act_dtype; /* BF16 or F16: x and out */
  const void *x;          /* [M, K] act_dtype */
  /* packed [N, K] in the scheme's layout (docs/FORMATS.md), as one expert of
   * cpumoe_fused_experts' w1; INT4: [N/32, K/bk, 16*bk + 128] bytes, bk = min(w_group, 128) */
  const void *w;
  /* INT8_W8A8: fp32 [N] per output channel; FP8_W8A16: fp32 [ceil(N/block_n),
   * ceil(K/block_k)]; INT4_W4A8: fp32 [N/32, K/w_group, 32] from cpumoe_pack_int4 */
  const float *w_scale;
  int64_t block_n, block_k; /* FP8_W8A16, as in cpumoe_moe_problem */
  const int8_t *w_zero;     /* INT4_W4A8: int8 [N/32, K/w_group, 32] */
  int64_t w_group;          /* INT4_W4A8: group size, as cpumoe_moe_problem's w1_group */
  const float *bias;        /* [N] or NULL */
  void *out;                /* [M, N] act_dtype; must not overlap x */
} cpumoe_linear_problem;

/* Bytes of workspace cpumoe_linear needs for this problem with the active ISA tier; 0 when
 * the problem is invalid (see cpumoe_last_error). */
size_t cpumoe_linear_workspace_size(const cpumoe_linear_problem *problem);

/* Runs the linear. `workspace` needs no particular alignment or content. Work is split
 * over 32-column tiles of the output and, for many rows, over blocks of rows; results are
 * identical for any runner. */
cpumoe_status cpumoe_linear(const cpumoe_linear_problem *problem, void *workspace,
                            size_t workspace_bytes, const cpumoe_runner *runner);

/* ---- routing (gating) -----------------------------------------------------------
 * The router's top-k before the experts (SGLang's topk_softmax_cpu, topk_sigmoid_cpu,
 * grouped_topk_cpu, biased_grouped_topk_cpu; vLLM's biased_topk_cpu; both libraries'
 * hash_topk_cpu; docs/MATH.md, "Routing"). Per token m, with x = logits[m] in fp32:
 *   score[e]  softmax(x) (exp(x - max) * (1 / sum), the sum in expert order), sigmoid(x) or
 *             sqrt(softplus(x));
 *   rank[e]   x[e] without a bias (the order of the exact score), score[e] + bias[e] with one;
 *             NaN ranks as -inf; equal ranks go to the lower expert index;
 *   groups    with groups > 1, experts [g E/G, (g + 1) E/G) form group g, scored by the max
 *             of its ranks or the sum of its two best (one for a group of one expert); the
 *             topk_groups best groups (ties: lower group index) hold the candidates;
 *   slots     the R best candidates by rank, best first, weight score[e]; R = topk, or
 *             topk - 1 with fused shared experts, whose slot is last: id E + m % num_shared,
 *             weight (sum of the R weights) / routed_scaling_factor;
 *   scaling   every weight times c = f / S with renormalize, else f, where S is the sum of
 *             the R routed weights in slot order and f = routed_scaling_factor with
 *             scale_output, else 1.
 * Hash routing (tid2eid given; no bias, no groups): slot j < R of token m is expert
 * tid2eid[m R + j] (any of [0, E), repeats allowed, R may exceed E) with weight score[id];
 * with renormalize the R weights are multiplied by c = f / S only when S > 0 (else by f),
 * and the fused shared slot's weight is the sum, in slot order, of the R weights so
 * scaled, divided by routed_scaling_factor.
 * Rows m >= M_valid (padding) get ids -1 and weights 0. Results are identical for any
 * runner and on every ISA tier. */
/* out[i] = the activation of (gate[i], up[i]) as the active tier's fused MoE computes it on
 * the first GEMM's fp32 output (before the rounding to the activation dtype): silu(gate) *
 * up, gelu(gate) * up, the clamped swiglu with alpha and limit, or the clamped silu with
 * limit (checked as in a problem). For tests of the activations' bits; n may be 0. */
cpumoe_status cpumoe_activation_values(cpumoe_activation activation, float alpha, float limit,
                                       size_t n, const float *gate, const float *up, float *out);

typedef enum cpumoe_gating_score {
  CPUMOE_SCORE_SOFTMAX = 0,
  CPUMOE_SCORE_SIGMOID = 1,
  CPUMOE_SCORE_SQRTSOFTPLUS = 2,
} cpumoe_gating_score;

typedef enum cpumoe_group_score {
  CPUMOE_GROUP_MAX = 0,      /* the group's best rank (SGLang's grouped_topk) */
  CPUMOE_GROUP_TOP2_SUM = 1, /* the sum of its two best ranks (biased_grouped_topk) */
} cpumoe_group_score;

typedef struct cpumoe_gating_problem {
  int64_t M;       /* tokens (>= 0) */
  int64_t M_valid; /* rows [M_valid, M) are padding; 0 <= M_valid <= M */
  int64_t E;       /* routed experts, 1 .. 2^31 - 1 */
  int64_t topk;    /* slots per token, >= 1, the fused shared slot included */
  cpumoe_gating_score score;
  const void *logits; /* [M, E] F32, BF16 or F16, dense */
  cpumoe_dtype logits_dtype;
  const void *bias; /* [E] F32, BF16 or F16, or NULL: the correction bias of the ranking */
  cpumoe_dtype bias_dtype;
  int64_t groups;      /* >= 1, divides E; 1 = no groups */
  int64_t topk_groups; /* 1 .. groups */
  cpumoe_group_score group_score;
  int renormalize;
  int64_t num_shared; /* fused shared experts (>= 0); > 0 needs topk >= 2 and a factor */
  int has_routed_scaling_factor;
  float routed_scaling_factor; /* finite, non-zero when given */
  int scale_output;            /* multiply the weights by it (needs it given) */
  float *topk_weights;         /* out [M, topk] */
  int32_t *topk_ids;           /* out [M, topk] */
  const int32_t *tid2eid;      /* [M, R] dense, ids in [0, E), or NULL: hash routing */
} cpumoe_gating_problem;

/* Bytes of workspace cpumoe_gating needs for this problem run with `runner` (its scratch is
 * per worker); 0 when the problem is invalid (see cpumoe_last_error). */
size_t cpumoe_gating_workspace_size(const cpumoe_gating_problem *problem,
                                    const cpumoe_runner *runner);

/* Runs the routing; `workspace` needs no particular alignment or content. */
cpumoe_status cpumoe_gating(const cpumoe_gating_problem *problem, void *workspace,
                            size_t workspace_bytes, const cpumoe_runner *runner);

/* ---- packers ------------------------------------------------------------------
 * VNNI-2 for 16-bit weights: [rows, cols] -> blocks of 32 rows (the last may be
 * 16), each block stored [cols/2][rows_in_block][2]. Requirements: rows % 16 == 0,
 * cols % 32 == 0. `experts` matrices are packed one after another. */
cpumoe_status cpumoe_pack_vnni2_16bit(const uint16_t *src, uint16_t *dst, int64_t experts,
                                      int64_t rows, int64_t cols, const cpumoe_runner *runner);
/* The same VNNI-2 order for 8-bit elements (fp8 e4m3fn weights). */
cpumoe_status cpumoe_pack_vnni2_8bit(const uint8_t *src, uint8_t *dst, int64_t experts,
                                     int64_t rows, int64_t cols, const cpumoe_runner *runner);

/* VNNI-4 for int8 weights, plus per-row int32 compensation: [rows, cols] ->
 * [rows, cols + 4] bytes, blocks of 32 rows, each 32*cols bytes of [cols/4][32][4]
 * followed by int32 comp[32] = 128 * row sums. Requirements: rows % 32 == 0,
 * cols % 32 == 0, cols <= 65536. */
cpumoe_status cpumoe_pack_vnni4_int8(const int8_t *src, int8_t *dst, int64_t experts, int64_t rows,
                                     int64_t cols, const cpumoe_runner *runner);

/* INT4 W4A8 packer (SGLang's convert_weight_packed_scale_zp) for AWQ or GPTQ checkpoints.
 * Per expert, with OC output and IC input features and G groups along IC (group = IC / G):
 *   AWQ  (method 0): qweight int32 [IC][OC/8], column j of each 8 in nibble [0,4,1,5,2,6,3,7][j];
 *                    qzeros int32 [G][OC/8], same nibble order; zero = nibble.
 *   GPTQ (method 1): qweight int32 [IC/8][OC], k = 8 row + nibble index;
 *                    qzeros int32 [G][OC/8], column 8 c + nibble index; zero = nibble + 1.
 *   scales [G][OC] in `scales_dtype` (BF16, F16 or F32).
 * Outputs (docs/FORMATS.md): packed [OC/32][IC/bk][16*bk + 128] bytes with bk = min(group,
 * 128): nibble pairs of columns (n, n + 8) in VNNI-4 order, then int32 comp[32] = sum over
 * the block's k of (w - zero); zeros int8 [OC/32][G][32]; scales fp32 [OC/32][G][32].
 * Requirements: OC % 32 == 0, IC % G == 0, group a multiple of 4 that is <= 128 or a
 * multiple of 128. */
typedef enum cpumoe_int4_format {
  CPUMOE_INT4_AWQ = 0,
  CPUMOE_INT4_GPTQ = 1,
} cpumoe_int4_format;
cpumoe_status cpumoe_pack_int4(cpumoe_int4_format format, const int32_t *qweight,
                               const int32_t *qzeros, const void *scales, cpumoe_dtype scales_dtype,
                               int64_t experts, int64_t out_features, int64_t in_features,
                               int64_t groups, uint8_t *packed, int8_t *packed_zeros,
                               float *packed_scales, const cpumoe_runner *runner);
/* k per packed INT4 block for a group size: min(group, 128); 0 if the group size is not
 * supported (see above). A packed block is 16 * bk + 128 bytes. */
int64_t cpumoe_int4_block_k(int64_t group);

/* MXFP4 weights (SGLang's convert_weight_packed on uint8): per expert, [rows][col_bytes]
 * bytes, each holding two e2m1 codes (low nibble: the even k) -> the same number of bytes,
 * blocks of 32 rows, each [col_bytes][32]: byte j of block column c has in its low nibble
 * row j/2, k = 2c + j%2, and in its high nibble row 16 + j/2, same k (docs/FORMATS.md).
 * Requirements: rows % 32 == 0, col_bytes % 16 == 0 (input features a multiple of 32). */
cpumoe_status cpumoe_pack_mxfp4(const uint8_t *src, uint8_t *dst, int64_t experts, int64_t rows,
                                int64_t col_bytes, const cpumoe_runner *runner);
/* MXFP4 e8m0 scales (SGLang's convert_scale_packed): per expert [rows][groups] ->
 * [rows/32][groups][32], i.e. dst[b][g][n] = src[32b + n][g]. Requirement: rows % 32 == 0. */
cpumoe_status cpumoe_pack_e8m0_scales(const uint8_t *src, uint8_t *dst, int64_t experts,
                                      int64_t rows, int64_t groups, const cpumoe_runner *runner);

/* ---- ISA ------------------------------------------------------------------------*/
cpumoe_isa cpumoe_active_isa(void);          /* tier the ops use */
cpumoe_isa cpumoe_best_supported_isa(void);  /* best tier this CPU and build can run */
const char *cpumoe_isa_name(cpumoe_isa isa); /* "scalar", "avx2", ... (cpumoe/tiers.h) */
/* Parses a tier name; returns CPUMOE_ISA_COUNT for an unknown name. */
cpumoe_isa cpumoe_isa_from_name(const char *name);
/* Caps the active tier at `isa`: the active tier becomes `isa` if this CPU supports it,
 * else its nearest supported ancestor (cpumoe/tiers.h). */
cpumoe_status cpumoe_set_isa_cap(cpumoe_isa isa);
/* 1 when this CPU runs the tier's instructions itself (cpuid + xgetbv), else 0. A build
 * of the core made for testing with CPUMOE_EMULATE_TIERS (tools/build_c_tests.py) runs the
 * vector tiers' kernel sources through a portable intrinsics layer, so there every built
 * tier is supported and this tells which of them are emulated. */
int cpumoe_isa_native(cpumoe_isa isa);
/* The numerics class of a tier's results, e.g. "fp32-chain": tiers of one class give
 * bit-identical outputs; across classes outputs agree within the tolerance that
 * docs/NUMERICS.md states. NULL for an unknown tier. */
const char *cpumoe_isa_numerics(cpumoe_isa isa);
/* Why the active tier was chosen, e.g. "avx512 (best supported)". */
const char *cpumoe_isa_reason(void);
/* Space-separated CPU features found by cpuid/xgetbv, e.g. "avx2 fma f16c avx512f ..." */
const char *cpumoe_cpu_features(void);

/* ---- probes (for the benchmark's roofline) ----------------------------------------*/
/* Reads `bytes` from `buffer` `passes` times on every worker (buffer split evenly
 * across workers); returns the checksum so the reads cannot be elided (0 if buffer is NULL). */
double cpumoe_probe_read(const void *buffer, size_t bytes, int64_t passes,
                         const cpumoe_runner *runner);
/* Runs `iterations` of a register-only fp32 FMA loop on each worker, using the active
 * tier's widest FMA; returns the number of flops done in total (2 per lane per FMA). */
double cpumoe_probe_fma(int64_t iterations, const cpumoe_runner *runner);

/* Runs `iterations` of the active tier's u8*s8 multiply-add peak loop (VNNI vpdpbusd on
 * avx512) on each worker; returns the operations done in total (2 per multiply-add). */
double cpumoe_probe_int8(int64_t iterations, const cpumoe_runner *runner);

/* Runs `iterations` of the loop the active tier's INT4 kernels run (the u8*s8 loop where they
 * run the same instruction; vpmaddubsw of nibbles with one widening vpmaddwd per 8 on avx2)
 * on each worker; returns the operations done in total (2 per multiply-add). */
double cpumoe_probe_int4(int64_t iterations, const cpumoe_runner *runner);

/* Runs `iterations` of the loop the active tier's bf16 GEMMs peak at (AMX tdpbf16ps on amx;
 * the fp32 FMA loop on tiers that widen bf16) on each worker; returns the operations done in
 * total (2 per multiply-add). */
double cpumoe_probe_bf16(int64_t iterations, const cpumoe_runner *runner);

const char *cpumoe_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* CPUMOE_CPUMOE_H */
