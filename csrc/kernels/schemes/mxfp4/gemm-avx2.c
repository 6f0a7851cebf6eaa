/*
 * AVX2 + FMA kernels for MXFP4: codes decoded exactly to bf16 in registers by byte table
 * lookups, widened to fp32, FMA against fp32 activation panels (contracts:
 * common/ukernels.h; numbers and layout: common/mxfp4.h; see mxfp4/gemm-avx512.c).
 *
 *   A panel: fp32 [k][a_stride];  C: fp32 [mr][32], mr <= 2.
 *   B:       32 bytes per k pair of a 32-row block; byte j: low nibble row j/2, high nibble
 *            row 16 + j/2, k parity j%2.  scales: e8m0 [groups][32].
 *   Math:    each C element is one fp32 FMA chain over k from +0 (or C) of a * w, w the
 *            exact bf16 decoding: the bits of the bf16 kernels on the decoded weights.
 *
 * Decode of one k pair (fast route, common/mxfp4.h): the nibbles masked out of the 32 bytes
 * (low nibbles: rows 0..15, high: rows 16..31), two vpshufb per nibble set look up the low
 * and the high bytes of the 16-bit code words, vpunpck[lh]bw joins them into words, a
 * saturating subtraction from the rows' scale words makes the bf16 bits, a shift (k even)
 * and a mask (k odd) widen them. The unpacks interleave within 128-bit lanes, so the four
 * vectors of a k pair hold rows {0-3, 8-11}, {4-7, 12-15}, {16-19, 24-27}, {20-23, 28-31}
 * (each dword one row's k pair): the accumulators keep that order and are put back in
 * column order once, when C is stored. A group whose scales leave the fast range is
 * decoded exactly by common/mxfp4.h into an L1 buffer and loaded in the same order.
 *
 * Tile: 2 rows x 32 columns in one pass, 8 accumulators; the rest of the 16 ymm hold a k
 * pair's decoded vectors and the tables. The decode is shared by the rows and is most of
 * the work, so few rows (the config's decode blocks); more rows take the chunk path
 * (cm_mxfp4_to_bf16 and the bf16 kernel of unquant/gemm-avx2.c).
 */
#include <immintrin.h>

#include "common/mxfp4.h"
#include "common/tile-avx2.h"
#include "common/ukernels.h"

#define MR_DECODE 2

typedef struct mxfp4_decoder {
  __m256i low_bytes, high_bytes; /* the code words' bytes, the same 16 in both lanes */
  __m256i a[4];                  /* the group's scale words, the four row orders above */
} mxfp4_decoder;

static inline __attribute__((always_inline)) mxfp4_decoder decoder_init(void) {
  static const uint16_t words[16] = {CM_MXFP4_CODE_WORDS};
  const __m128i w0 = _mm_loadu_si128((const __m128i *)words);
  const __m128i w1 = _mm_loadu_si128((const __m128i *)(words + 8));
  const __m128i byte = _mm_set1_epi16(0xff);
  mxfp4_decoder d;
  d.low_bytes = _mm256_broadcastsi128_si256(
      _mm_packus_epi16(_mm_and_si128(w0, byte), _mm_and_si128(w1, byte)));
  d.high_bytes =
      _mm256_broadcastsi128_si256(_mm_packus_epi16(_mm_srli_epi16(w0, 8), _mm_srli_epi16(w1, 8)));
  return d;
}

/* scale word of each row, in both halves of its dword */
static inline __attribute__((always_inline)) __m256i scale_words(__m256i s) {
  const __m256i a = _mm256_add_epi32(_mm256_slli_epi32(s, 7), _mm256_set1_epi32(0x8140));
  return _mm256_or_si256(a, _mm256_slli_epi32(a, 16));
}

