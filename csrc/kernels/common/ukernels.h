/*
 * The contract between the ISA-agnostic MoE pipeline (moe/) and the per-tier
 * micro-kernels. The pipeline only ever calls through a `cm_ukernels` table,
 * chosen once at load (dispatch/config.c); it never tests the ISA itself.
 *
 * Adding a tier: write its kernel files (suffix -<tier>.c, compiled with that
 * tier's flags only), declare its functions below, add a table row in
 * dispatch/config.c. Adding a scheme: new micro-kernel kinds here plus a packer.
 *
 * Shared operand layouts
 *   A panel  fp32 [k][a_stride]: mr <= a_stride token rows interleaved, so that the
 *            micro-kernel reads one contiguous strip of rows per k (the pipeline
 *            stores panels densely: a_stride = mr).
 *   B tile   VNNI-2 16-bit [k/2][32][2]: one 32-column block of a packed weight
 *            (docs/FORMATS.md), i.e. 32 output channels over the whole reduction.
 *   C tile   fp32 [mr][32], row stride 32.
 * Every C element is one sequential fp32 FMA chain over k = 0..k-1 starting
 * from +0: each tier computes exactly the same bits.
 */
#ifndef CPUMOE_COMMON_UKERNELS_H
#define CPUMOE_COMMON_UKERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "cpumoe/cpumoe.h"

#define CM_NR 32 /* output channels per packed weight block and per C tile */
#define CM_MR_MAX 16

/* C[mr][32] = A_panel[k][a_stride] (rows 0..mr-1) x B_tile[k/2][32][2] */
typedef void (*cm_gemm_f32acc_fn)(size_t mr, size_t k, const float *a_panel, size_t a_stride,
                                  const uint16_t *b_tile, float *c);

/* out[i] = silu(gate[i]) * up[i] */
typedef void (*cm_silu_mul_fn)(size_t n, const float *gate, const float *up, float *out);
/* out[i] = swiglu_clamp(gate[i], up[i]) (see common/numeric.h) */
typedef void (*cm_swiglu_fn)(size_t n, const float *gate, const float *up, float alpha, float limit,
                             float *out);
/* dst[i] = fp32 value of 16-bit src[i] (bf16 or fp16) */
typedef void (*cm_widen_fn)(size_t n, const uint16_t *src, float *dst);
/* dst[i] = 16-bit src[i], round to nearest even */
typedef void (*cm_narrow_fn)(size_t n, const float *src, uint16_t *dst);
/* v[i] = round_to_16bit(v[i]) as fp32, in place */
typedef void (*cm_round_fn)(size_t n, float *v);
/* y[i] += a * x[i] (mul then add, two roundings) */
typedef void (*cm_axpy_fn)(size_t n, float a, const float *x, float *y);

typedef struct cm_ukernels {
  cpumoe_isa isa;
  size_t mr;                   /* rows per A panel for the gemm micro-kernels (<= CM_MR_MAX) */
  cm_gemm_f32acc_fn gemm_bf16; /* B tile of bf16 weights */
  cm_gemm_f32acc_fn gemm_f16;  /* B tile of fp16 weights */
  cm_silu_mul_fn silu_mul;
  cm_swiglu_fn swiglu;
  cm_widen_fn widen_bf16, widen_f16;
  cm_narrow_fn narrow_bf16, narrow_f16;
  cm_round_fn round_bf16, round_f16;
  cm_axpy_fn axpy;
  /* roofline probes: stream `bytes` once; run `iterations` of the widest FMA loop */
  double (*probe_read)(const void *buffer, size_t bytes);
  double (*probe_fma)(int64_t iterations);
} cm_ukernels;

/* The table for the active tier (dispatch/config.c). */
const cm_ukernels *cm_active_ukernels(void);

/* Per-tier symbols. Elementwise kernels come from one generic source
 * (elementwise/elementwise-impl.h) compiled once per tier. */
#define CM_DECLARE_ELEMENTWISE(tier)                                                              \
  void cm_silu_mul__##tier(size_t, const float *, const float *, float *);                        \
  void cm_swiglu__##tier(size_t, const float *, const float *, float, float, float *);            \
  void cm_widen_bf16__##tier(size_t, const uint16_t *, float *);                                  \
  void cm_widen_f16__##tier(size_t, const uint16_t *, float *);                                   \
  void cm_narrow_bf16__##tier(size_t, const float *, uint16_t *);                                 \
  void cm_narrow_f16__##tier(size_t, const float *, uint16_t *);                                  \
  void cm_round_bf16__##tier(size_t, float *);                                                    \
  void cm_round_f16__##tier(size_t, float *);                                                     \
  void cm_axpy__##tier(size_t, float, const float *, float *);                                    \
  void cm_bf16_gemm_f32acc_mrx32__##tier(size_t, size_t, const float *, size_t, const uint16_t *, \
                                         float *);                                                \
  void cm_f16_gemm_f32acc_mrx32__##tier(size_t, size_t, const float *, size_t, const uint16_t *,  \
                                        float *);                                                 \
  double cm_probe_read_chunk__##tier(const void *, size_t);                                       \
  double cm_probe_fma_loop__##tier(int64_t);

CM_DECLARE_ELEMENTWISE(scalar)
CM_DECLARE_ELEMENTWISE(avx2)
CM_DECLARE_ELEMENTWISE(avx512)

#endif /* CPUMOE_COMMON_UKERNELS_H */
