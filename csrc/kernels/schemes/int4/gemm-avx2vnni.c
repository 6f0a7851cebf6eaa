/*
 * AVX-VNNI kernel for INT4 W4A8 (contracts: common/ukernels.h, layout: common/int4.h): the
 * decode-path GEMM, nibbles expanded in registers, a panel's rows two at a time. The prefill
 * path's integer GEMM is the INT8 tier's (int8/gemm-avx2vnni.c); unpacking and the per-block fold
 * stay avx2's.
 *
 * A block's sums: the low and high nibbles of a packed k-quad's two 32-byte halves are, per
 * dword lane, 4 k of one column (columns 0-7, 8-15, 16-23, 24-31: int4/gemm-avx2.c), so each
 * masked vector is vpdpbusd's unsigned operand as it is, and the row's 4 activations
 * q = (q + 128) ^ 0x80, broadcast, its signed one: 4 products of |.| <= 15 * 128 straight
 * into the int32 lane, exact, no int16 stage. Per 64 bytes of nibbles: 2 loads, 6 mask/shift
 * ops and 4 vpdpbusd (avx2: 4 vpmaddubsw, 4 vpaddw and the widening). The loop around the
 * block sums, with the zero-point fold that makes every tier's bits the same, is
 * int4/decode-avx2.h's. Registers: 4 fp32 outputs, 4 int32 sums, x, 2 masks, 3 temporaries.
 */
#include <immintrin.h>
#include <string.h>

#include "common/int4.h"
#include "common/tile-avx2.h"
#include "common/ukernels.h"
#include "schemes/int4/decode-avx2.h"

static inline __attribute__((always_inline)) void block_sums_dpbusd(
    const int rows, const uint8_t *block, size_t quads, const uint8_t *ab, size_t as,
    const cm_int4_readahead *ra, __m256i sum32[][4]) {
  const __m256i low_nibbles = _mm256_set1_epi8(15);
  const __m256i flip_sign = _mm256_set1_epi8((char)0x80); /* q + 128 -> q */
  for (size_t kq = 0; kq < quads; kq++) {
    cm_int4_readahead_quad(ra, block, kq);
    __m256i x[2];
    for (int r = 0; r < rows; r++) {
      int32_t q4;
      memcpy(&q4, ab + (kq * as + (size_t)r) * 4, 4);
      x[r] = _mm256_xor_si256(_mm256_set1_epi32(q4), flip_sign);
    }
    for (int h = 0; h < 2; h++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(block + kq * 64 + 32 * h));
      const __m256i lo = _mm256_and_si256(v, low_nibbles);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
      for (int r = 0; r < rows; r++) {
        sum32[r][2 * h] = _mm256_dpbusd_avx_epi32(sum32[r][2 * h], lo, x[r]);
        sum32[r][2 * h + 1] = _mm256_dpbusd_avx_epi32(sum32[r][2 * h + 1], hi, x[r]);
      }
    }
  }
}

void cm_int4_gemm_decode_1x32__avx2vnni(size_t mr, const cm_int4_tile *w, size_t kb0, size_t nb,
                                        const uint8_t *a, size_t as, const int32_t *q_sums,
                                        float *c, int accumulate) {
  CM_EXPECT(mr >= 1 && mr <= CM_TILE_MR_AVX2VNNI);
  CM_INT4_DECODE_PANEL_AVX2(block_sums_dpbusd, mr, w, kb0, nb, a, as, q_sums, c, accumulate);
}
