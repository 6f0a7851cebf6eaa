/*
 * The A panel formats (cm_panel_format) and their packers: how the rows of a panel (x rows
 * of its tokens for gemm1, its slots' mid rows for gemm2) become the operand a scheme's
 * GEMM kernels read. Which format a (scheme, tier) uses is data (cm_gemm_config.a_format).
 *
 *   F32                  fp32 [red][rows]: rows interleaved per k.
 *   U8_QUADS             u8 [red/4][rows][4] of q + 128, q = round(v * 127 / absmax(row))
 *                        (half to even), scale absmax / 127 per row: x rows are quantized
 *                        once per token by prepare_token, mid rows once per slot.
 *   U8_QUADS_BLOCK_SUMS  U8_QUADS plus each row's sum of q over every reduction block of
 *                        the scheme (int32 [blocks][rows]): a decode kernel that multiplies
 *                        unsigned weights by q subtracts zero x that sum once per block.
 *   BF16_PAIRS           uint32 [red/2][rows]: elements k (high half) and k + 1 (low half)
 *                        of a row per dword, so that vdpbf16ps, which adds the high pair's
 *                        product first, sums in k order.
 *   BF16_ROWS            bf16 [rows][red + 32], U8_ROWS u8 [rows][red + 64] (quantized
 *                        as U8_QUADS): rows one after another, CM_PANEL_ROW_PAD bytes
 *                        longer than the reduction, the A operand of tile loads.
 *
 * The 16-bit formats hold the activations' own values: x rows are bf16 already and mid rows
 * were rounded to bf16 (gemm1), so narrowing them is exact. Their stage-2 panels are written
 * by gemm1 itself, 32 values at a time (store_mid), not from the intermediate. The other
 * formats read the intermediate's 16-bit rows (cm_run.mid), widened exactly: the quantized
 * ones quantize each once per slot, U8_ROWS straight into its panel row (INT8 Qwen3
 * M = 512, timing build: pack2 1.45 -> 1.27 ms per call against fp32 rows through midq).
 */
#include <string.h>

#include "moe/pipeline.h"

/* The 16-bit values of panel row i from column k0 on: x's own (stage 1) or mid's (stage 2). */
static const uint16_t *row16(const cm_run *r, const cm_panel *pn, int stage, size_t i, int64_t k0) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t pos = pn->first + (int64_t)i;
  if (stage == 2) return r->mid + (size_t)pos * (size_t)p->N + (size_t)k0;
  const int64_t token = r->m0 + r->sorted[pos] / p->topk;
  return (const uint16_t *)p->x + token * p->K + k0;
}

/* fp32 values of columns [k0, k0 + n) of panel row i, widened (exact) */
static const float *row_chunk(const cm_run *r, const cm_panel *pn, int stage, size_t i, int64_t k0,
                              size_t n, float *tmp) {
  r->widen(n, row16(r, pn, stage, i, k0), tmp);
  return tmp;
}

static void pack_f32(const cm_run *r, const cm_panel *pn, int stage) {
  const int64_t red = cm_stage_reduction(r, stage);
  const size_t rows = (size_t)pn->rows;
  float *panel = (float *)cm_panel_base(r, pn, stage);
  float tmp[CM_MR_MAX][CM_PACK_COLS];
  const float *src[CM_MR_MAX];
  for (int64_t k0 = 0; k0 < red; k0 += CM_PACK_COLS) {
    const size_t n = (size_t)(red - k0 < CM_PACK_COLS ? red - k0 : CM_PACK_COLS);
    for (size_t i = 0; i < rows; i++) src[i] = row_chunk(r, pn, stage, i, k0, n, tmp[i]);
    float *dst = panel + (size_t)k0 * rows;
    for (size_t k = 0; k < n; k++)
      for (size_t i = 0; i < rows; i++) dst[k * rows + i] = src[i][k];
  }
}

/* Scale of a row from its absmax (floored for all-zero rows; NaN stays NaN); returns 127/amax. */
static float u8_row_scale(float amax, float *scale) {
  if (!(amax >= CM_INT8_MIN_AMAX)) amax = amax != amax ? amax : CM_INT8_MIN_AMAX;
  *scale = amax / 127.0f;
  return 127.0f / amax;
}

/* Columns of an x row widened per step when quantizing it: a row of up to this many (4096,
 * Qwen3's and Mixtral's hidden sizes and below) is widened once and kept for both passes;
 * a longer one is widened twice, once per pass. The elementwise calls run over 16 KiB at a
 * time instead of CM_PACK_COLS (64) columns: the INT8 linear at M = 512 (Qwen3 q projection,
 * amx) took 0.94-0.98x the time, INT4's o projection 0.95x, the fused MoE the same. */
#define CM_QUANT_ROW_COLS 4096

