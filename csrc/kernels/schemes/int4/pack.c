/*
 * INT4 W4A8 packer for AWQ and GPTQ checkpoints (SGLang's convert_weight_packed_scale_zp):
 * unpacks the checkpoint's int32 words into nibbles and zero points, then writes the
 * blocked layout of common/int4.h with its per-block compensation, plus the zero points
 * (int8) and scales (fp32) regrouped per 32 output columns. Formats: cpumoe.h and
 * docs/FORMATS.md. One task per (expert, 32 output columns); ISA-neutral C, runs at load.
 */
#include <string.h>

#include "common/error.h"
#include "common/int4.h"
#include "common/numeric.h"
#include "common/parallel.h"
#include "common/sizes.h"

/* AWQ stores the 8 columns of a word in nibble order 0,2,4,6,1,3,5,7: column j is in
 * nibble awq_nibble_of_column[j]. */
static const int awq_nibble_of_column[8] = {0, 4, 1, 5, 2, 6, 3, 7};

typedef struct int4_pack_job {
  cpumoe_int4_format format;
  const int32_t *qweight, *qzeros;
  const void *scales;
  cpumoe_dtype scales_dtype;
  int64_t oc, ic, groups, group, bk;
  uint8_t *packed;
  int8_t *zeros;
  float *out_scales;
} int4_pack_job;

static int nibble(int32_t word, int index) {
  return (int)(((uint32_t)word >> (4 * index)) & 15u);
}

/* the unsigned 4-bit weight of input feature k, output column n of expert e */
static int weight_nibble(const int4_pack_job *j, int64_t e, int64_t k, int64_t n) {
  if (j->format == CPUMOE_INT4_AWQ) {
    const int32_t *q = j->qweight + e * j->ic * (j->oc / 8);
    return nibble(q[k * (j->oc / 8) + n / 8], awq_nibble_of_column[n % 8]);
  }
  const int32_t *q = j->qweight + e * (j->ic / 8) * j->oc;
  return nibble(q[(k / 8) * j->oc + n], (int)(k % 8));
}

static int zero_point(const int4_pack_job *j, int64_t e, int64_t g, int64_t n) {
  const int32_t word = j->qzeros[(e * j->groups + g) * (j->oc / 8) + n / 8];
  if (j->format == CPUMOE_INT4_AWQ) return nibble(word, awq_nibble_of_column[n % 8]);
  return nibble(word, (int)(n % 8)) + 1; /* GPTQ v1 stores zero - 1 */
}

static float scale_value(const int4_pack_job *j, int64_t e, int64_t g, int64_t n) {
  const int64_t i = (e * j->groups + g) * j->oc + n;
  switch (j->scales_dtype) {
    case CPUMOE_DTYPE_BF16: return cm_bf16_to_f32(((const uint16_t *)j->scales)[i]);
    case CPUMOE_DTYPE_F16: return cm_f16_to_f32(((const uint16_t *)j->scales)[i]);
    default: return ((const float *)j->scales)[i];
  }
}

static void pack_columns(void *ctx, int64_t task) {
  const int4_pack_job *j = (const int4_pack_job *)ctx;
  const int64_t tiles = j->oc / 32, e = task / tiles, nc = task % tiles;
  const int64_t k_blocks = j->ic / j->bk, n0 = 32 * nc;
  int8_t *zeros = j->zeros + (e * tiles + nc) * j->groups * 32;
  float *scales = j->out_scales + (e * tiles + nc) * j->groups * 32;
  for (int64_t g = 0; g < j->groups; g++)
    for (int n = 0; n < 32; n++) {
      zeros[g * 32 + n] = (int8_t)zero_point(j, e, g, n0 + n);
      scales[g * 32 + n] = scale_value(j, e, g, n0 + n);
    }
  uint8_t *block =
      j->packed + (e * tiles + nc) * k_blocks * (int64_t)cm_int4_block_bytes((size_t)j->bk);
  for (int64_t kb = 0; kb < k_blocks; kb++, block += cm_int4_block_bytes((size_t)j->bk)) {
    int32_t comp[32] = {0};
    for (int64_t k = 0; k < j->bk; k++) {
      const int64_t kg = kb * j->bk + k;
      const int8_t *zero = zeros + (kg / j->group) * 32;
      for (int l = 0; l < 16; l++) {
        const int lo = cm_int4_lane_column(l), hi = lo + 8;
        const int w_lo = weight_nibble(j, e, kg, n0 + lo), w_hi = weight_nibble(j, e, kg, n0 + hi);
        block[(k / 4) * 64 + l * 4 + (k & 3)] = (uint8_t)(w_lo | (w_hi << 4));
        comp[lo] += w_lo - zero[lo];
        comp[hi] += w_hi - zero[hi];
      }
    }
    memcpy(block + 16 * j->bk, comp, sizeof comp);
  }
}