/* the group's scale words in the row orders of the decoded vectors */
static inline __attribute__((always_inline)) void load_scales(mxfp4_decoder *d,
                                                              const uint8_t *scales) {
  for (int half = 0; half < 2; half++) {
    const uint8_t *s = scales + 16 * half;
    const __m256i rows0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s));
    const __m256i rows8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + 8)));
    d->a[2 * half] = scale_words(_mm256_permute2x128_si256(rows0, rows8, 0x20));
    d->a[2 * half + 1] = scale_words(_mm256_permute2x128_si256(rows0, rows8, 0x31));
  }
}

/* 1 when every scale of the group lies in the fast route's range */
static inline __attribute__((always_inline)) int group_fast(const uint8_t *scales) {
  const __m256i s = _mm256_loadu_si256((const __m256i *)scales);
  const __m256i above =
      _mm256_cmpeq_epi8(_mm256_max_epu8(s, _mm256_set1_epi8(CM_MXFP4_FAST_MIN)), s);
  const __m256i below =
      _mm256_cmpeq_epi8(_mm256_min_epu8(s, _mm256_set1_epi8((char)CM_MXFP4_FAST_MAX)), s);
  return _mm256_movemask_epi8(_mm256_and_si256(above, below)) == -1;
}

/* one k pair -> bf16 words of the four row orders (v[0..3], see the header) */
static inline __attribute__((always_inline)) void decode_kpair(const mxfp4_decoder *d,
                                                               const uint8_t *bk, __m256i *v) {
  const __m256i raw = _mm256_loadu_si256((const __m256i *)bk);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i codes[2] = {_mm256_and_si256(raw, nibble),
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble)};
  for (int half = 0; half < 2; half++) {
    const __m256i lo = _mm256_shuffle_epi8(d->low_bytes, codes[half]);
    const __m256i hi = _mm256_shuffle_epi8(d->high_bytes, codes[half]);
    v[2 * half] = _mm256_subs_epu16(d->a[2 * half], _mm256_unpacklo_epi8(lo, hi));
    v[2 * half + 1] = _mm256_subs_epu16(d->a[2 * half + 1], _mm256_unpackhi_epi8(lo, hi));
  }
}

/* the four row orders of an exactly decoded k pair (VNNI-2 memory order: rows 0..15 in words
 * 0..31, rows 16..31 in 32..63): 4 rows = 8 words = 16 bytes per lane */
static inline __attribute__((always_inline)) void load_kpair(const uint16_t *row, __m256i *v) {
  for (int i = 0; i < 4; i++) {
    const uint16_t *lane0 = row + 32 * (i / 2) + 8 * (i % 2);
    v[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lane0)),
                                   _mm_loadu_si128((const __m128i *)(lane0 + 16)), 1);
  }
}