/* A 16-bit row of n values quantized: q (u8) and *scale. */
static void quantize_row_u8(const cm_run *r, const uint16_t *row, int64_t n, uint8_t *q,
                            float *scale) {
  CM_ALIGNED float tmp[CM_QUANT_ROW_COLS];
  float amax = 0.0f;
  for (int64_t k0 = 0; k0 < n; k0 += CM_QUANT_ROW_COLS) {
    const size_t c = (size_t)(n - k0 < CM_QUANT_ROW_COLS ? n - k0 : CM_QUANT_ROW_COLS);
    r->widen(c, row + k0, tmp);
    amax = r->ew->absmax(c, tmp, amax);
  }
  const float inv_scale = u8_row_scale(amax, scale);
  for (int64_t k0 = 0; k0 < n; k0 += CM_QUANT_ROW_COLS) {
    const size_t c = (size_t)(n - k0 < CM_QUANT_ROW_COLS ? n - k0 : CM_QUANT_ROW_COLS);
    if (n > CM_QUANT_ROW_COLS) r->widen(c, row + k0, tmp); /* else tmp holds the row */
    r->ew->quantize_u8(c, tmp, inv_scale, q + k0);
  }
}

/* Token t's x row quantized once: xq (u8) and xs (its scale). */
static void prepare_token_u8(const cm_run *r, int64_t t) {
  const int64_t K = r->p->K;
  quantize_row_u8(r, (const uint16_t *)r->p->x + (r->m0 + t) * K, K, r->xq + (size_t)(t * K),
                  &r->xs[t]);
}

/* Elements k and k + 1 of a row as one BF16_PAIRS dword, k in the high half. */
static inline uint32_t bf16_pair(const uint16_t *two) {
  return (uint32_t)two[0] << 16 | two[1];
}

static void pack_bf16_pairs(const cm_run *r, const cm_panel *pn, int stage) {
  if (stage == 2) return; /* stored by store_bf16_pairs */
  const int64_t red = cm_stage_reduction(r, stage);
  const size_t rows = (size_t)pn->rows;
  uint32_t *panel = (uint32_t *)cm_panel_base(r, pn, stage);
  const uint16_t *src[CM_MR_MAX];
  for (int64_t k0 = 0; k0 < red; k0 += CM_PACK_COLS) {
    const size_t n = (size_t)(red - k0 < CM_PACK_COLS ? red - k0 : CM_PACK_COLS);
    for (size_t i = 0; i < rows; i++) src[i] = row16(r, pn, stage, i, k0);
    uint32_t *dst = panel + (size_t)k0 / 2 * rows;
    for (size_t kp = 0; kp < n / 2; kp++)
      for (size_t i = 0; i < rows; i++) dst[kp * rows + i] = bf16_pair(src[i] + 2 * kp);
  }
}

/* Stage 2 of the 16-bit formats: 32 values of mid row i, narrowed (exact: they were rounded
 * to the activation dtype) straight into the panel. */
static void store_bf16_pairs(const cm_run *r, const cm_panel *pn, size_t i, int64_t col0,
                             const float *mid) {
  uint16_t v[CM_NR];
  r->narrow(CM_NR, mid, v);
  uint32_t *dst = (uint32_t *)cm_panel_base(r, pn, 2) + (size_t)col0 / 2 * (size_t)pn->rows + i;
  for (size_t kp = 0; kp < CM_NR / 2; kp++) dst[kp * (size_t)pn->rows] = bf16_pair(v + 2 * kp);
}

static void store_bf16_rows(const cm_run *r, const cm_panel *pn, size_t i, int64_t col0,
                            const float *mid) {
  uint16_t *row = (uint16_t *)cm_panel_base(r, pn, 2) +
                  i * cm_panel_row_stride((size_t)cm_stage_reduction(r, 2), 2);
  CM_ALIGNED uint16_t v[CM_NR];
  r->narrow(CM_NR, mid, v);
  r->put_mid(sizeof v, v, row + col0);
}

static void pack_bf16_rows(const cm_run *r, const cm_panel *pn, int stage) {
  if (stage == 2) return; /* stored by store_bf16_rows */
  const int64_t red = cm_stage_reduction(r, stage);
  uint16_t *panel = (uint16_t *)cm_panel_base(r, pn, stage);
  const size_t stride = cm_panel_row_stride((size_t)red, 2);
  for (size_t i = 0; i < (size_t)pn->rows; i++)
    r->put_a((size_t)red * 2, row16(r, pn, stage, i, 0), panel + i * stride);
}

/* The quantized rows of a panel (x rows quantized once per token by prepare_token_u8, mid
 * rows quantized here, once per slot), and their scales into a_scale. */
