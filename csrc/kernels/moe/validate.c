/*
 * Checks of a fused MoE problem before any work: the sizes, the dtypes, the scheme's own
 * arguments (its traits' validate), that no tensor's byte count overflows, and the topk
 * ids. Each failure returns its status with a message naming the argument (cm_fail).
 */
#include "common/error.h"
#include "common/sizes.h"
#include "moe/pipeline.h"

/* The byte counts of the caller's tensors; a product beyond PTRDIFF_MAX describes no tensor
 * that can exist. The scheme bounds the bytes of one w1 row; w2, biases, per-channel scales
 * and zero points take no more than w1 does (K, N >= 32); scales that can are counted by
 * the scheme's scale_bytes. */
static cpumoe_status check_tensor_bytes(const cpumoe_moe_problem *p,
                                        const cm_scheme_traits *traits) {
  const struct {
    const char *name;
    int64_t bytes;
  } tensors[] = {
      {"x and out [M, K]", cm_size_product(p->M, p->K, 2)},
      {"out [M, K] float32", p->out_f32 ? cm_size_product(p->M, p->K, 4) : 0},
      {"topk_ids and topk_weights [M, topk]", cm_size_product(p->M, p->topk, 8)},
      {"w1 [E, 2N, K]", cm_size_product(p->E, 2 * p->N, traits->w1_row_bytes(p))},
      {"w1_scale", traits->scale_bytes ? traits->scale_bytes(p, 1) : 0},
      {"w2_scale", traits->scale_bytes ? traits->scale_bytes(p, 2) : 0},
  };
  for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++)
    if (tensors[i].bytes < 0)
      return cm_fail(CPUMOE_EINVAL,
                     "%s: sizes M=%lld K=%lld N=%lld E=%lld topk=%lld give more bytes than a "
                     "tensor can hold",
                     tensors[i].name, (long long)p->M, (long long)p->K, (long long)p->N,
                     (long long)p->E, (long long)p->topk);
  return CPUMOE_OK;
}

