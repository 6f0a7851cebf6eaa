/*
 * MXFP4 (OCP MX fp4, gpt-oss) numbers and the packed layout's geometry, shared by every
 * tier: static inline, baseline-safe C.
 *
 * A weight is a 4-bit e2m1 code (bit 3 the sign, bits 2..1 the exponent, bit 0 the
 * mantissa: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^(s - 127), s the e8m0 scale
 * byte of its row and group of 32 consecutive k. Decoding is to bf16 and exact: every
 * such product with |v| < 2^128 is a bf16 number (scales 0 and 1 make bf16 denormals:
 * 0.5 * 2^-127 = 2^-128 is one), larger ones become +-inf, and the zero codes 0x0 and 0x8
 * both give +0, as SGLang's kernels write them. Scale 255 is 2^128 like any other byte
 * (SGLang's formula; the OCP MX spec would call it NaN): it gives +-2^127 for the codes of
 * magnitude 0.5, +-inf for larger ones, 0 for zero codes.
 *
 * Packed layout (docs/FORMATS.md): a 32-row block stores, per k pair (2k, 2k+1), 32 bytes;
 * byte j holds in its low nibble the code of row j/2 and in its high nibble that of row
 * 16 + j/2, for k = 2kp + j%2. So expanding the low nibbles of a k pair's 32 bytes gives
 * bf16 VNNI-2 order for rows 0..15 (word j: row j/2, k parity j%2), the high nibbles the
 * same for rows 16..31: the 16-bit B tile's 128 bytes. The block's scales are packed
 * [groups][32]: group g's 32 bytes, one per row.
 */
#ifndef CPUMOE_COMMON_MXFP4_H
#define CPUMOE_COMMON_MXFP4_H

#include <stddef.h>
#include <stdint.h>

#include "common/numeric.h"

#define CM_MXFP4_GROUP 32    /* k per e8m0 scale */
#define CM_MXFP4_KP_BYTES 32 /* packed bytes of one k pair of a 32-row block */
#define CM_MXFP4_GROUP_KP 16 /* k pairs per group */
#define CM_MXFP4_GROUP_BYTES (CM_MXFP4_GROUP_KP * CM_MXFP4_KP_BYTES) /* 512 */

/* bf16 bits of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7) */
static inline uint16_t cm_e2m1_bf16(unsigned code) {
  static const uint16_t magnitude[8] = {0x0000, 0x3f00, 0x3f80, 0x3fc0,
                                        0x4000, 0x4040, 0x4080, 0x40c0};
  return (uint16_t)(magnitude[code & 7] | ((code & 8) << 12));
}

/* The exact bf16 bits of e2m1(code) * 2^(scale - 127) (see the header). The magnitude's
 * bf16 exponent moves by scale - 127: a result exponent in 1..254 is that normal number; at
 * 255 or more it overflows to inf; at 0 or -1 (scales 0 and 1 only) it is the denormal
 * (1.m) * 2^(exponent - 127) = (128 + mantissa) >> (1 - exponent) units of 2^-133, exact
 * because the e2m1 mantissa is one bit (64 or 96, 32 or 48). */
static inline uint16_t cm_mxfp4_to_bf16(unsigned code, unsigned scale) {
  if ((code & 7) == 0) return 0;
  const uint16_t sign = (uint16_t)((code & 8) << 12), bits = cm_e2m1_bf16(code & 7);
  const int exponent = (bits >> 7) + (int)(scale & 255) - 127, mantissa = bits & 0x7f;
  if (exponent >= 255) return (uint16_t)(sign | 0x7f80);
  if (exponent >= 1) return (uint16_t)(sign | (exponent << 7) | mantissa);
  return (uint16_t)(sign | ((128 + mantissa) >> (1 - exponent)));
}

