/*
 * AVX-512 kernels for FP8 (e4m3fn) W8A16: weights decoded exactly, fp32 FMA against fp32
 * activation panels, scaled per 2-D block (contracts: common/ukernels.h).
 *
 *   A panel: fp32 [kc][a_stride];  C: fp32 [mr][32].
 *   B:       fp8 VNNI-2 [kc/2][32][2] (docs/FORMATS.md): per k pair 64 bytes, columns
 *            0..15 in bytes 0..31, 16..31 in 32..63; one 16-bit pair = 2 k of one column.
 *   scale:   fp32 [32], each column's scale for this K block.
 *   Math:    per K block, P = one FMA chain of a * d over the block's k (d = value * 2^-8),
 *            then C = fma(P, scale, C): no per-weight multiply (SGLang's decode order);
 *            the pipeline multiplies the finished C by 2^8.
 *
 * Exact decoding: an e4m3 byte s.eeee.mmm moved into fp16 position (s at bit 15, e.m at
 * bits 13..7) is the fp16 number value * 2^-8 exactly, subnormals and zero included
 * (fp16 has 5 exponent bits, so every e4m3 value times 2^-8 is representable), and
 * vcvtph2ps widens it exactly. The exact route (decode_pair) widens bytes to 16-bit lanes
 * and forces the NaN codes (0x7f/0xff) to an fp16 NaN.
 *
 * Fast route (every K block without a NaN code): the same fp16 bits are made in place, in
 * the 16-bit lanes that hold a column's (k even, k odd) byte pair: an arithmetic shift
 * right by 1 and a mask give the odd byte's fp16 bits, a shift left by 8 first gives the
 * even byte's (5 integer ops per 64 bytes, no widening). Subnormal codes need no special
 * case: vcvtph2ps widens fp16 subnormals exactly and without a microcode assist (placing
 * the bits straight into fp32 would make fp32 denormals, whose assists cost ~30x on data
 * with many small codes). The NaN codes would come out finite, so the loop tracks them
 * (one min per 64 bytes) and a block that holds one is redone by the exact route. Both
 * the in-place fp16 bits and the scale outside the k loop roughly doubled the weights
 * streamed per second from L2 (docs/PERFORMANCE-HISTORY.md).
 *
 * Two ways to use the weights, chosen by the pipeline, with identical results:
 *   decode  (few rows): cm_fp8_gemm_f32acc_mrx32 decodes in registers, nothing stored.
 *   prefill (many rows): cm_fp8_to_f32 decodes a chunk once into an L1-resident fp32
 *           buffer [kc][32], then cm_f32_gemm_f32acc_mrx32 runs every panel on it.
 * Tiles: decode 12 x 32 like the bf16 kernel (24 accumulators + 4 decoded B vectors);
 * the fp32-B kernel 12 x 32 with 2 B loads per k (24 accumulators + 2 B + broadcasts).
 */
#include <immintrin.h>

#include "common/tile-avx512.h"
#include "common/ukernels.h"

#define MR CM_TILE_MR_AVX512
/* Decode prefetch, bytes of weights ahead: prefetcht0 1 KiB and prefetcht1 8 KiB, faster
 * than a single prefetcht0 distance; nearby pairs did about as well. */
#define CM_FP8_PREFETCH_L1_BYTES 1024
#define CM_FP8_PREFETCH_L2_BYTES 8192

/* 32 bytes (16 columns x 2 k) -> fp32 even-k and odd-k vectors, times 2^-8 */
static inline __attribute__((always_inline)) void decode_pair(__m256i bytes, __m512 *even,
                                                              __m512 *odd) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes); /* dword j = (k even, k odd) of column j */
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
  __m512i h = _mm512_or_si512(_mm512_slli_epi16(mag, 7),
                              _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(h, _mm512_set1_epi16(0x7c00)));
  *even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
  *odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
}

/* The fast route decodes a k pair (64 bytes) in 16-bit lanes: word j is column j's pair,
 * (k odd) << 8 | (k even). An arithmetic right shift by 1 leaves the odd byte's sign at
 * bit 15 and its value bits at 13..7: masked, the fp16 bits of value * 2^-8 (exact,
 * subnormals included; vcvtph2ps widens fp16 subnormals without a microcode assist). The
 * even byte is first moved up by 8. NaN codes would come out finite; the caller tracks them
 * (nan_track) and redoes the chunk with decode_kpair_exact. */
