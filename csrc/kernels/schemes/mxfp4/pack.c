/*
 * MXFP4 packers, byte for byte as SGLang's convert_weight_packed (uint8 weights) and
 * convert_scale_packed (docs/FORMATS.md; common/mxfp4.h):
 *
 *   codes  W[rows][col_bytes] of one expert (byte c of row n: k = 2c in the low nibble,
 *          2c + 1 in the high one) -> blocks of 32 rows, block b stored [col_bytes][32]:
 *            low nibble of dst[c * 32 + j]  = nibble j % 2 of W[32b + j / 2][c]
 *            high nibble of dst[c * 32 + j] = nibble j % 2 of W[32b + 16 + j / 2][c]
 *   scales S[rows][groups] -> [rows / 32][groups][32]: dst[b][g][n] = S[32b + n][g].
 *
 * Runs once at load; ISA-neutral C.
 */
#include "common/error.h"
#include "common/mxfp4.h"
#include "common/parallel.h"
#include "common/sizes.h"

typedef struct pack_job {
  const uint8_t *src;
  uint8_t *dst;
  int64_t cols; /* bytes per row: col_bytes (codes) or groups (scales) */
  int64_t blocks_per_expert;
} pack_job;

static void pack_code_block(void *ctx, int64_t task) {
  const pack_job *job = (const pack_job *)ctx;
  const size_t offset = (size_t)task * 32 * (size_t)job->cols; /* blocks are consecutive */
  const uint8_t *w = job->src + offset;
  uint8_t *out = job->dst + offset;
  for (int64_t c = 0; c < job->cols; c++)
    for (int j = 0; j < 32; j++) {
      const int shift = 4 * (j & 1);
      const unsigned low = (w[(j / 2) * job->cols + c] >> shift) & 15u;
      const unsigned high = (w[(16 + j / 2) * job->cols + c] >> shift) & 15u;
      out[c * 32 + j] = (uint8_t)(low | high << 4);
    }
}

static void pack_scale_block(void *ctx, int64_t task) {
  const pack_job *job = (const pack_job *)ctx;
  const size_t offset = (size_t)task * 32 * (size_t)job->cols;
  const uint8_t *s = job->src + offset;
  uint8_t *out = job->dst + offset;
  for (int64_t g = 0; g < job->cols; g++)
    for (int n = 0; n < 32; n++) out[g * 32 + n] = s[n * job->cols + g];
}

/* the checks both packers share; `what` names the tensor in messages */
static cpumoe_status check_sizes(const uint8_t *src, const uint8_t *dst, int64_t experts,
                                 int64_t rows, int64_t cols, const char *what) {
  if (experts < 0 || rows <= 0 || cols <= 0)
    return cm_fail(CPUMOE_EINVAL, "%s: sizes must be positive (experts=%lld rows=%lld cols=%lld)",
                   what, (long long)experts, (long long)rows, (long long)cols);
  if (rows % 32 != 0)
    return cm_fail(CPUMOE_EINVAL,
                   "invalid weight out features %lld: MXFP4 %s need a multiple of 32 rows",
                   (long long)rows, what);
  if (cm_size_product(experts, rows, cols) < 0)
    return cm_fail(CPUMOE_EINVAL,
                   "%s: experts=%lld x rows=%lld x cols=%lld are more bytes than a tensor can "
                   "hold",
                   what, (long long)experts, (long long)rows, (long long)cols);
  if (!src || !dst) return cm_fail(CPUMOE_EINVAL, "%s: NULL source or destination", what);
  return CPUMOE_OK;
}

cpumoe_status cpumoe_pack_mxfp4(const uint8_t *src, uint8_t *dst, int64_t experts, int64_t rows,
                                int64_t col_bytes, const cpumoe_runner *runner) {
  cpumoe_status st = check_sizes(src, dst, experts, rows, col_bytes, "codes");
  if (st != CPUMOE_OK) return st;
  if (col_bytes % (CM_MXFP4_GROUP / 2) != 0)
    return cm_fail(CPUMOE_EINVAL,
                   "invalid weight input features %lld (%lld bytes): must be a multiple of 32",
                   (long long)(2 * col_bytes), (long long)col_bytes);
  pack_job job = {src, dst, col_bytes, rows / 32};
  cm_parallel_tasks(runner, experts * job.blocks_per_expert, pack_code_block, &job);
  return CPUMOE_OK;
}

cpumoe_status cpumoe_pack_e8m0_scales(const uint8_t *src, uint8_t *dst, int64_t experts,
                                      int64_t rows, int64_t groups, const cpumoe_runner *runner) {
  cpumoe_status st = check_sizes(src, dst, experts, rows, groups, "scales");
  if (st != CPUMOE_OK) return st;
  pack_job job = {src, dst, groups, rows / 32};
  cm_parallel_tasks(runner, experts * job.blocks_per_expert, pack_scale_block, &job);
  return CPUMOE_OK;
}
