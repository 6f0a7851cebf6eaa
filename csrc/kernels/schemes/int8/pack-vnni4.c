/*
 * VNNI-4 packer for int8 weights with compensation (SGLang's convert_weight_packed for
 * int8). Layout of one expert's W[rows][cols] -> [rows][cols + 4] bytes:
 *
 *   blocks of 32 rows; block b is 32 * (cols + 4) bytes at offset 32 b (cols + 4):
 *     bytes [0, 32 cols):    dst[(k/4)*128 + 4*n + (k%4)] = W[32b + n][k]
 *     bytes [32 cols, +128): int32 comp[32], comp[n] = 128 * sum_k W[32b + n][k]
 *
 * The compensation turns the u8 dot product (activations stored as q + 128) back into
 * the signed one: sum (q+128) w - comp = sum q w. Runs once at load; ISA-neutral C.
 */
#include <string.h>

#include "common/error.h"
#include "common/parallel.h"
#include "common/sizes.h"
#include "common/ukernels.h"

typedef struct pack_job {
  const int8_t *src;
  int8_t *dst;
  int64_t rows, cols, blocks_per_expert;
} pack_job;

static void pack_block(void *ctx, int64_t task) {
  const pack_job *job = (const pack_job *)ctx;
  const int64_t e = task / job->blocks_per_expert, b = task % job->blocks_per_expert;
  const int64_t cols = job->cols;
  const int8_t *w = job->src + (e * job->rows + 32 * b) * cols;
  int8_t *out = job->dst + (e * job->rows + 32 * b) * (cols + 4);
  int32_t comp[32];
  for (int64_t n = 0; n < 32; n++) {
    int32_t sum = 0;
    for (int64_t k = 0; k < cols; k++) {
      out[(k / 4) * 128 + 4 * n + (k & 3)] = w[n * cols + k];
      sum += w[n * cols + k];
    }
    comp[n] = 128 * sum;
  }
  memcpy(out + 32 * cols, comp, sizeof comp);
}

cpumoe_status cpumoe_pack_vnni4_int8(const int8_t *src, int8_t *dst, int64_t experts, int64_t rows,
                                     int64_t cols, const cpumoe_runner *runner) {
  if (experts < 0 || rows <= 0 || cols <= 0)
    return cm_fail(CPUMOE_EINVAL, "pack: sizes must be positive (experts=%lld rows=%lld cols=%lld)",
                   (long long)experts, (long long)rows, (long long)cols);
  if (rows % 32 != 0)
    return cm_fail(CPUMOE_EINVAL,
                   "invalid weight out features %lld: int8 weights need a multiple of 32",
                   (long long)rows);
  if (cols % 32 != 0)
    return cm_fail(CPUMOE_EINVAL, "invalid weight input features %lld: must be a multiple of 32",
                   (long long)cols);
  if (cols > CM_INT8_MAX_REDUCTION)
    return cm_fail(CPUMOE_EUNSUPPORTED,
                   "int8 weights with %lld input features: the int32 compensation and "
                   "accumulation are exact only up to %d",
                   (long long)cols, CM_INT8_MAX_REDUCTION);
  if (cm_size_product(experts, rows, cols + 4) < 0)
    return cm_fail(CPUMOE_EINVAL,
                   "pack: experts=%lld x rows=%lld x (cols=%lld + 4) bytes are more than a "
                   "tensor can hold",
                   (long long)experts, (long long)rows, (long long)cols);
  if (!src || !dst) return cm_fail(CPUMOE_EINVAL, "pack: NULL source or destination");
  pack_job job = {src, dst, rows, cols, rows / 32};
  cm_parallel_tasks(runner, experts * job.blocks_per_expert, pack_block, &job);
  return CPUMOE_OK;
}