/* The SIMD decoders' fast route. For a scale s in [CM_MXFP4_FAST_MIN, CM_MXFP4_FAST_MAX]
 * every nonzero code decodes to a normal bf16 (0.5 * 2^(s - 127) >= 2^-126 and
 * 6 * 2^(s - 127) < 2^128), whose bits are one saturating 16-bit subtraction:
 *   bits = max(cm_mxfp4_scale_word(s) - cm_mxfp4_code_word(code), 0)
 * with a per-scale word A(s) = (s << 7) + 0x8140 and a 16-entry table of the codes:
 *   positive code, magnitude m:  0x81c0 - T(m);   negative code:  0x01c0 - T(m);
 *   zero codes (0x0, 0x8):       0xffff,          which saturates to +0.
 * T(m) = 0, 0x80, 0xc0, 0x100, 0x140, 0x180, 0x1c0 for m = 1..7 is the offset of
 * magnitude m's bf16 bits from those of 0.5 (exponent and mantissa bit 6). A - table is
 * (s - 1) << 7 (the exponent of 0.5 * 2^(s - 127)) + T(m), plus 0x8000 exactly when the
 * code is negative: the 0x8000 in A cancels against the table's for positive codes. For s
 * in the range A(s) <= 0xff40, so a zero code's 0xffff always saturates, and A(s) >= 0x8240
 * >= every positive code's word, so no other code saturates. A group of 32 k whose scales
 * all lie in the range takes this route; any other group is decoded by cm_mxfp4_to_bf16. */
#define CM_MXFP4_FAST_MIN 2
#define CM_MXFP4_FAST_MAX 252

static inline uint16_t cm_mxfp4_scale_word(unsigned scale) {
  return (uint16_t)((scale << 7) + 0x8140u);
}

/* the table above, code 0..15 */
#define CM_MXFP4_CODE_WORDS                                                                       \
  0xffff, 0x81c0, 0x8140, 0x8100, 0x80c0, 0x8080, 0x8040, 0x8000, 0xffff, 0x01c0, 0x0140, 0x0100, \
      0x00c0, 0x0080, 0x0040, 0x0000

static inline uint16_t cm_mxfp4_code_word(unsigned code) {
  static const uint16_t words[16] = {CM_MXFP4_CODE_WORDS};
  return words[code & 15];
}

/* 1 when the 32 scales of a group all lie in the fast route's range */
static inline int cm_mxfp4_group_fast(const uint8_t *scales) {
  int fast = 1;
  for (int n = 0; n < 32; n++)
    fast &= scales[n] >= CM_MXFP4_FAST_MIN && scales[n] <= CM_MXFP4_FAST_MAX;
  return fast;
}

/* The decode kernels' read-ahead of the scales, which live apart from the codes: the line
 * of the group that lies `code_bytes` of codes ahead of this one (where the codes' own
 * read-ahead into L2 is), into L2. A hint: past the end it is harmless. */
static inline void cm_mxfp4_prefetch_scales(const uint8_t *group_scales, size_t code_bytes) {
  __builtin_prefetch(group_scales + code_bytes / CM_MXFP4_GROUP_BYTES * 32, 0, 2);
}

/* The code of row n (0..31) at k within a 32-row block's packed k pair `kp_bytes` (k % 2
 * selects the byte of the pair, n / 16 the nibble). */
static inline unsigned cm_mxfp4_code(const uint8_t *kp_bytes, size_t n, size_t k) {
  const uint8_t byte = kp_bytes[2 * (n & 15) + (k & 1)];
  return n < 16 ? byte & 15u : (unsigned)byte >> 4;
}

/* One group (16 k pairs, 32 rows) decoded exactly into bf16 VNNI-2 order, the 16-bit B
 * tile's [16][32][2]: dst[kp * 64 + 2 n + k % 2]. `b`: the group's 512 packed bytes,
 * `scales`: its 32 scales. */
static inline void cm_mxfp4_decode_group(const uint8_t *b, const uint8_t *scales, uint16_t *dst) {
  for (size_t kp = 0; kp < CM_MXFP4_GROUP_KP; kp++)
    for (size_t n = 0; n < 32; n++)
      for (size_t k = 0; k < 2; k++)
        dst[kp * 64 + 2 * n + k] =
            cm_mxfp4_to_bf16(cm_mxfp4_code(b + kp * CM_MXFP4_KP_BYTES, n, k), scales[n]);
}

#endif /* CPUMOE_COMMON_MXFP4_H */
