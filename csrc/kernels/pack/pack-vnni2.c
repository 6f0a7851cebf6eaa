/*
 * VNNI-2 packer for 16-bit weights (bf16, fp16; fp8 reuses the same byte order
 * with 8-bit elements later). Layout, as SGLang's convert_weight_packed:
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

typedef struct pack_job {
  const uint16_t *src;
  uint16_t *dst;
  int64_t rows, cols, blocks_per_expert;
} pack_job;

static void pack_block(void *ctx, int64_t task) {
  const pack_job *job = (const pack_job *)ctx;
  const int64_t e = task / job->blocks_per_expert, b = task % job->blocks_per_expert;
  const int64_t row0 = 32 * b;
  const int64_t nsz = job->rows - row0 < 32 ? job->rows - row0 : 32;
  const uint16_t *w = job->src + (e * job->rows + row0) * job->cols;
  uint16_t *out = job->dst + (e * job->rows + row0) * job->cols;
  for (int64_t n = 0; n < nsz; n++)
    for (int64_t k = 0; k < job->cols; k++)
      out[(k / 2) * 2 * nsz + 2 * n + (k & 1)] = w[n * job->cols + k];
}

cpumoe_status cpumoe_pack_vnni2_16bit(const uint16_t *src, uint16_t *dst, int64_t experts,
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
  if (!src || !dst) return cm_fail(CPUMOE_EINVAL, "pack: NULL source or destination");
  pack_job job = {src, dst, rows, cols, (rows + 31) / 32};
  cm_parallel_tasks(runner, experts * job.blocks_per_expert, pack_block, &job);
  return CPUMOE_OK;
}
