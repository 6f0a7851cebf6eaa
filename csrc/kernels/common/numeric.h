/*
 * Scalar number formats shared by every tier: bf16 and fp16 <-> fp32, and the
 * fp32 exp/SiLU/sigmoid used by the activations and the routing scores (with the
 * log1p behind sqrtsoftplus).
 *
 * Everything here is `static inline` and written so that a loop over it,
 * compiled with any tier's flags (-ffp-contract=off, fmaf for every fused
 * multiply-add), gives the same bits as the scalar tier: the SIMD tiers either
 * auto-vectorize these very functions or mirror them op for op.
 */
#ifndef CPUMOE_COMMON_NUMERIC_H
#define CPUMOE_COMMON_NUMERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t cm_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static inline float cm_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* bf16 is the top half of an fp32: widening is exact. */
static inline float cm_bf16_to_f32(uint16_t h) {
  return cm_f32_from_bits((uint32_t)h << 16);
}

/* Round to nearest even; NaN stays NaN (quiet), with its sign. */
static inline uint16_t cm_f32_to_bf16(float f) {
  uint32_t u = cm_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Exact fp16 -> fp32, subnormals, infinities and NaN payloads included
 * (what F16C's vcvtph2ps does). */
static inline float cm_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return cm_f32_from_bits(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    /* zero or subnormal: mant * 2^-24, exact in fp32 */
    float v = (float)mant * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return cm_f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* fp32 -> fp16, round to nearest even, overflow to inf, NaN quieted with the
 * top mantissa bits kept (matches F16C's vcvtps2ph with imm 0). */
static inline uint16_t cm_f32_to_f16(float f) {
  uint32_t u = cm_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (abs < 0x38800000u) {
    /* result is subnormal or zero: value / 2^-24, rounded to nearest even */
    if (abs < 0x33000000u) return sign; /* below half of the smallest subnormal */
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp; /* 14..24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = abs - 0x38000000u; /* rebias exponent 127 -> 15 */
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

/* fp8 e4m3fn -> fp32, exact, times 2^-8: the byte s.eeee.mmm placed in fp16 position is
 * that fp16 number (subnormals and zero included); the NaN codes 0x7f/0xff give NaN.
 * Multiplying by 2^8 gives the value exactly (cm_e4m3_to_f32). */
static inline float cm_e4m3_to_f32_scaled(uint8_t b) {
  uint16_t h = (uint16_t)(((b & 0x7fu) << 7) | ((b & 0x80u) << 8));
  if ((b & 0x7fu) == 0x7fu) h |= 0x7c00u;
  return cm_f16_to_f32(h);
}

/* fp8 e4m3fn -> fp32, exact (times 2^8 is exact too). */
static inline float cm_e4m3_to_f32(uint8_t b) {
  return cm_e4m3_to_f32_scaled(b) * 256.0f;
}

/* The value an fp32 takes once stored in a 16-bit activation dtype. */
static inline float cm_round_bf16(float f) {
  return cm_bf16_to_f32(cm_f32_to_bf16(f));
}
static inline float cm_round_f16(float f) {
  return cm_f16_to_f32(cm_f32_to_f16(f));
}

/*
 * exp(x) for the activations: Cody-Waite reduction by ln2 and a degree-6
 * polynomial (Cephes expf coefficients), rel. error ~1 ulp on the clamped range.
 * Inputs are clamped to [-87, 88] so that 2^n stays a normal number; a NaN input
 * passes the clamps (comparisons are false) and gives NaN.
 * The operation sequence is the contract: SIMD versions repeat it exactly.
 */
#define CM_EXP_MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer (RNE) */
static inline float cm_expf(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float t = x * 1.44269504088896341f + CM_EXP_MAGIC;
  const float n = t - CM_EXP_MAGIC;
  float r = fmaf(n, -0.693359375f, x);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r) + 1.0f;
  /* t's bits are magic's bits + n (|n| <= 127): build 2^n without a float->int cast */
  const uint32_t two_n = ((cm_f32_bits(t) - cm_f32_bits(CM_EXP_MAGIC)) + 127u) << 23;
  return p * cm_f32_from_bits(two_n);
}

static inline float cm_sigmoidf(float x) {
  return 1.0f / (1.0f + cm_expf(-x));
}

/*
 * log(w) for w in [1, 2], all that cm_log1pf needs: w = 2^e * m with m in [sqrt(1/2),
 * sqrt(2)), f = m - 1 (exact), log(m) = f - f^2/2 + f^3 P(f) with the Cephes logf
 * polynomial, plus e * ln2 in two parts. A NaN input gives NaN. The operation sequence is
 * the contract, as for cm_expf.
 */
static inline float cm_log_1_2f(float w) {
  const float e = w > 1.41421356237f ? 1.0f : 0.0f;
  const float f = (e != 0.0f ? w * 0.5f : w) - 1.0f;
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = fmaf(p, f, -1.1514610310e-1f);
  p = fmaf(p, f, 1.1676998740e-1f);
  p = fmaf(p, f, -1.2420140846e-1f);
  p = fmaf(p, f, 1.4249322787e-1f);
  p = fmaf(p, f, -1.6668057665e-1f);
  p = fmaf(p, f, 2.0000714765e-1f);
  p = fmaf(p, f, -2.4999993993e-1f);
  p = fmaf(p, f, 3.3333331174e-1f);
  float y = (p * f) * z;
  y = fmaf(e, -2.12194440e-4f, y);
  y = fmaf(z, -0.5f, y);
  return fmaf(e, 0.693359375f, f + y);
}

/* log(1 + u) for u in [0, 1]: w = 1 + u is rounded, but d = w - 1 is exact, and
 * log(w) * (u / d) corrects for the rounding (Goldberg's formula; a few ulp). */
static inline float cm_log1pf(float u) {
  const float w = 1.0f + u;
  const float d = w - 1.0f;
  return d == 0.0f ? u : cm_log_1_2f(w) * (u / d);
}

/* sqrt(softplus(x)) = sqrt(log(1 + exp(x))), DeepSeek-V4's router score: softplus as
 * max(x, 0) + log1p(exp(-|x|)), which loses nothing for large |x|; below -16 softplus(x)
 * is exp(x) to within half an ulp, so the result is exp(x / 2). NaN gives NaN. */
static inline float cm_sqrtsoftplusf(float x) {
  if (x < -16.0f) return cm_expf(0.5f * x);
  return sqrtf((x > 0.0f ? x : 0.0f) + cm_log1pf(cm_expf(-fabsf(x))));
}
static inline float cm_siluf(float x) {
  return x / (1.0f + cm_expf(-x));
}

/* min/max with x86 vminps/vmaxps semantics (second operand wins on NaN or equal),
 * written with the NaN-carrying value second so that NaN propagates. */
static inline float cm_minf(float a, float b) {
  return a < b ? a : b;
}
static inline float cm_maxf(float a, float b) {
  return a > b ? a : b;
}

/* GPT-OSS clamped SwiGLU on one (gate, up) pair. */
static inline float cm_swiglu_clampf(float gate, float up, float alpha, float limit) {
  gate = cm_minf(limit, gate);
  up = cm_minf(limit, up);
  up = cm_maxf(-limit, up);
  const float s = 1.0f / (1.0f + cm_expf(-(alpha * gate)));
  return (gate * s) * (up + 1.0f);
}

#endif /* CPUMOE_COMMON_NUMERIC_H */