#define CM_FP16_BITS 0xBF80 /* sign and the 7 value bits after the shift */

/* vcvtph2ps with its 16 fp16 inputs read from memory. From a register, the upper 16 of a
 * k pair's 32 columns must first be extracted (a port-5 uop, the port the FMAs share), so
 * the fp16 bits take a round trip through a 128-byte L1 scratch buffer instead. Written
 * in asm because compilers forward the stored vector to the load and emit the extract
 * again. Two fewer vector uops per 64 bytes of weights (docs/PERFORMANCE-HISTORY.md). */
static inline __attribute__((always_inline)) __m512 cvtph_ps_from_memory(const void *half) {
#ifdef CM_PORTABLE_INTRINSICS
  /* the emulating test build (tools/build_c_tests.py): its intrinsics layer cannot run asm */
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)half));
#else
  /* asm: with the intrinsic, compilers forward the stored vector and extract again (above) */
  __m512 wide;
  __asm__("vcvtph2ps %1, %0" : "=v"(wide) : "m"(*(const __m256i *)half));
  return wide;
#endif
}

/* one k pair -> d = value * 2^-8 for columns 0-15 / 16-31, k even / odd; `scratch` is a
 * 128-byte, 64-byte aligned buffer for the fp16 bits */
static inline __attribute__((always_inline)) void decode_kpair_fast(__m512i raw, __m512i *scratch,
                                                                    __m512 *e0, __m512 *o0,
                                                                    __m512 *e1, __m512 *o1) {
  const __m512i keep = _mm512_set1_epi16((short)CM_FP16_BITS);
  _mm512_store_si512(scratch,
                     _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 1), keep));
  _mm512_store_si512(scratch + 1, _mm512_and_si512(_mm512_srai_epi16(raw, 1), keep));
  *e0 = cvtph_ps_from_memory((const char *)scratch);
  *e1 = cvtph_ps_from_memory((const char *)scratch + 32);
  *o0 = cvtph_ps_from_memory((const char *)scratch + 64);
  *o1 = cvtph_ps_from_memory((const char *)scratch + 96);
}

/* bytes whose value bits are all ones (the NaN codes) make this 0 */
static inline __attribute__((always_inline)) __m512i nan_track(__m512i track, __m512i raw) {
  return _mm512_min_epu8(track, _mm512_andnot_si512(raw, _mm512_set1_epi8(0x7f)));
}

static inline int saw_nan(__m512i track) {
  return _mm512_cmpeq_epi8_mask(track, _mm512_setzero_si512()) != 0;
}

/* 64 bytes of one k pair -> d for columns 0-15 / 16-31, k even / odd, by the widening fp16
 * route: exact for every code, NaN included */
static inline __attribute__((always_inline)) void decode_kpair_exact(const uint8_t *bk, __m512 *e0,
                                                                     __m512 *o0, __m512 *e1,
                                                                     __m512 *o1) {
  const __m512i raw = _mm512_loadu_si512(bk);
  decode_pair(_mm512_castsi512_si256(raw), e0, o0);
  decode_pair(_mm512_extracti64x4_epi64(raw, 1), e1, o1);
}

/* C = fma(P, scale, C or +0) for the finished block sums P */
static inline __attribute__((always_inline)) void fold_block(const int mr, const __m512 *p0,
                                                             const __m512 *p1,
                                                             const float *restrict scale,
                                                             float *restrict c, int accumulate) {
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
#pragma GCC unroll 12
  for (int r = 0; r < mr; r++) {
    const __m512 c0 = accumulate ? _mm512_loadu_ps(c + r * CM_NR) : _mm512_setzero_ps();
    const __m512 c1 = accumulate ? _mm512_loadu_ps(c + r * CM_NR + 16) : _mm512_setzero_ps();
    _mm512_storeu_ps(c + r * CM_NR, _mm512_fmadd_ps(p0[r], s0, c0));
    _mm512_storeu_ps(c + r * CM_NR + 16, _mm512_fmadd_ps(p1[r], s1, c1));
  }
}

/* Fast route over the block; returns 0 (c untouched) if a NaN code was seen, so that the
 * caller redoes the block by the exact route. */
