/*
 * Geometry of the packed INT4 W4A8 weights (SGLang's convert_weight_packed_scale_zp layout,
 * docs/FORMATS.md), shared by the packer and every tier's kernels.
 *
 * One block = 32 output columns x bk reduction steps (bk = min(group, 128)):
 *   bytes [0, 16 bk):       per k-quad kk, 64 bytes = 16 dword lanes x 4 k; byte b of lane l
 *                           holds k = 4 kk + b of column lane_column(l) in its low nibble and
 *                           of column lane_column(l) + 8 in its high nibble, where
 *                           lane_column(l) = l for l < 8 and l + 8 for l >= 8;
 *   bytes [16 bk, +128):    int32 comp[32] = sum over the block's k of (w - zero).
 * Nibbles are unsigned weights 0..15; zero points are 0..15 (AWQ) or 1..16 (GPTQ), so
 * w - zero lies in [-16, 15] and fits an s8 operand.
 */
#ifndef CPUMOE_COMMON_INT4_H
#define CPUMOE_COMMON_INT4_H

#include <stddef.h>
#include <stdint.h>

#define CM_INT4_MAX_BLOCK_K 128
#define CM_INT4_COMP_BYTES 128 /* int32 comp[32] after each block's nibbles */

static inline size_t cm_int4_block_bytes(size_t bk) {
  return 16 * bk + CM_INT4_COMP_BYTES;
}

/* The column whose k-quad sits in the low nibbles of dword lane l (the high nibbles: + 8). */
static inline int cm_int4_lane_column(int l) {
  return l < 8 ? l : l + 8;
}

/* k per packed block for a group size, or 0 if the layout cannot serve it: the group must
 * be a multiple of 4 (whole k-quads) and either <= 128 or a multiple of 128. */
static inline int64_t cm_int4_block_k_of_group(int64_t group) {
  if (group < 4 || group % 4 != 0) return 0;
  if (group <= CM_INT4_MAX_BLOCK_K) return group;
  return group % CM_INT4_MAX_BLOCK_K == 0 ? CM_INT4_MAX_BLOCK_K : 0;
}

/* w - zero of column n (0..31), local k of one block, read from the packed nibbles. */
static inline int8_t cm_int4_weight(const uint8_t *block, size_t k, int n, int8_t zero) {
  const int high = (n & 8) != 0;
  const int lane = (n & 7) + ((n & 16) ? 8 : 0);
  const uint8_t byte = block[(k / 4) * 64 + (size_t)lane * 4 + (k & 3)];
  return (int8_t)((high ? byte >> 4 : byte & 15) - zero);
}

/* ---- shared by the decode GEMMs (schemes/int4/gemm-*.c) ---- */

/* Whole blocks whose nibbles cover `bytes`. Counted, not divided: it runs on every tile,
 * and with 64-bit divisions here and per block (group = kb / group_blocks, ahead of the
 * zero-point loads) the decode GEMM was measurably slower. */
static inline size_t cm_int4_blocks_covering(size_t bytes, size_t bk) {
  size_t blocks = 1;
  for (size_t covered = 16 * bk; covered < bytes; covered += 16 * bk) blocks++;
  return blocks;
}

/* The group of block kb and how many of its blocks remain from kb on (after each block,
 * --left == 0 starts the next group): no division when a group is one block, as in most
 * layouts (see cm_int4_blocks_covering for why it matters). */
static inline void cm_int4_group_of_block(size_t kb, size_t group_blocks, size_t *group,
                                          size_t *left) {
  if (group_blocks == 1) {
    *group = kb, *left = 1;
    return;
  }
  *group = kb / group_blocks;
  *left = group_blocks - kb % group_blocks;
}

#endif /* CPUMOE_COMMON_INT4_H */
