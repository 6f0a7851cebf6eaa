/*
 * The workspace of one chunk of tokens: every region's offset, from the problem and its
 * (scheme, tier) config alone (the op asks for the total, the caller allocates it).
 * cm_validate_problem bounds slots by 2^24 and K, N by 2^30 (CM_MAX_*): nothing here can
 * overflow.
 */
#include "moe/pipeline.h"

static size_t align64(size_t x) {
  return (x + 63) & ~(size_t)63;
}

/* With gemms = 1 only what the first GEMM needs (the dense linear): the regions of the
 * second GEMM, the intermediate and y take no bytes. */
static cm_layout plan(const cpumoe_moe_problem *p, const cm_gemm_config *gemm, int gemms) {
  cm_layout l;
  const cm_panel_packer *packer = &cm_panel_packers[gemm->a_format];
  const cm_panel_packer *decode_packer = cm_decode_packer_of(gemm); /* NULL: none */
  const cm_scheme_traits *traits = cm_scheme_traits_of(p->scheme);
  const size_t mr = gemm->mr;
  const int64_t chunk = p->M < CM_CHUNK_TOKENS ? p->M : CM_CHUNK_TOKENS;
  l.slots = chunk * p->topk;
  l.max_panels = (l.slots + (int64_t)mr - 1) / (int64_t)mr + (p->E < l.slots ? p->E : l.slots);
  for (int stage = 1; stage <= 2; stage++)
    l.sum_blocks[stage - 1] =
        stage <= gemms && (packer->block_sums || (decode_packer && decode_packer->block_sums))
            ? traits->reduction_blocks(p, stage)
            : 0;
  /* quantized formats: rows quantized once per token (xq, xs) and once per mid row (midq);
   * A panels hold at most 4 bytes per element (fp32), plus the rows a tile load may read
   * past the last panel; scales one float per row */
  const int quantized = packer->quantized || (decode_packer && decode_packer->quantized);
  const int64_t slack = CM_PANEL_SLACK_ROWS;
  const size_t pad = (size_t)CM_MR_MAX * CM_PANEL_ROW_PAD; /* row-major panels' row pads */
  size_t at = 0;
  l.offsets = at, at = align64(at + sizeof(int64_t) * (size_t)(p->E + 1));
  l.sorted = at, at = align64(at + sizeof(int32_t) * (size_t)l.slots);
  l.weights = at, at = align64(at + sizeof(float) * (size_t)l.slots);
  l.panels = at, at = align64(at + sizeof(cm_panel) * (size_t)l.max_panels);
  l.blocks = at, at = align64(at + sizeof(cm_block) * (size_t)l.max_panels);
  l.xq = at, at = align64(at + (quantized ? (size_t)(chunk * p->K) : 0));
  l.xs = at, at = align64(at + (quantized ? sizeof(float) * (size_t)chunk : 0));
  const int64_t N = gemms == 2 ? p->N : 0; /* no intermediate without the second GEMM */
  const int64_t y_cols = gemms == 2 ? p->K : 0;
  l.midq = at, at = align64(at + (quantized ? (size_t)(l.slots * N) : 0));
  l.a1 = at, at = align64(at + sizeof(float) * (size_t)((l.slots + slack) * p->K) + pad);
  l.as1 = at, at = align64(at + sizeof(float) * (size_t)l.slots);
  l.qs1 = at, at = align64(at + sizeof(int32_t) * (size_t)(l.slots * l.sum_blocks[0]));
  l.mid = at, at = align64(at + sizeof(uint16_t) * (size_t)(l.slots * N));
  l.a2 = at, at = align64(at + (N ? sizeof(float) * (size_t)((l.slots + slack) * N) + pad : 0));
  l.as2 = at, at = align64(at + (N ? sizeof(float) * (size_t)l.slots : 0));
  l.qs2 = at, at = align64(at + sizeof(int32_t) * (size_t)(l.slots * l.sum_blocks[1]));
  l.y = at, at = align64(at + sizeof(float) * (size_t)(l.slots * y_cols));
  l.total = at + 64; /* room to align the base pointer */
  return l;
}

cm_layout cm_plan_layout(const cpumoe_moe_problem *p, const cm_gemm_config *gemm) {
  return plan(p, gemm, 2);
}

cm_layout cm_plan_layout_gemm1(const cpumoe_moe_problem *p, const cm_gemm_config *gemm) {
  return plan(p, gemm, 1);
}
