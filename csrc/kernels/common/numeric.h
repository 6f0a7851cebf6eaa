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
/* The clamp bounds, -87 and 88, defined in common/numeric.c rather than written here: with
 * constants GCC's partial redundancy elimination evaluates the rest of cm_expf for each
 * clamped branch, and the loop's three-way merge then defeats if-conversion, so with AVX2
 * flags (not AVX-512's masks) no loop over cm_expf was vectorized: cm_silu_mul__avx2 ran
 * scalar, 4 % of Qwen3 INT4 M = 512 on the avx2 tier. Values from memory give the same bits. */
extern const float cm_expf_clamp[2];
static inline float cm_expf(float x) {
  x = x < cm_expf_clamp[0] ? cm_expf_clamp[0] : x;
  x = x > cm_expf_clamp[1] ? cm_expf_clamp[1] : x;
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

/*
 * erf-GELU, x * Phi(x) with Phi the standard normal CDF, accurate in both tails (the usual
 * 0.5 x (1 + erf(x / sqrt2)) cancels in 1 + erf: in fp32 it is 0 from x = -6 on).
 * Phi comes from erfc(z), z = |x| / sqrt2, in one branch-free form for all z >= 0:
 *   erfc(z) = t exp(P(t) - z^2),  t = 2 / (2 + z),
 * with P our degree-9 least-squares fit of log(erfc(z) / t) + z^2 over z in [0, 9.4]
 * (|error| < 4.3e-8, i.e. that relative error in erfc). z^2 = x^2 / 2 is split into its
 * rounded value zz and the exact rest lo (fmaf), and P - zz into its rounded sum s and
 * that sum's error (Fast2Sum, exact when zz >= |P|, and harmless otherwise since both are
 * then small), so exp is taken of s and the two small parts enter as a first-order factor:
 * erfc = t exp(s) (1 + err - lo). Then Phi = erfc / 2 for x < 0 and 1 - erfc / 2 otherwise
 * (an exact subtraction for erfc <= 1). In the left tail exp(s) leaves the normal floats
 * (s < -87.3, where cm_expf also clamps), though x Phi(x) stays normal down to x = -13.2:
 * below s = -64 the exponent is shifted by 22.1875 (the sum is exact: both on the 2^-17
 * grid) and exp(-22.1875) applied last, after x, so only a denormal result is rounded as
 * one. Beyond zz = 104 (|x| > 14.4), where the shifted argument would reach cm_expf's clamp,
 * x Phi(x) is below 2^-150, so 0 is its correctly rounded value. Measured
 * against float64 over [-14, 14]: relative error < 4.3e-7 (about 6 ulp) wherever the
 * result is a normal float. NaN gives NaN, +inf gives +inf, -inf gives NaN (-inf * 0, as
 * torch's gelu). The operation sequence is the contract, as for cm_expf.
 */
static inline float cm_geluf(float x) {
  const float h = 0.5f * x;
  const float zz = h * x;
  const float lo = fmaf(h, x, -zz);
  const float t = 2.0f / (2.0f + fabsf(x) * 0.707106781f);
  float p = 1.372142285e-01f;
  p = fmaf(p, t, -6.386329532e-01f);
  p = fmaf(p, t, 1.057038665e+00f);
  p = fmaf(p, t, -5.630434155e-01f);
  p = fmaf(p, t, -1.908636242e-01f);
  p = fmaf(p, t, 6.022059545e-02f);
  p = fmaf(p, t, 1.448902208e-02f);
  p = fmaf(p, t, 3.908611834e-01f);
  p = fmaf(p, t, 9.981399775e-01f);
  p = fmaf(p, t, -1.265423656e+00f);
  const float s = p - zz;
  const float err = p - (s + zz);
  const int deep = s < -64.0f;
  const float e = cm_expf(deep ? s + 22.1875f : s);
  const float q = zz < 104.0f ? (0.5f * t) * fmaf(e, err - lo, e) : 0.0f;
  const float scale = deep ? 2.312550290e-10f : 1.0f; /* exp(-22.1875) */
  return x < 0.0f ? (x * q) * scale : x * (1.0f - q * scale);
}

/* min/max with x86 vminps/vmaxps semantics (second operand wins on NaN or equal),
 * written with the NaN-carrying value second so that NaN propagates. */
static inline float cm_minf(float a, float b) {
  return a < b ? a : b;
}
static inline float cm_maxf(float a, float b) {
  return a > b ? a : b;
}

/* The up clamp of the clamped activations: x limited to [-limit, limit], NaN kept (the
 * gate's clamp is cm_minf(limit, gate), which keeps NaN too). */
static inline float cm_clamp_symf(float x, float limit) {
  return cm_maxf(-limit, cm_minf(limit, x));
}

/* GPT-OSS clamped SwiGLU on one (gate, up) pair. */
static inline float cm_swiglu_clampf(float gate, float up, float alpha, float limit) {
  gate = cm_minf(limit, gate);
  up = cm_clamp_symf(up, limit);
  const float s = 1.0f / (1.0f + cm_expf(-(alpha * gate)));
  return (gate * s) * (up + 1.0f);
}

/* DeepSeek-V4's clamped SiLU*mul on one (gate, up) pair: cm_siluf's bits times up whenever
 * neither is clamped (limit >= 0, checked by the caller; +inf clamps nothing). */
static inline float cm_silu_clampf(float gate, float up, float limit) {
  return cm_siluf(cm_minf(limit, gate)) * cm_clamp_symf(up, limit);
}

#endif /* CPUMOE_COMMON_NUMERIC_H */
