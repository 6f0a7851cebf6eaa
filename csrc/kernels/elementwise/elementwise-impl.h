/*
 * Elementwise kernels, written once and compiled once per tier: each
 * elementwise-<tier>.c defines CM_TIER and includes this file, and the compiler
 * vectorizes these loops with that tier's flags. The arithmetic is the scalar
 * helpers of common/numeric.h, compiled with -ffp-contract=off, so every tier
 * gives the same bits.
 *
 * Sizes are small (one C tile row up to one token row); no alignment assumed.
 * Exceptions to "generic loops": bias_scale_stream and copy_stream use AVX intrinsics on
 * the tiers that have AVX, since no loop compiles to streaming stores; quantize_u8 uses
 * AVX2 or AVX-512 intrinsics for its whole vectors, since the loop compiles to a tangle of
 * mask operations (0.6 cycles an element on the avx512 tier).
 */
#ifndef CM_TIER
#error "define CM_TIER (scalar, avx2, avx512) before including elementwise-impl.h"
#endif

#include <stdint.h>
#include <string.h>

#include "common/numeric.h"
#include "common/ukernels.h"

#ifdef __AVX__
#include <immintrin.h>
#endif

#define CM_CAT_(a, b) a##__##b
#define CM_CAT(a, b) CM_CAT_(a, b)
#define CM_TIERED(name) CM_CAT(name, CM_TIER)

void CM_TIERED(cm_silu_mul)(size_t n, const float *restrict gate, const float *restrict up,
                            float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_siluf(gate[i]) * up[i];
}

void CM_TIERED(cm_gelu_mul)(size_t n, const float *restrict gate, const float *restrict up,
                            float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_geluf(gate[i]) * up[i];
}

void CM_TIERED(cm_swiglu)(size_t n, const float *restrict gate, const float *restrict up,
                          float alpha, float limit, float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_swiglu_clampf(gate[i], up[i], alpha, limit);
}

void CM_TIERED(cm_silu_clamp)(size_t n, const float *restrict gate, const float *restrict up,
                              float limit, float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_silu_clampf(gate[i], up[i], limit);
}

void CM_TIERED(cm_exp_shifted)(size_t n, const float *restrict x, float shift,
                               float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_expf(x[i] - shift);
}

void CM_TIERED(cm_sigmoid)(size_t n, const float *restrict x, float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_sigmoidf(x[i]);
}

void CM_TIERED(cm_sqrtsoftplus)(size_t n, const float *restrict x, float *restrict out) {
  for (size_t i = 0; i < n; i++) out[i] = cm_sqrtsoftplusf(x[i]);
}

void CM_TIERED(cm_widen_bf16)(size_t n, const uint16_t *restrict src, float *restrict dst) {
  for (size_t i = 0; i < n; i++) dst[i] = cm_bf16_to_f32(src[i]);
}

void CM_TIERED(cm_widen_f16)(size_t n, const uint16_t *restrict src, float *restrict dst) {
  for (size_t i = 0; i < n; i++) dst[i] = cm_f16_to_f32(src[i]);
}

void CM_TIERED(cm_narrow_bf16)(size_t n, const float *restrict src, uint16_t *restrict dst) {
  for (size_t i = 0; i < n; i++) dst[i] = cm_f32_to_bf16(src[i]);
}

void CM_TIERED(cm_narrow_f16)(size_t n, const float *restrict src, uint16_t *restrict dst) {
  for (size_t i = 0; i < n; i++) dst[i] = cm_f32_to_f16(src[i]);
}

void CM_TIERED(cm_round_bf16)(size_t n, float *restrict v) {
  for (size_t i = 0; i < n; i++) v[i] = cm_round_bf16(v[i]);
}

void CM_TIERED(cm_round_f16)(size_t n, float *restrict v) {
  for (size_t i = 0; i < n; i++) v[i] = cm_round_f16(v[i]);
}

void CM_TIERED(cm_axpy)(size_t n, float a, const float *restrict x, float *restrict y) {
  for (size_t i = 0; i < n; i++) y[i] = y[i] + a * x[i];
}

float CM_TIERED(cm_absmax)(size_t n, const float *restrict x, float m) {
  /* |x| ordered as floats is |x|'s bit pattern ordered as unsigned integers, NaN patterns
   * above inf: an integer max is exact, order-free (every tier gives the same bits), makes
   * the result NaN when any input is NaN, and vectorizes (a float max reduction does not
   * under strict IEEE semantics). */
  uint32_t best = cm_f32_bits(m) & 0x7fffffffu;
  for (size_t i = 0; i < n; i++) {
    const uint32_t b = cm_f32_bits(x[i]) & 0x7fffffffu;
    best = b > best ? b : best;
  }
  return cm_f32_from_bits(best);
}