static void u8_rows(const cm_run *r, const cm_panel *pn, int stage, const uint8_t **src) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t red = cm_stage_reduction(r, stage);
  const size_t rows = (size_t)pn->rows;
  float *scale = r->a_scale[stage - 1] + pn->first;
  for (size_t i = 0; i < rows; i++) {
    const int64_t pos = pn->first + (int64_t)i;
    if (stage == 1) { /* the token's row, quantized once by prepare_token_u8 */
      const int64_t t = r->sorted[pos] / p->topk;
      src[i] = r->xq + (size_t)(t * red);
      scale[i] = r->xs[t];
    } else { /* this slot's own intermediate row */
      uint8_t *q = r->midq + (size_t)(pos * red);
      quantize_row_u8(r, row16(r, pn, 2, i, 0), red, q, &scale[i]);
      src[i] = q;
    }
  }
}

static void pack_u8_rows(const cm_run *r, const cm_panel *pn, int stage) {
  const size_t red = (size_t)cm_stage_reduction(r, stage);
  uint8_t *panel = (uint8_t *)cm_panel_base(r, pn, stage);
  const size_t stride = cm_panel_row_stride(red, 1);
  if (stage == 2) { /* each mid row quantized straight into its panel row */
    float *scale = r->a_scale[1] + pn->first;
    for (size_t i = 0; i < (size_t)pn->rows; i++)
      quantize_row_u8(r, row16(r, pn, 2, i, 0), (int64_t)red, panel + i * stride, &scale[i]);
    return;
  }
  const uint8_t *src[CM_MR_MAX];
  u8_rows(r, pn, stage, src);
  /* x rows, streamed like the 16-bit ones */
  for (size_t i = 0; i < (size_t)pn->rows; i++) r->put_a(red, src[i], panel + i * stride);
}

static void pack_u8_quads(const cm_run *r, const cm_panel *pn, int stage) {
  const int64_t red = cm_stage_reduction(r, stage);
  const size_t rows = (size_t)pn->rows;
  uint8_t *panel = (uint8_t *)cm_panel_base(r, pn, stage);
  const uint8_t *src[CM_MR_MAX];
  u8_rows(r, pn, stage, src);
  for (size_t kq = 0; kq < (size_t)red / 4; kq++)
    for (size_t i = 0; i < rows; i++) memcpy(panel + (kq * rows + i) * 4, src[i] + 4 * kq, 4);
}

static void pack_u8_quads_block_sums(const cm_run *r, const cm_panel *pn, int stage) {
  pack_u8_quads(r, pn, stage);
  const int64_t red = cm_stage_reduction(r, stage), blocks = r->sum_blocks[stage - 1];
  const size_t bk = (size_t)(red / blocks), rows = (size_t)pn->rows;
  const uint8_t *panel = (const uint8_t *)cm_panel_base(r, pn, stage);
  int32_t *sums = r->q_sums[stage - 1] + (size_t)(pn->first * blocks);
  for (size_t b = 0; b < (size_t)blocks; b++)
    for (size_t i = 0; i < rows; i++) {
      const uint8_t *q = panel + b * bk * rows + 4 * i; /* k-quads of row i, stride 4 rows */
      int32_t sum = 0;
      for (size_t kq = 0; kq < bk / 4; kq++, q += 4 * rows) sum += q[0] + q[1] + q[2] + q[3];
      sums[b * rows + i] = sum - 128 * (int32_t)bk;
    }
}

const cm_panel_packer cm_panel_packers[CM_PANEL_FORMAT_COUNT] = {
    [CM_PANEL_F32] = {.pack = pack_f32, .elem_bytes = 4, .k_group = 1},
    [CM_PANEL_U8_QUADS] = {.prepare_token = prepare_token_u8,
                           .pack = pack_u8_quads,
                           .quantized = 1,
                           .elem_bytes = 1,
                           .k_group = 4},
    [CM_PANEL_U8_QUADS_BLOCK_SUMS] = {.prepare_token = prepare_token_u8,
                                      .pack = pack_u8_quads_block_sums,
                                      .quantized = 1,
                                      .block_sums = 1,
                                      .elem_bytes = 1,
                                      .k_group = 4},
    [CM_PANEL_BF16_PAIRS] = {.pack = pack_bf16_pairs,
                             .store_mid = store_bf16_pairs,
                             .elem_bytes = 2,
                             .k_group = 2},
    [CM_PANEL_BF16_ROWS] = {.pack = pack_bf16_rows,
                            .store_mid = store_bf16_rows,
                            .elem_bytes = 2,
                            .k_group = 0},
    [CM_PANEL_U8_ROWS] = {.prepare_token = prepare_token_u8,
                          .pack = pack_u8_rows,
                          .quantized = 1,
                          .elem_bytes = 1,
                          .k_group = 0},
};
