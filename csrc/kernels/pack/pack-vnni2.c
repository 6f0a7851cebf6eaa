/*
 * VNNI-2 packer for 16-bit weights (bf16, fp16) and 8-bit fp8 weights: the same element
 * order, as SGLang's convert_weight_packed:
 *
 *   W[rows][cols] of one expert -> blocks of 32 rows (the last one 16 when
 *   rows % 32 == 16); block b holds rows [32b, 32b + nsz) stored as
 *   [cols/2][nsz][2]:  dst[(k/2)*2*nsz + 2*n + (k%2)] = W[32b + n][k].
 *
 * So one 32-row block is exactly the B tile the GEMM micro-kernels read.
 * Runs once at load; ISA-neutral C.
 */
#include <string.h>

#include "common/error.h"
#include "common/parallel.h"
#include "common/sizes.h"

typedef struct pack_job {
  const char *src;
  char *dst;
  size_t elem; /* bytes per element: 2 or 1 */
  int64_t rows, cols, blocks_per_expert;
} pack_job;

static void pack_block(void *ctx, int64_t task) {
  const pack_job *job = (const pack_job *)ctx;
  const int64_t e = task / job->blocks_per_expert, b = task % job->blocks_per_expert;
  const int64_t row0 = 32 * b;
  const int64_t nsz = job->rows - row0 < 32 ? job->rows - row0 : 32;
  const size_t offset = (size_t)((e * job->rows + row0) * job->cols) * job->elem;
  const char *w = job->src + offset;
  char *out = job->dst + offset;
  for (int64_t n = 0; n < nsz; n++)
    for (int64_t k = 0; k < job->cols; k++)
      memcpy(out + (size_t)((k / 2) * 2 * nsz + 2 * n + (k & 1)) * job->elem,
             w + (size_t)(n * job->cols + k) * job->elem, job->elem);
}

static cpumoe_status pack_vnni2(const void *src, void *dst, size_t elem, int64_t experts,
                                int64_t rows, int64_t cols, const cpumoe_runner *runner) {
  if (experts < 0 || rows <= 0 || cols <= 0)
    return cm_fail(CPUMOE_EINVAL, "pack: sizes must be positive (experts=%lld rows=%lld cols=%lld)",
                   (long long)experts, (long long)rows, (long long)cols);
  if (rows % 16 != 0)
    return cm_fail(CPUMOE_EINVAL, "invalid weight out features %lld: must be a multiple of 16",
                   (long long)rows);
  if (cols % 32 != 0)
    return cm_fail(CPUMOE_EINVAL, "invalid weight input features %lld: must be a multiple of 32",
                   (long long)cols);
  if (cm_size_product(cm_size_product(experts, rows, cols), (int64_t)elem, 1) < 0)
    return cm_fail(CPUMOE_EINVAL,
                   "pack: experts=%lld x rows=%lld x cols=%lld elements are more bytes than a "
                   "tensor can hold",
                   (long long)experts, (long long)rows, (long long)cols);
  if (!src || !dst) return cm_fail(CPUMOE_EINVAL, "pack: NULL source or destination");
  pack_job job = {(const char *)src, (char *)dst, elem, rows, cols, (rows + 31) / 32};
  cm_parallel_tasks(runner, experts * job.blocks_per_expert, pack_block, &job);
  return CPUMOE_OK;
}

cpumoe_status cpumoe_pack_vnni2_16bit(const uint16_t *src, uint16_t *dst, int64_t experts,
                                      int64_t rows, int64_t cols, const cpumoe_runner *runner) {
  return pack_vnni2(src, dst, 2, experts, rows, cols, runner);
}

cpumoe_status cpumoe_pack_vnni2_8bit(const uint8_t *src, uint8_t *dst, int64_t experts,
                                     int64_t rows, int64_t cols, const cpumoe_runner *runner) {
  return pack_vnni2(src, dst, 1, experts, rows, cols, runner);
}
