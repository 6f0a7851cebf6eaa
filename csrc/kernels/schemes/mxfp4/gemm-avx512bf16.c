/*
 * AVX512_BF16 decode kernel for MXFP4: codes decoded exactly to bf16 in registers (VBMI
 * byte permute + vpermw table), then vdpbf16ps against bf16 activation pairs, two k per
 * instruction (contracts: common/ukernels.h; numbers and layout: common/mxfp4.h).
 *
 *   A panel: bf16 pairs, high first: a_pairs[kp * a_stride + r] holds row r's k = 2kp in
 *            bits 31..16 and k = 2kp + 1 in bits 15..0 (CM_PANEL_BF16_PAIRS).
 *   B:       32 bytes per k pair of a 32-row block; byte j: low nibble row j/2, high nibble
 *            row 16 + j/2, k parity j%2.  scales: e8m0 [groups][32].
 *   C:       fp32 [mr][32], mr <= 4; accumulate = 0 starts from +0.
 *
 * Decode of 64 bytes (two k pairs), fast route of common/mxfp4.h: per k pair one zero-masked
 * vpermb spreads the 32 bytes into words with each pair of bytes swapped (word 2c holds the
 * byte of row c at k odd, word 2c + 1 that at k even: k even in each dword's high half, as
 * in A, which vdpbf16ps adds first); a vpermw looks up the code words of the low nibbles
 * (rows 0..15), another after a shift by 4 those of the high nibbles (rows 16..31), and a
 * saturating subtraction from each row's scale word makes the exact bf16 bits. Per k pair:
 * 3 port-5 uops (vpermb, 2 vpermw), 3 others (a shift, 2 subtractions), then per row 2
 * vdpbf16ps (port 5, 2 cycles each on the Xeon of docs/NUMERICS.md). A group whose scales
 * leave the fast range is decoded exactly by common/mxfp4.h into an L1 buffer and rotated
 * into the same pairs.
 *
 * Order of the sums: vdpbf16ps adds the high pair's product first, then the low one's, each
 * a fused step rounded to nearest even (docs/NUMERICS.md): each C element is the fp32 chain
 * over k of a * w, the fp32-chain tiers' bits, except that vdpbf16ps treats denormal inputs
 * (an activation, or a weight of scale 0 or 1) and a denormal accumulator as zero and
 * flushes denormal results (the fp32-chain-daz class): the bits of the avx512bf16 bf16
 * kernel (unquant/gemm-avx512bf16.c) on the decoded weights.
 */
#include <immintrin.h>
#include <string.h>

#include "common/mxfp4.h"
#include "common/tile-avx512bf16.h"
#include "common/ukernels.h"
#include "schemes/mxfp4/decode-avx512.h"

#define MR_DECODE 4
/* Read-ahead, bytes of codes: prefetcht0 1 KiB and prefetcht1 3.5 KiB ahead, one line per 64
 * bytes. 3.5 KiB into L2 against the FP8 kernels' 8: Qwen3 M=1 0.976x the time
 * (docs/PERFORMANCE-HISTORY.md, "Shorter read-ahead for bf16 and MXFP4 decode"). */
#define CM_MXFP4_PF_L1_BYTES 1024
#define CM_MXFP4_PF_L2_BYTES 3584

/* The vpermb spread of each k pair of a 64-byte load: output byte 2w takes byte w ^ 1 of the
 * pair (the swap), output byte 2w + 1 is zeroed by the mask. */
#define CM_SPREAD_PAIR(w, base) (base) + ((w) ^ 1), 0
#define CM_SPREAD8(w, base)                                                                  \
  CM_SPREAD_PAIR(w, base), CM_SPREAD_PAIR(w + 1, base), CM_SPREAD_PAIR(w + 2, base),         \
      CM_SPREAD_PAIR(w + 3, base), CM_SPREAD_PAIR(w + 4, base), CM_SPREAD_PAIR(w + 5, base), \
      CM_SPREAD_PAIR(w + 6, base), CM_SPREAD_PAIR(w + 7, base)
#define CM_SPREAD32(base) \
  CM_SPREAD8(0, base), CM_SPREAD8(8, base), CM_SPREAD8(16, base), CM_SPREAD8(24, base)
static const uint8_t cm_mxfp4_spread[128]
    __attribute__((aligned(64))) = {CM_SPREAD32(0), CM_SPREAD32(32)};
#define CM_LOW_BYTES 0x5555555555555555ull /* the low byte of every word */

typedef struct mxfp4_decoder {
  __m512i table;            /* code words */
  __m512i spread0, spread1; /* the k pairs of a 64-byte load */
  __m512i a_lo, a_hi;       /* the group's scale words, rows 0..15 and 16..31 */
} mxfp4_decoder;