static inline __attribute__((always_inline)) int gemm_fast(const int mr, size_t kc,
                                                           const float *restrict a, size_t as,
                                                           const uint8_t *restrict b,
                                                           const float *restrict scale,
                                                           float *restrict c, int accumulate) {
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, 0);
  __m512i track = _mm512_set1_epi8(-1), scratch[2];
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const uint8_t *bk = b + kp * 64;
    cm_prefetch_ahead(bk, CM_FP8_PREFETCH_L1_BYTES, CM_FP8_PREFETCH_L2_BYTES, 1);
    const __m512i raw = _mm512_loadu_si512(bk);
    track = nan_track(track, raw);
    __m512 e0, o0, e1, o1;
    decode_kpair_fast(raw, scratch, &e0, &o0, &e1, &o1);
    cm_tile_fma_k__avx512(mr, acc0, acc1, e0, e1, a + 2 * kp * as);
    cm_tile_fma_k__avx512(mr, acc0, acc1, o0, o1, a + (2 * kp + 1) * as);
  }
  if (saw_nan(track)) return 0;
  fold_block(mr, acc0, acc1, scale, c, accumulate);
  return 1;
}

static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const float *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const float *restrict scale,
                                                            float *restrict c, int accumulate) {
  if (gemm_fast(mr, kc, a, as, b, scale, c, accumulate)) return;
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, 0);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    __m512 e0, o0, e1, o1;
    decode_kpair_exact(b + kp * 64, &e0, &o0, &e1, &o1);
    cm_tile_fma_k__avx512(mr, acc0, acc1, e0, e1, a + 2 * kp * as);
    cm_tile_fma_k__avx512(mr, acc0, acc1, o0, o1, a + (2 * kp + 1) * as);
  }
  fold_block(mr, acc0, acc1, scale, c, accumulate);
}

static inline __attribute__((always_inline)) void gemm_f32b_body(const int mr, size_t kc,
                                                                 const float *restrict a, size_t as,
                                                                 const float *restrict b,
                                                                 float *restrict c,
                                                                 int accumulate) {
  __m512 acc0[MR], acc1[MR];
  cm_tile_load__avx512(mr, acc0, acc1, c, accumulate);
  for (size_t k = 0; k < kc; k++)
    cm_tile_fma_k__avx512(mr, acc0, acc1, _mm512_loadu_ps(b + k * CM_NR),
                          _mm512_loadu_ps(b + k * CM_NR + 16), a + k * as);
  cm_tile_store__avx512(mr, acc0, acc1, c);
}

void cm_fp8_gemm_f32acc_mrx32__avx512(size_t mr, size_t kc, const void *a, size_t as,
                                      const uint8_t *b, const float *scale, float *c,
                                      int accumulate) {
  CM_EXPECT(kc % 2 == 0 && as >= mr);
  CM_MR_SWITCH12(gemm_body, kc, (const float *)a, as, b, scale, c, accumulate)
}

void cm_f32_gemm_f32acc_mrx32__avx512(size_t mr, size_t kc, const void *a, size_t as, const void *b,
                                      float *c, int accumulate, cm_prefetch prefetch) {
  (void)prefetch; /* reads ahead on its own */
  CM_EXPECT(as >= mr);
  CM_MR_SWITCH12(gemm_f32b_body, kc, (const float *)a, as, (const float *)b, c, accumulate)
}

void cm_fp8_to_f32__avx512(size_t kc, const uint8_t *b, void *out) {
  float *dst = (float *)out;
  __m512i track = _mm512_set1_epi8(-1), scratch[2];
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const __m512i raw = _mm512_loadu_si512(b + kp * 64);
    track = nan_track(track, raw);
    __m512 e0, o0, e1, o1;
    decode_kpair_fast(raw, scratch, &e0, &o0, &e1, &o1);
    float *even = dst + 2 * kp * CM_NR, *odd = even + CM_NR;
    _mm512_storeu_ps(even, e0);
    _mm512_storeu_ps(even + 16, e1);
    _mm512_storeu_ps(odd, o0);
    _mm512_storeu_ps(odd + 16, o1);
  }
  if (!saw_nan(track)) return;
  for (size_t kp = 0; kp < kc / 2; kp++) {
    __m512 e0, o0, e1, o1;
    decode_kpair_exact(b + kp * 64, &e0, &o0, &e1, &o1);
    float *even = dst + 2 * kp * CM_NR, *odd = even + CM_NR;
    _mm512_storeu_ps(even, e0);
    _mm512_storeu_ps(even + 16, e1);
    _mm512_storeu_ps(odd, o0);
    _mm512_storeu_ps(odd + 16, o1);
  }
}