int64_t cpumoe_int4_block_k(int64_t group) {
  return cm_int4_block_k_of_group(group);
}

cpumoe_status cpumoe_pack_int4(cpumoe_int4_format format, const int32_t *qweight,
                               const int32_t *qzeros, const void *scales, cpumoe_dtype scales_dtype,
                               int64_t experts, int64_t out_features, int64_t in_features,
                               int64_t groups, uint8_t *packed, int8_t *packed_zeros,
                               float *packed_scales, const cpumoe_runner *runner) {
  if (format != CPUMOE_INT4_AWQ && format != CPUMOE_INT4_GPTQ)
    return cm_fail(CPUMOE_EINVAL, "int4 pack: format must be 0 (AWQ) or 1 (GPTQ), got %d",
                   (int)format);
  if (experts < 0 || out_features <= 0 || in_features <= 0 || groups <= 0)
    return cm_fail(CPUMOE_EINVAL,
                   "int4 pack: sizes must be positive (experts=%lld out=%lld in=%lld groups=%lld)",
                   (long long)experts, (long long)out_features, (long long)in_features,
                   (long long)groups);
  if (out_features % 32 != 0)
    return cm_fail(CPUMOE_EINVAL,
                   "int4 pack: out features %lld must be a multiple of 32 (one packed block)",
                   (long long)out_features);
  if (in_features % groups != 0)
    return cm_fail(CPUMOE_EINVAL,
                   "int4 pack: in features %lld are not a whole number of %lld groups",
                   (long long)in_features, (long long)groups);
  const int64_t group = in_features / groups, bk = cm_int4_block_k_of_group(group);
  if (bk == 0)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "int4 pack: group size %lld (in features %lld / %lld groups) is not supported: "
                   "it must be a multiple of 4 that is at most 128, or a multiple of 128",
                   (long long)group, (long long)in_features, (long long)groups);
  if (in_features % 8 != 0 && format == CPUMOE_INT4_GPTQ)
    return cm_fail(CPUMOE_EINVAL, "int4 pack: GPTQ in features %lld must be a multiple of 8",
                   (long long)in_features);
  /* no input or output takes more than 2 bytes a weight (packed blocks: 1.5 at group 4) */
  if (cm_size_product(cm_size_product(experts, out_features, in_features), 2, 1) < 0)
    return cm_fail(CPUMOE_EINVAL,
                   "int4 pack: experts=%lld x out=%lld x in=%lld weights are more bytes than a "
                   "tensor can hold",
                   (long long)experts, (long long)out_features, (long long)in_features);
  if (scales_dtype != CPUMOE_DTYPE_BF16 && scales_dtype != CPUMOE_DTYPE_F16 &&
      scales_dtype != CPUMOE_DTYPE_F32)
    return cm_fail(CPUMOE_EINVAL, "int4 pack: scales must be bfloat16, float16 or float32");
  if (experts > 0 && (!qweight || !qzeros || !scales || !packed || !packed_zeros || !packed_scales))
    return cm_fail(CPUMOE_EINVAL, "int4 pack: NULL input or output");
  int4_pack_job job = {format, qweight, qzeros, scales, scales_dtype, out_features, in_features,
                       groups, group,   bk,     packed, packed_zeros, packed_scales};
  cm_parallel_tasks(runner, experts * (out_features / 32), pack_columns, &job);
  return CPUMOE_OK;
}