/* one k pair, spread into swapped words -> bf16 pairs (k even high) of rows 0..15 and 16..31 */
static inline __attribute__((always_inline)) void decode_spread(const mxfp4_decoder *d, __m512i x,
                                                                __m512bh *b0, __m512bh *b1) {
  *b0 = cm_as_bf16x32__avx512bf16(cm_mxfp4_lookup__avx512(d->table, d->a_lo, x));
  *b1 = cm_as_bf16x32__avx512bf16(
      cm_mxfp4_lookup__avx512(d->table, d->a_hi, cm_srli_epi16_mul__avx512(x, 4)));
}

/* one k pair into the accumulators: p0 columns 0..15, p1 16..31 */
static inline __attribute__((always_inline)) void dot_kpair(const int mr, __m512 *p0, __m512 *p1,
                                                            __m512bh b0, __m512bh b1,
                                                            const uint32_t *a_k) {
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    const __m512bh x = cm_as_bf16x32__avx512bf16(_mm512_set1_epi32((int)a_k[r]));
    p0[r] = _mm512_dpbf16_ps(p0[r], x, b0);
    p1[r] = _mm512_dpbf16_ps(p1[r], x, b1);
  }
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t k,
                                                            const uint32_t *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const uint8_t *restrict scales,
                                                            float *restrict c, int accumulate) {
  __m512 p0[MR_DECODE], p1[MR_DECODE];
  cm_tile_load__avx512(mr, p0, p1, c, accumulate);
  mxfp4_decoder d = {.table = cm_mxfp4_table__avx512(),
                     .spread0 = _mm512_load_si512(cm_mxfp4_spread),
                     .spread1 = _mm512_load_si512(cm_mxfp4_spread + 64)};
  _Alignas(64) uint16_t exact[CM_MXFP4_GROUP * CM_NR]; /* a group outside the fast range */
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++) {
    const uint8_t *bg = b + g * CM_MXFP4_GROUP_BYTES, *sg = scales + g * CM_NR;
    const uint32_t *ag = a + g * CM_MXFP4_GROUP_KP * as;
    cm_mxfp4_prefetch_scales(sg, CM_MXFP4_PF_L2_BYTES);
    if (cm_mxfp4_group_fast__avx512(sg)) {
      d.a_lo = cm_mxfp4_scale_words__avx512(sg);
      d.a_hi = cm_mxfp4_scale_words__avx512(sg + 16);
      for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp += 2) {
        const uint8_t *bk = bg + kp * CM_MXFP4_KP_BYTES;
        /* at decode the codes stream from DRAM once: more misses in flight than the L2
         * streamer alone keeps */
        cm_prefetch_ahead(bk, CM_MXFP4_PF_L1_BYTES, CM_MXFP4_PF_L2_BYTES, 1);
        const __m512i raw = cm_load_once__avx512(bk);
        __m512bh b0, b1;
        decode_spread(&d, _mm512_maskz_permutexvar_epi8(CM_LOW_BYTES, d.spread0, raw), &b0, &b1);
        dot_kpair(mr, p0, p1, b0, b1, ag + kp * as);
        decode_spread(&d, _mm512_maskz_permutexvar_epi8(CM_LOW_BYTES, d.spread1, raw), &b0, &b1);
        dot_kpair(mr, p0, p1, b0, b1, ag + (kp + 1) * as);
      }
    } else {
      cm_mxfp4_decode_group(bg, sg, exact);
      for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp++) {
        /* VNNI-2 memory order (k even low) -> k even high */
        const __m512bh b0 =
            cm_as_bf16x32__avx512bf16(_mm512_rol_epi32(_mm512_load_si512(exact + kp * 64), 16));
        const __m512bh b1 = cm_as_bf16x32__avx512bf16(
            _mm512_rol_epi32(_mm512_load_si512(exact + kp * 64 + 32), 16));
        dot_kpair(mr, p0, p1, b0, b1, ag + kp * as);
      }
    }
  }
  cm_tile_store__avx512(mr, p0, p1, c);
}

void cm_mxfp4_gemm_pairs_mrx32__avx512bf16(size_t mr, size_t k, const void *panel, size_t a_stride,
                                           const uint8_t *b, const uint8_t *scales, float *c,
                                           int accumulate) {
  const uint32_t *a_pairs = (const uint32_t *)panel;
  CM_EXPECT(mr >= 1 && mr <= MR_DECODE);
  CM_EXPECT(k % CM_MXFP4_GROUP == 0 && a_stride >= mr);
  switch (mr) {
    case 1: gemm_body(1, k, a_pairs, a_stride, b, scales, c, accumulate); break;
    case 2: gemm_body(2, k, a_pairs, a_stride, b, scales, c, accumulate); break;
    case 3: gemm_body(3, k, a_pairs, a_stride, b, scales, c, accumulate); break;
    default: gemm_body(4, k, a_pairs, a_stride, b, scales, c, accumulate); break;
  }
}