/* The vectors of quantize_u8 give the loop's codes: NaN is zeroed first, and since the clamp
 * bounds are integers, clamping before the conversion's rounding (the current mode, round to
 * nearest even, as nearbyintf) equals clamping after it. */
void CM_TIERED(cm_quantize_u8)(size_t n, const float *restrict x, float inv_scale,
                               uint8_t *restrict q) {
  size_t i = 0;
#if defined(__AVX512F__)
  const __m512 s16 = _mm512_set1_ps(inv_scale);
  const __m512 lo16 = _mm512_set1_ps(-127.0f), hi16 = _mm512_set1_ps(127.0f);
  const __m512i offset16 = _mm512_set1_epi32(128);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), s16);
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
    v = _mm512_min_ps(_mm512_max_ps(v, lo16), hi16);
    const __m512i code = _mm512_add_epi32(_mm512_cvtps_epi32(v), offset16);
    _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(code));
  }
#elif defined(__AVX2__)
  const __m256 s8 = _mm256_set1_ps(inv_scale);
  const __m256 lo8 = _mm256_set1_ps(-127.0f), hi8 = _mm256_set1_ps(127.0f);
  const __m256i offset8 = _mm256_set1_epi32(128);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s8);
    v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
    v = _mm256_min_ps(_mm256_max_ps(v, lo8), hi8);
    const __m256i code = _mm256_add_epi32(_mm256_cvtps_epi32(v), offset8);
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64((__m128i *)(q + i), _mm_packus_epi16(words, words));
  }
#endif
  for (; i < n; i++) {
    float v = nearbyintf(x[i] * inv_scale); /* round half to even (default rounding mode) */
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    v = v == v ? v : 0.0f; /* NaN (its row's scale is NaN too): any code, no UB */
    q[i] = (uint8_t)(int32_t)(v + 128.0f);
  }
}

void CM_TIERED(cm_bias_scale)(size_t n, const float *restrict c, const float *restrict bias,
                              float g, float *restrict y) {
  if (bias)
    for (size_t i = 0; i < n; i++) y[i] = (c[i] + bias[i]) * g;
  else
    for (size_t i = 0; i < n; i++) y[i] = c[i] * g;
}

void CM_TIERED(cm_scale_rows)(size_t rows, size_t n, float *c, const float *g) {
  for (size_t r = 0; r < rows; r++) {
    float *restrict cr = c + r * n;
    const float gr = g[r];
    for (size_t i = 0; i < n; i++) cr[i] *= gr;
  }
}

/* Streaming stores (vmovntps, 8 floats each) on the tiers built with AVX, for 64-byte aligned
 * rows of a multiple of 16 floats; otherwise plain bias_scale (contract: common/ukernels.h).
 * The arithmetic is bias_scale's: an add, then a multiply. */
void CM_TIERED(cm_bias_scale_stream)(size_t n, const float *restrict c, const float *restrict bias,
                                     float g, float *restrict y) {
#ifdef __AVX__
  if (n % 16 == 0 && (uintptr_t)y % 64 == 0) {
    const __m256 gv = _mm256_set1_ps(g);
    for (size_t i = 0; i < n; i += 8) {
      __m256 v = _mm256_loadu_ps(c + i);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
      _mm256_stream_ps(y + i, _mm256_mul_ps(v, gv));
    }
    return;
  }
#endif
  CM_TIERED(cm_bias_scale)(n, c, bias, g, y);
}

/* Streaming stores (vmovntdq, 32 bytes each) on the tiers built with AVX, for a 64-byte
 * aligned destination and a multiple of 64 bytes; otherwise memcpy (contract:
 * common/ukernels.h). */
void CM_TIERED(cm_copy_stream)(size_t bytes, const void *restrict src, void *restrict dst) {
#ifdef __AVX__
  if (bytes % 64 == 0 && (uintptr_t)dst % 64 == 0) {
    const char *s = (const char *)src;
    char *d = (char *)dst;
    for (size_t i = 0; i < bytes; i += 32)
      _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    return;
  }
#endif
  memcpy(dst, src, bytes);
}

void CM_TIERED(cm_fp8_fold)(size_t mr, const float *restrict p, const float *restrict scale,
                            float *restrict c, int accumulate, float post) {
  if (post == 1.0f) { /* x * 1 is x: spare the multiply */
    for (size_t r = 0; r < mr; r++)
      for (size_t n = 0; n < CM_NR; n++)
        c[r * CM_NR + n] = fmaf(p[r * CM_NR + n], scale[n], accumulate ? c[r * CM_NR + n] : 0.0f);
    return;
  }
  for (size_t r = 0; r < mr; r++)
    for (size_t n = 0; n < CM_NR; n++)
      c[r * CM_NR + n] =
          fmaf(p[r * CM_NR + n], scale[n], accumulate ? c[r * CM_NR + n] : 0.0f) * post;
}
