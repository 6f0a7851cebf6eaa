/*
 * Routing of one chunk: the chunk's slots (token, j) counting-sorted by expert, stable, so
 * each expert's slots are consecutive and in token order; each expert's run cut into
 * panels of at most mr rows, and consecutive panels into blocks of up to
 * r->panels_per_block that share one pass over each weight tile; a block of at most the
 * config's decode_max_rows rows marks its panels for the decode kernel. Serial: it is a few
 * passes over M * topk integers.
 */
#include <string.h>

#include "common/numeric.h"
#include "moe/pipeline.h"

static float slot_weight(const cpumoe_moe_problem *p, int64_t slot) {
  if (!p->topk_weights) return 1.0f;
  switch (p->topk_weights_dtype) {
    case CPUMOE_DTYPE_F32: return ((const float *)p->topk_weights)[slot];
    case CPUMOE_DTYPE_F64: return (float)((const double *)p->topk_weights)[slot];
    case CPUMOE_DTYPE_BF16: return cm_bf16_to_f32(((const uint16_t *)p->topk_weights)[slot]);
    default: return cm_f16_to_f32(((const uint16_t *)p->topk_weights)[slot]);
  }
}

void cm_route_chunk(cm_run *r, int64_t *offsets, int32_t *sorted, float *weights, cm_panel *panels,
                    cm_block *blocks) {
  const cpumoe_moe_problem *p = r->p;
  const int64_t slots = r->mc * p->topk, base = r->m0 * p->topk;
  memset(offsets, 0, sizeof(int64_t) * (size_t)(p->E + 1));
  for (int64_t s = 0; s < slots; s++) {
    const int64_t e = cm_slot_expert(p, base + s);
    weights[s] = slot_weight(p, base + s);
    if (e >= 0) offsets[e + 1]++;
  }
  for (int64_t e = 0; e < p->E; e++) offsets[e + 1] += offsets[e];
  /* offsets[e] is the first position of expert e */
  int64_t n_panels = 0, n_blocks = 0;
  for (int64_t e = 0; e < p->E; e++) {
    const int64_t count = offsets[e + 1] - offsets[e];
    const int64_t expert_first_block = n_blocks;
    for (int64_t first = 0; first < count; first += (int64_t)r->mr) {
      const int64_t rows = count - first < (int64_t)r->mr ? count - first : (int64_t)r->mr;
      /* a block starts every panels_per_block panels; with more than CM_PANELS_PER_BLOCK (the
       * dense linear), also where the fused MoE's would start one for a tail short enough
       * for the decode kernel, so that such rows take the kernel they take there */
      const int64_t mr = (int64_t)r->mr;
      if (first % (mr * r->panels_per_block) == 0 ||
          (first % (mr * CM_PANELS_PER_BLOCK) == 0 &&
           (size_t)(count - first) <= r->gemm->decode_max_rows))
        blocks[n_blocks++] = (cm_block){.first_panel = (int32_t)n_panels};
      blocks[n_blocks - 1].panels++;
      panels[n_panels++] = (cm_panel){.expert = (int32_t)e,
                                      .rows = (int32_t)rows,
                                      .first = offsets[e] + first,
                                      .in_run = (int32_t)first};
    }
    for (int64_t b = expert_first_block; b < n_blocks; b++) {
      blocks[b].expert_first_block = (int32_t)expert_first_block;
      blocks[b].expert_blocks = (int32_t)(n_blocks - expert_first_block);
      cm_panel *first = &panels[blocks[b].first_panel], *last = first + blocks[b].panels - 1;
      const int decode =
          (size_t)(last->first + last->rows - first->first) <= r->gemm->decode_max_rows;
      for (cm_panel *pn = first; pn <= last; pn++) pn->decode = decode;
    }
  }
  /* stable scatter: slots in increasing index order within each expert */
  for (int64_t s = 0; s < slots; s++) {
    const int64_t e = cm_slot_expert(p, base + s);
    if (e >= 0) sorted[offsets[e]++] = (int32_t)s;
  }
  r->n_blocks = n_blocks;
}