static int overlaps(const void *a, size_t a_bytes, const void *b, size_t b_bytes) {
  const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
  return a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

/* The clamped silu's limit is a clamp bound: a negative one would make the up interval empty
 * and a NaN one would clamp nothing, neither of which DeepSeek-V4 means (SGLang passes a
 * positive float). The clamped swiglu's limit stays unchecked, as it always was. */
cpumoe_status cm_validate_activation(cpumoe_activation activation, float limit) {
  switch (activation) {
    case CPUMOE_ACT_SILU_MUL:
    case CPUMOE_ACT_SWIGLU_CLAMP:
    case CPUMOE_ACT_GELU_MUL: return CPUMOE_OK;
    case CPUMOE_ACT_SILU_CLAMP:
      if (!(limit >= 0.0f))
        return cm_fail(CPUMOE_EINVAL,
                       "limit must be >= 0 (not NaN) for the clamped silu (limit without alpha), "
                       "got %g",
                       (double)limit);
      return CPUMOE_OK;
  }
  return cm_fail(CPUMOE_EINVAL, "unknown activation %d", (int)activation);
}

cpumoe_status cm_validate_problem(const cpumoe_moe_problem *p) {
  if (!p) return cm_fail(CPUMOE_EINVAL, "problem is NULL");
  if (p->M < 0) return cm_fail(CPUMOE_EINVAL, "M must be >= 0, got %lld", (long long)p->M);
  if (p->K <= 0 || p->N <= 0 || p->E <= 0 || p->topk <= 0)
    return cm_fail(CPUMOE_EINVAL,
                   "K, N, E and topk must be positive (K=%lld N=%lld E=%lld topk=%lld)",
                   (long long)p->K, (long long)p->N, (long long)p->E, (long long)p->topk);
  const cm_scheme_traits *traits = cm_scheme_traits_of(p->scheme);
  if (!traits)
    return cm_fail(CPUMOE_EUNSUPPORTED, "moe_comp_method %d is not implemented in this build",
                   (int)p->scheme);
  cpumoe_status st = traits->validate(p);
  if (st != CPUMOE_OK) return st;
  if (p->act_dtype != CPUMOE_DTYPE_BF16 && p->act_dtype != CPUMOE_DTYPE_F16)
    return cm_fail(CPUMOE_EINVAL, "activations must be bf16 or fp16");
  if (p->K % 32 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "hidden size K=%lld must be a multiple of 32 (pad the weights with zeros)",
                   (long long)p->K);
  if (p->N % 32 != 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "intermediate size N=%lld must be a multiple of 32 (pad w1 rows and w2 "
                   "columns with zeros)",
                   (long long)p->N);
  if (p->K > CM_MAX_DIM || p->N > CM_MAX_DIM || p->E > INT32_MAX || p->topk > CM_MAX_TOPK)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "sizes K=%lld N=%lld E=%lld topk=%lld exceed the supported K, N <= 2^30, "
                   "E < 2^31, topk <= %d",
                   (long long)p->K, (long long)p->N, (long long)p->E, (long long)p->topk,
                   CM_MAX_TOPK);
  st = check_tensor_bytes(p, traits);
  if (st != CPUMOE_OK) return st;
  st = cm_validate_activation(p->activation, p->limit);
  if (st != CPUMOE_OK) return st;
  if ((p->w1_bias == NULL) != (p->w2_bias == NULL))
    return cm_fail(CPUMOE_EINVAL, "w1_bias and w2_bias must be given together");
  if (p->topk_ids && p->topk_ids_dtype != CPUMOE_DTYPE_I32 && p->topk_ids_dtype != CPUMOE_DTYPE_I64)
    return cm_fail(CPUMOE_EINVAL, "topk_ids must be int32 or int64");
  if (p->topk_weights && p->topk_weights_dtype != CPUMOE_DTYPE_F32 &&
      p->topk_weights_dtype != CPUMOE_DTYPE_F64 && p->topk_weights_dtype != CPUMOE_DTYPE_BF16 &&
      p->topk_weights_dtype != CPUMOE_DTYPE_F16)
    return cm_fail(CPUMOE_EINVAL, "topk_weights must be float32, float64, bfloat16 or float16");
  if (p->M > 0 && (!p->x || !p->w1 || !p->w2 || !p->out))
    return cm_fail(CPUMOE_EINVAL, "x, w1, w2 and out must not be NULL");
  if (p->out_f32 != 0 && p->out_f32 != 1)
    return cm_fail(CPUMOE_EINVAL, "out_f32 must be 0 or 1, got %d", p->out_f32);
  /* a 16-bit out may alias x row for row; an fp32 row spans two rows of x, which later
   * chunks of tokens would still read */
  if (p->out_f32 && p->M > 0) {
    const size_t in_bytes = (size_t)(p->M * p->K) * 2, out_bytes = in_bytes * 2;
    if (overlaps(p->out, out_bytes, p->x, in_bytes) ||
        (p->residual && overlaps(p->out, out_bytes, p->residual, in_bytes)))
      return cm_fail(CPUMOE_EINVAL, "a float32 out must not overlap x or residual");
  }
  return CPUMOE_OK;
}

cpumoe_status cm_validate_ids(const cpumoe_moe_problem *p) {
  const int64_t slots = p->M * p->topk;
  for (int64_t s = 0; s < slots; s++) {
    const int64_t e = cm_slot_expert(p, s);
    if (e != -1 && (e < 0 || e >= p->E))
      return cm_fail(CPUMOE_EINVAL,
                     "topk_ids[%lld, %lld] = %lld is outside [0, %lld) (only -1, meaning "
                     "'skip this slot', may lie outside)",
                     (long long)(s / p->topk), (long long)(s % p->topk), (long long)e,
                     (long long)p->E);
  }
  return CPUMOE_OK;
}