/* the two k of a decoded pair into the accumulators: acc[r][i] += a[k] * even, a[k+1] * odd */
static inline __attribute__((always_inline)) void fma_kpair(const int mr, __m256 acc[][4],
                                                            const __m256i *v, const float *a_k,
                                                            size_t as) {
  const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++) {
    const __m256 x0 = _mm256_broadcast_ss(a_k + r), x1 = _mm256_broadcast_ss(a_k + as + r);
    for (int i = 0; i < 4; i++)
      acc[r][i] = _mm256_fmadd_ps(x0, _mm256_castsi256_ps(_mm256_slli_epi32(v[i], 16)), acc[r][i]);
    for (int i = 0; i < 4; i++)
      acc[r][i] =
          _mm256_fmadd_ps(x1, _mm256_castsi256_ps(_mm256_and_si256(v[i], odd_mask)), acc[r][i]);
  }
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t k,
                                                            const float *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const uint8_t *restrict scales,
                                                            float *restrict c, int accumulate) {
  __m256 acc[MR_DECODE][4];
  for (int r = 0; r < mr; r++)
    for (int h = 0; h < 2; h++) { /* columns 16h..16h+15 -> the two row orders of half h */
      const float *cr = c + r * CM_NR + 16 * h;
      const __m256 c0 = accumulate ? _mm256_loadu_ps(cr) : _mm256_setzero_ps();
      const __m256 c8 = accumulate ? _mm256_loadu_ps(cr + 8) : _mm256_setzero_ps();
      acc[r][2 * h] = _mm256_permute2f128_ps(c0, c8, 0x20);
      acc[r][2 * h + 1] = _mm256_permute2f128_ps(c0, c8, 0x31);
    }
  mxfp4_decoder d = decoder_init();
  _Alignas(64) uint16_t exact[CM_MXFP4_GROUP * CM_NR]; /* a group outside the fast range */
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++) {
    const uint8_t *bg = b + g * CM_MXFP4_GROUP_BYTES, *sg = scales + g * CM_NR;
    const float *ag = a + g * CM_MXFP4_GROUP * as;
    cm_mxfp4_prefetch_scales(sg, CM_DECODE_PF_L2_BYTES_AVX2);
    const int fast = group_fast(sg);
    if (fast)
      load_scales(&d, sg);
    else
      cm_mxfp4_decode_group(bg, sg, exact);
    for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp++) {
      const uint8_t *bk = bg + kp * CM_MXFP4_KP_BYTES;
      if (kp % 2 == 0)
        cm_prefetch_ahead(bk, CM_DECODE_PF_L1_BYTES_AVX2, CM_DECODE_PF_L2_BYTES_AVX2, 1);
      __m256i v[4];
      if (fast)
        decode_kpair(&d, bk, v);
      else
        load_kpair(exact + kp * 64, v);
      fma_kpair(mr, acc, v, ag + 2 * kp * as, as);
    }
  }
  for (int r = 0; r < mr; r++)
    for (int h = 0; h < 2; h++) {
      float *cr = c + r * CM_NR + 16 * h;
      _mm256_storeu_ps(cr, _mm256_permute2f128_ps(acc[r][2 * h], acc[r][2 * h + 1], 0x20));
      _mm256_storeu_ps(cr + 8, _mm256_permute2f128_ps(acc[r][2 * h], acc[r][2 * h + 1], 0x31));
    }
}

void cm_mxfp4_gemm_f32acc_mrx32__avx2(size_t mr, size_t k, const void *a, size_t as,
                                      const uint8_t *b, const uint8_t *scales, float *c,
                                      int accumulate) {
  CM_EXPECT(k % CM_MXFP4_GROUP == 0 && as >= mr && mr >= 1 && mr <= MR_DECODE);
  if (mr == 1)
    gemm_body(1, k, (const float *)a, as, b, scales, c, accumulate);
  else
    gemm_body(2, k, (const float *)a, as, b, scales, c, accumulate);
}

void cm_mxfp4_to_bf16__avx2(size_t k, const uint8_t *b, const uint8_t *scales, void *out) {
  CM_EXPECT(k % CM_MXFP4_GROUP == 0);
  uint16_t *dst = (uint16_t *)out;
  mxfp4_decoder d = decoder_init();
  for (size_t g = 0; g < k / CM_MXFP4_GROUP; g++) {
    const uint8_t *bg = b + g * CM_MXFP4_GROUP_BYTES, *sg = scales + g * CM_NR;
    uint16_t *dg = dst + g * CM_MXFP4_GROUP * CM_NR;
    if (!group_fast(sg)) {
      cm_mxfp4_decode_group(bg, sg, dg);
      continue;
    }
    load_scales(&d, sg);
    for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp++) {
      __m256i v[4];
      decode_kpair(&d, bg + kp * CM_MXFP4_KP_BYTES, v);
      uint16_t *row = dg + kp * 64; /* back to memory order: rows 0-7, 8-15, 16-23, 24-31 */
      for (int h = 0; h < 2; h++) {
        _mm256_storeu_si256((__m256i *)(row + 32 * h),
                            _mm256_permute2x128_si256(v[2 * h], v[2 * h + 1], 0x20));
        _mm256_storeu_si256((__m256i *)(row + 32 * h + 16),
                            _mm256_permute2x128_si256(v[2 * h], v[2 * h + 1], 0x31));
      }
    }
  }
}
