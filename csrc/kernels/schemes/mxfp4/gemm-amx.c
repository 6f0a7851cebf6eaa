/*
 * AMX kernel for MXFP4 with bf16 activations: each group of 32 k decoded exactly to bf16
 * into a 2 KiB L1 tile buffer (the AVX-512 decoder, schemes/mxfp4/decode-avx512.h), then
 * tdpbf16ps on it, group after group (contracts: common/ukernels.h; tiles:
 * common/tile-amx.h).
 *
 *   A panel: bf16 [rows][a_stride] (CM_PANEL_BF16_ROWS; whole 16-row tiles are read, rows
 *            past mr from the panel's slack).
 *   B:       32 bytes per k pair of a 32-row block, scales e8m0 [groups][32] (common/mxfp4.h).
 *   C:       fp32 [mr][32], mr <= 32; accumulate = 0 starts from +0.
 *
 * One group is one tile step: its 16 k pairs decoded in VNNI-2 order are the two B tiles
 * (columns 0..15 and 16..31, 16 k-rows of 64 bytes at stride 128), so per group: decode
 * (vector units), 2 B + 1 or 2 A tile loads, 2 or 4 tdpbf16ps (tile unit). A group is
 * decoded one step ahead, into the other half of a double buffer: a tile load cannot take
 * its data from the store buffer, it waits until the stores have retired and reached L1,
 * and stores retire in program order, so decoding just before the load would put the
 * decode, the drain and the tile product of every group on one chain. One group ahead,
 * only the tile products' own chain through C remains.
 *
 * Numerics: tdpbf16ps per 32 k, as the bf16 tile kernel (tiles/gemm-amx.c) computes on the
 * decoded weights, one call or in chunks of whole steps alike (the amx-bf16 class): this
 * kernel (blocks of one panel) and the chunk path (decode once, the bf16 tile kernel on
 * every panel) give the same bits.
 */
#include <immintrin.h>
#include <string.h>

#include "common/mxfp4.h"
#include "common/tile-amx.h"
#include "common/ukernels.h"
#include "schemes/mxfp4/decode-avx512.h"

/* Read-ahead of the codes, a group (8 lines) at a time: into L1 2 groups ahead, into L2 7
 * groups (3.5 KiB) ahead (a stream from memory needs more misses in flight than the hardware
 * prefetchers keep). 4 KiB had measured 2-3 % faster than 8 KiB at M=1 with the weights on
 * huge pages ("Decode read-ahead on huge pages"); 3.5 KiB against 4, both settings in one
 * process: Qwen3 M=1 0.970x the time, gpt-oss-20b M=1 0.986x, Qwen3 M=4 level; 3 KiB 0.984x,
 * 2.5 KiB 1.016x (docs/PERFORMANCE-HISTORY.md, "Shorter read-ahead for bf16 and MXFP4
 * decode"). */
#define CM_MXFP4_AMX_PF_L1_BYTES 1024
#define CM_MXFP4_AMX_PF_L2_BYTES 3584
/* Panels of up to this many rows go through a compact A tile (below) */
#define CM_MXFP4_AMX_COMPACT_ROWS 4

void cm_mxfp4_gemm_rows_mrx32__amx(size_t mr, size_t k, const void *a, size_t a_stride,
                                   const uint8_t *b, const uint8_t *scales, float *c,
                                   int accumulate) {
  CM_EXPECT(mr >= 1 && mr <= 2 * CM_AMX_TILE_ROWS && k % CM_MXFP4_GROUP == 0 && a_stride >= k);
  const int two = mr > CM_AMX_TILE_ROWS;
  const size_t a_bytes = a_stride * 2;
  const uint8_t *a8 = (const uint8_t *)a;
  _Alignas(64) float bounce[2 * CM_AMX_TILE_ROWS * CM_NR];
  float *cc = (mr == CM_AMX_TILE_ROWS || mr == 2 * CM_AMX_TILE_ROWS) ? c : bounce;
  if (cc != c && accumulate) memcpy(bounce, c, mr * CM_NR * sizeof(float));
  _Alignas(64) uint16_t tiles[2][CM_MXFP4_GROUP * CM_NR]; /* B of alternate groups */
  const __m512i table = cm_mxfp4_table__avx512();
  const size_t groups = k / CM_MXFP4_GROUP;
  cm_amx_configure_tiles__amx();
  cm_amx_load_c(1 + two, cc, accumulate);
  /* Few rows: their 64 bytes of each step copied into a compact 1 KiB A tile (alternating
   * like B, for the same reason), instead of a tile load of 16 rows a reduction apart,
   * mostly slack (64 KiB of lines over the reduction at K = 2048, more than L1 holds) */
  const int compact = mr <= CM_MXFP4_AMX_COMPACT_ROWS;
  /* Rows past mr hold whatever the stack held: they only make C rows that are never stored,
   * like the slack rows of a panel. Zeroing them on every call costs more than it looks: the
   * tile loads wait for those 2 KiB of stores to reach L1 (docs/PERFORMANCE-HISTORY.md,
   * "MXFP4 decode on the AMX tier"). On the stack, not in thread-local storage: a shared
   * library reaches that through a __tls_get_addr call on every kernel call. */
  _Alignas(64) uint8_t a_tiles[2][CM_AMX_TILE_ROWS][CM_AMX_TILE_BYTES];
  for (size_t g = 0; g <= groups; g++) {
    /* the next group first: its buffers' stores then come before this group's tile products
     * in program order and can retire without waiting for them */
    if (g < groups) {
      cm_prefetch_ahead(b + g * CM_MXFP4_GROUP_BYTES, CM_MXFP4_AMX_PF_L1_BYTES,
                        CM_MXFP4_AMX_PF_L2_BYTES, CM_MXFP4_GROUP_BYTES / 64);
      cm_mxfp4_prefetch_scales(scales + g * CM_NR, CM_MXFP4_AMX_PF_L2_BYTES);
      cm_mxfp4_decode_group__avx512(b + g * CM_MXFP4_GROUP_BYTES, scales + g * CM_NR, table,
                                    tiles[g & 1]);
      for (size_t r = 0; compact && r < mr; r++)
        _mm512_store_si512(a_tiles[g & 1][r],
                           _mm512_loadu_si512(a8 + g * CM_AMX_TILE_BYTES + r * a_bytes));
    }
    if (g == 0) continue;
    const size_t t = g - 1; /* the group whose tile products run now */
    if (compact)
      CM_AMX_STEP(_tile_dpbf16ps, 0, a_tiles[t & 1], CM_AMX_TILE_BYTES, tiles[t & 1],
                  CM_AMX_B_ROW_BYTES);
    else
      CM_AMX_STEP(_tile_dpbf16ps, two, a8 + t * CM_AMX_TILE_BYTES, a_bytes, tiles[t & 1],
                  CM_AMX_B_ROW_BYTES);
  }
  cm_amx_store_c(1 + two, cc);
  if (cc != c) memcpy(c, bounce, mr * CM_NR * sizeof(float));
}
