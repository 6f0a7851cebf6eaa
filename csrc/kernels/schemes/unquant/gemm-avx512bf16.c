/*
 * AVX512_BF16 GEMM micro-kernel for bf16 weights against bf16 activations: vdpbf16ps, two k
 * per instruction.
 *
 * C[mr][32] (+)= A_pairs[k/2][a_stride] x B_tile[k/2][32][2], mr <= 12, fp32.
 *   A panel: bf16 pairs, high first: a_pairs[kp * a_stride + r] holds row r's k = 2kp in
 *            bits 31..16 and k = 2kp + 1 in bits 15..0 (swapped against memory order).
 *   B tile:  VNNI-2, 128 bytes per k pair: columns 0..15 in bytes 0..63, 16..31 in
 *            64..127, each dword holding (k even in bits 15..0, k odd in 31..16) of one
 *            column: the packed layout every tier reads, so it is not changed here.
 *   C tile:  fp32 [mr][32]; accumulate = 0 starts from +0, else from C.
 *
 * Order of the sums: vdpbf16ps adds the high pair's product first, then the low pair's,
 * each a fused step rounded to nearest even (docs/NUMERICS.md, "bf16 dot products and AMX
 * on silicon"). A carries k even in its high half; rotating each B dword by 16 bits puts
 * B's k even there too, so each lane computes fmaf(a[k+1], b[k+1], fmaf(a[k], b[k], acc))
 * and each C element is the fp32-chain tiers' chain over k, bit for bit, except that
 * vdpbf16ps treats denormal inputs and a denormal accumulator as zero (DAZ) and flushes
 * denormal results (FTZ).
 *
 * Tile 12 x 32 and why: per k pair the two 64-byte B loads need one rotate each and each
 * row 2 accumulators: 12 rows x 2 + 2 B vectors = 26 of 32 zmm (A is broadcast from memory
 * into the instruction), 24 vdpbf16ps per 2 rotates (port 0), 24 independent chains.
 * vdpbf16ps zmm issues once per 2 cycles on the Xeon measured, so 24 of them take 48 cycles
 * per k pair where the avx512 kernel's 48 fp32 FMAs take 24: with many rows this kernel is
 * compute-bound and slower than the fp32 one, at few rows both stream the weights at about
 * the read bandwidth (docs/PERFORMANCE-HISTORY.md). Hence the config gives it few rows.
 */
#include <immintrin.h>
#include <string.h>

#include "common/tile-avx512bf16.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX512
/* Decode prefetch: both lines of a k pair 3.5 KiB ahead into L2 (prefetcht1), nothing into
 * L1: faster at M=1 from DRAM than the avx512 kernel's L1 + L2 pair. Against the 8 KiB that
 * were here, Qwen3 bf16 on the amx tier, both settings in one process: M=1 0.924-0.936x the
 * time, M=4 0.924x; 3 KiB about as good, 2 KiB 0.966x, 4 KiB 0.986x, 1 KiB 1.011x
 * (docs/PERFORMANCE-HISTORY.md, "Shorter read-ahead for bf16 and MXFP4 decode"). */
#define CM_PREFETCH_L2_BYTES 3584

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t k,
                                                            const uint32_t *restrict a, size_t as,
                                                            const uint16_t *restrict b,
                                                            float *restrict c, int accumulate) {
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, accumulate);
  for (size_t kp = 0; kp < k / 2; kp++) {
    const uint16_t *bk = b + kp * 64;
    /* Weights stream from DRAM once per call at decode: keep more misses in flight than
     * the L2 streamer alone does. Prefetches past the tile's end are harmless hints. */
    _mm_prefetch((const char *)bk + CM_PREFETCH_L2_BYTES, _MM_HINT_T1);
    _mm_prefetch((const char *)bk + CM_PREFETCH_L2_BYTES + 64, _MM_HINT_T1);
    /* (k even, k odd) -> (k odd, k even): k even in the high half, as in A */
    const __m512bh b0 = cm_as_bf16x32__avx512bf16(_mm512_rol_epi32(_mm512_loadu_si512(bk), 16));
    const __m512bh b1 =
        cm_as_bf16x32__avx512bf16(_mm512_rol_epi32(_mm512_loadu_si512(bk + 32), 16));
    const uint32_t *ak = a + kp * as;
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
      const __m512bh x = cm_as_bf16x32__avx512bf16(_mm512_set1_epi32((int)ak[r]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], x, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], x, b1);
    }
  }
  cm_tile_store__avx512(mr, acc0, acc1, c);
}

void cm_bf16_gemm_pairs_mrx32__avx512bf16(size_t mr, size_t k, const void *a_pairs, size_t a_stride,
                                          const void *b, float *c, int accumulate,
                                          cm_prefetch prefetch) {
  CM_EXPECT(k % 2 == 0 && a_stride >= mr);
  (void)prefetch; /* reads ahead on its own */
  CM_MR_SWITCH12(gemm_body, k, (const uint32_t *)a_pairs, a_stride, (const uint16_t *)b, c,
                 accumulate)
}
