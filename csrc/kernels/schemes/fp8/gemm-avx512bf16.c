/*
 * AVX512_BF16 kernels for FP8 (e4m3fn) W8A16: each weight decoded exactly to bf16 by byte
 * table lookups (VBMI), then vdpbf16ps against bf16 activation pairs, two k per instruction;
 * scaled per 2-D block (contracts: common/ukernels.h).
 *
 *   A panel: bf16 pairs, high first: a_pairs[kp * a_stride + r] holds row r's k = 2kp in
 *            bits 31..16 and k = 2kp + 1 in bits 15..0.
 *   B:       fp8 VNNI-2 [kc/2][32][2] (docs/FORMATS.md): per k pair 64 bytes, columns
 *            0..15 in bytes 0..31, 16..31 in 32..63; byte pair = (k even, k odd) of a column.
 *   scale:   fp32 [32], each column's scale for this K block.
 *   C:       fp32 [mr][32].
 *   Math:    P = the chain over the call's k of a * d from +0, d = e4m3(code) * 2^-8, then
 *            C = fma(P, scale, accumulate ? C : +0); the pipeline multiplies the finished C
 *            by 2^8.
 *
 * Exact decoding: d as bf16 is exact for all 256 codes: bf16 has 8 exponent bits, so the
 * e4m3 subnormals (m * 2^-9, times 2^-8) are bf16 normals and no input of vdpbf16ps is
 * denormal; 0x7f / 0xff give the quiet bf16 NaNs 0x7ff0 / 0xfff0 (e4m3fn has no
 * infinities). The bf16 bits depend on the code's 7 value bits, and its sign is bit 15:
 * byte permutes look up the low and the high byte of each code's bits (decode_bytes), the
 * sign is or-ed into the high byte, and the two byte vectors are interleaved into the 32
 * dwords of the k pair. No microcode assist on any code.
 *
 * Cost, and why it is spent this way (instruction costs measured on the Xeon of
 * docs/NUMERICS.md): vdpbf16ps zmm issues once per 2 cycles and occupies port 5 for both,
 * the port every shuffle needs (vpermb, vpunpck*: 1 cycle; vpermi2b, vpermt2b: 2). So the
 * decode keeps to 5 shuffle cycles per 64 bytes (one vpermi2b, one vpermb, two unpacks) and
 * two ternary-logic ops, which issue on either vector port, where the avx512 tier's decode
 * spends ~19 vector uops. Its two rotates, measured later (docs/PERFORMANCE-HISTORY.md,
 * "MXFP4 decode on the AMX tier"), also issue on the shuffle port; its word shift is a
 * multiply, which does not. At one row that port and the two accumulator chains (one
 * vdpbf16ps per k pair each, ~9 cycles of latency) both come to ~9.5 cycles per k pair,
 * so the multiply did not show there; to_bf16, which has no chains, gained from it. Its
 * speed against the avx512 kernel: docs/PERFORMANCE-HISTORY.md.
 *
 * Order of the sums (decode kernel): the interleave puts k even in each dword's high half,
 * as in A, and vdpbf16ps adds the high pair's product first, then the low pair's, each a
 * fused step rounded to nearest even (docs/NUMERICS.md, "bf16 dot products and AMX on
 * silicon"): P is fmaf(a[k+1], d[k+1], fmaf(a[k], d[k], P)) chained over k, the fp32-chain
 * tiers' bits, except that vdpbf16ps treats denormal inputs and accumulators as zero and
 * flushes denormal results (DAZ, FTZ): an A that is denormal or products near 2^-126.
 *
 * Two kernels:
 *   cm_fp8_gemm_pairs_mrx32 (mr <= 4) decodes in registers, nothing stored. Tile 4 x 32,
 *           8 accumulators: the decode is shared by the rows, but each row adds 2 vdpbf16ps
 *           (4 port-5 cycles) per k pair, so at 4 rows they already take 16 of ~22 cycles.
 *           The avx512bf16 config gives it blocks of 1 row only (dispatch/config.c); larger
 *           blocks keep the avx512 tier's chunk path.
 *   cm_fp8_to_bf16 decodes a chunk once to bf16 VNNI-2 in memory order (the layout of
 *           16-bit weights): the amx tier's FP8 chunk path feeds it to the tile GEMM
 *           (tiles/gemm-amx.c); tests/c/kernels checks that it followed by
 *           cm_bf16_gemm_pairs_mrx32 and the fold equals the register decode.
 */
#include <immintrin.h>
#include <string.h>

#include "common/tile-avx512bf16.h"
#include "common/ukernels.h"

#define MR_DECODE 4
/* Decode prefetch, bytes of weights ahead: prefetcht0 1 KiB and prefetcht1 8 KiB, one line
 * per k pair, as the avx512 fp8 kernel. Pairs from 512 B + 4 KiB to 2 KiB + 32 KiB did
 * about as well at M=1 from DRAM; prefetcht1 alone (4 or 8 KiB), which suits the bf16
 * kernel, was slower here (docs/PERFORMANCE-HISTORY.md). */
#define CM_FP8_PREFETCH_L1_BYTES 1024
#define CM_FP8_PREFETCH_L2_BYTES 8192
/* to_bf16's own read-ahead into L1, on top of the share of the chunk that the tile GEMM
 * before it requested into L2: FP8 M=512 about 3 % and M=64 about 5 % faster; 512 B and
 * 2 KiB did as well, adding prefetcht1 8 KiB ahead was slower (docs/PERFORMANCE-HISTORY.md,
 * "FP8 prefill on the AMX tier, taken apart"). */
#define CM_FP8_CHUNK_PREFETCH_BYTES 1024

/* ---- tables ------------------------------------------------------------------------------
 * bf16 bits of e4m3(m) * 2^-8 for the 7 value bits m = eeee.mmm: normal codes (e >= 1) have
 * exponent e - 7 - 8 + 127 = e + 112 and the 3 mantissa bits at the top of bf16's 7, which
 * is 0x3800 + (m << 4); the subnormals f * 2^-17 (f = 1..7) are normalized by hand. 0x7f is
 * the formula's 0x3ff0 with the exponent all ones: the quiet NaN 0x7ff0. */
#define CM_E4M3_SUB(f)                   \
  ((f) == 1   ? 0x3700 /* 2^-17 */       \
   : (f) == 2 ? 0x3780 /* 2^-16 */       \
   : (f) == 3 ? 0x37c0 /* 1.5 * 2^-16 */ \
              : 0x3800 + (((f) - 4) << 5) /* (1 + (f - 4) / 4) * 2^-15 */)
#define CM_E4M3_BF16(m) \
  ((m) == 0 ? 0x0000 : (m) == 0x7f ? 0x7ff0 : (m) < 8 ? CM_E4M3_SUB(m) : 0x3800 + ((m) << 4))
#define CM_LO(m) (uint8_t)(CM_E4M3_BF16(m) & 0xff)
#define CM_HI(m) (uint8_t)(CM_E4M3_BF16(m) >> 8)
#define CM_ROW8(F, m) F(m), F(m + 1), F(m + 2), F(m + 3), F(m + 4), F(m + 5), F(m + 6), F(m + 7)
#define CM_TABLE64(F)                                                                           \
  CM_ROW8(F, 0), CM_ROW8(F, 8), CM_ROW8(F, 16), CM_ROW8(F, 24), CM_ROW8(F, 32), CM_ROW8(F, 40), \
      CM_ROW8(F, 48), CM_ROW8(F, 56)
#define CM_TABLE128(F)                                                                           \
  CM_TABLE64(F), CM_ROW8(F, 64), CM_ROW8(F, 72), CM_ROW8(F, 80), CM_ROW8(F, 88), CM_ROW8(F, 96), \
      CM_ROW8(F, 104), CM_ROW8(F, 112), CM_ROW8(F, 120)

/* Low bytes of codes 0-63 (64) and high bytes of codes 0-127 (128). Read-only: 192 bytes
 * that stay in L1 while a kernel runs. */
static const uint8_t cm_e4m3_tables[192]
    __attribute__((aligned(64))) = {CM_TABLE64(CM_LO), CM_TABLE128(CM_HI)};

typedef struct e4m3_decoder {
  __m512i lo;       /* low bytes, codes 0-63 */
  __m512i hi0, hi1; /* high bytes, codes 0-63 and 64-127 */
  __m512i sign;     /* 0x80 in every byte */
  __m512i bit4;     /* 0x10 in every byte */
} e4m3_decoder;

static inline __attribute__((always_inline)) e4m3_decoder decoder_load(void) {
  return (e4m3_decoder){_mm512_load_si512(cm_e4m3_tables), _mm512_load_si512(cm_e4m3_tables + 64),
                        _mm512_load_si512(cm_e4m3_tables + 128), _mm512_set1_epi8((char)0x80),
                        _mm512_set1_epi8(0x10)};
}

/* The low and high bytes of the bf16 bits of 64 codes, each in its code's byte position.
 * Port 5 is the scarce one (vdpbf16ps and every shuffle run there), so:
 *   low byte: one 64-entry vpermb (it reads index bits 5..0) instead of a 128-entry vpermi2b
 *     (two uops): codes 64..127 (bit 6 set) are all normal, with the low byte (m & 15) << 4,
 *     so setting their bit 4 sends them to slot (m & 63) | 16, a normal code of the same low
 *     nibble (for 0x7f slot 63, whose 0xf0 makes the NaN 0x7ff0). Bit 6 moved to bit 4 by a
 *     shift, merged by a ternary-logic op: both off port 5.
 *   high byte: a 128-entry vpermi2b (it ignores the sign bit), then the sign or-ed in. */
static inline __attribute__((always_inline)) void decode_bytes(const e4m3_decoder *d, __m512i raw,
                                                               __m512i *lo, __m512i *hi) {
  /* raw | ((raw >> 2) & 0x10): bit 6 of each byte to bit 4 (the word shift stays in the
   * byte; as a multiply, off port 5) */
  const __m512i slot =
      _mm512_ternarylogic_epi32(raw, cm_srli_epi16_mul__avx512(raw, 2), d->bit4, 0xf8);
  *lo = _mm512_permutexvar_epi8(slot, d->lo);
  /* hi | (raw & 0x80) */
  *hi =
      _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(d->hi0, raw, d->hi1), raw, d->sign, 0xf8);
}

/* Decode kernel. The bytes are interleaved within 128-bit lanes (vpunpck[lh]bw, one uop each
 * where a full permute takes two): lane l of the unpack-low vector holds columns 8l..8l+3,
 * of the unpack-high vector 8l+4..8l+7, each dword (k even, k odd); a rotate (port 0) makes
 * it high first. So accumulator p0 holds columns {0-3, 8-11, 16-19, 24-27}, p1 the others,
 * put back in order once, before the fold. */
static inline __attribute__((always_inline)) void gemm_body(const int mr, size_t kc,
                                                            const uint32_t *restrict a, size_t as,
                                                            const uint8_t *restrict b,
                                                            const float *restrict scale,
                                                            float *restrict c, int accumulate) {
  const e4m3_decoder dec = decoder_load();
  __m512 p0[MR_DECODE], p1[MR_DECODE];
  for (int r = 0; r < mr; r++) p0[r] = p1[r] = _mm512_setzero_ps();
  for (size_t kp = 0; kp < kc / 2; kp++) {
    const uint8_t *bk = b + kp * 64;
    /* At decode the weights stream from DRAM once: keep more misses in flight than the L2
     * streamer alone does. Prefetches past the tile's end are harmless hints. */
    cm_prefetch_ahead(bk, CM_FP8_PREFETCH_L1_BYTES, CM_FP8_PREFETCH_L2_BYTES, 1);
    __m512i lo, hi;
    decode_bytes(&dec, cm_load_once__avx512(bk), &lo, &hi);
    const __m512bh b0 =
        cm_as_bf16x32__avx512bf16(_mm512_rol_epi32(_mm512_unpacklo_epi8(lo, hi), 16));
    const __m512bh b1 =
        cm_as_bf16x32__avx512bf16(_mm512_rol_epi32(_mm512_unpackhi_epi8(lo, hi), 16));
    const uint32_t *ak = a + kp * as;
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      const __m512bh x = cm_as_bf16x32__avx512bf16(_mm512_set1_epi32((int)ak[r]));
      p0[r] = _mm512_dpbf16_ps(p0[r], x, b0);
      p1[r] = _mm512_dpbf16_ps(p1[r], x, b1);
    }
  }
  /* columns back in order: 0-15 = lanes (p0.0, p1.0, p0.1, p1.1), 16-31 = lanes 2 and 3 */
  const __m512i order0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i order1 = _mm512_add_epi32(order0, _mm512_set1_epi32(8));
  /* C = fma(P, scale, C or +0) */
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    const __m512 q0 = _mm512_permutex2var_ps(p0[r], order0, p1[r]);
    const __m512 q1 = _mm512_permutex2var_ps(p0[r], order1, p1[r]);
    const __m512 c0 = accumulate ? _mm512_loadu_ps(c + r * CM_NR) : _mm512_setzero_ps();
    const __m512 c1 = accumulate ? _mm512_loadu_ps(c + r * CM_NR + 16) : _mm512_setzero_ps();
    _mm512_storeu_ps(c + r * CM_NR, _mm512_fmadd_ps(q0, s0, c0));
    _mm512_storeu_ps(c + r * CM_NR + 16, _mm512_fmadd_ps(q1, s1, c1));
  }
}

void cm_fp8_gemm_pairs_mrx32__avx512bf16(size_t mr, size_t kc, const void *panel, size_t a_stride,
                                         const uint8_t *b, const float *scale, float *c,
                                         int accumulate) {
  const uint32_t *a_pairs = (const uint32_t *)panel;
  CM_EXPECT(mr >= 1 && mr <= MR_DECODE);
  CM_EXPECT(kc % 2 == 0 && a_stride >= mr);
  switch (mr) {
    case 1: gemm_body(1, kc, a_pairs, a_stride, b, scale, c, accumulate); break;
    case 2: gemm_body(2, kc, a_pairs, a_stride, b, scale, c, accumulate); break;
    case 3: gemm_body(3, kc, a_pairs, a_stride, b, scale, c, accumulate); break;
    default: gemm_body(4, kc, a_pairs, a_stride, b, scale, c, accumulate); break;
  }
}

void cm_fp8_to_bf16__avx512bf16(size_t kc, const uint8_t *b, void *out) {
  CM_EXPECT(kc % 2 == 0);
  uint16_t *dst = (uint16_t *)out;
  const e4m3_decoder dec = decoder_load();
  /* The in-lane unpacks write memory order if the k pair's qwords (4 columns each) come in
   * as 0 4 1 5 2 6 3 7: lane l of the unpack-low vector (columns 0-15) takes qword 2l =
   * columns 4l..4l+3, of the unpack-high vector (16-31) qword 2l + 1 = columns 16 + 4l... One
   * qword permute and two unpacks (3 port-5 cycles) where two full byte permutes took 4. */
  const __m512i columns = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t kp = 0; kp < kc / 2; kp++) {
    __m512i lo, hi;
    cm_prefetch_ahead(b + kp * 64, CM_FP8_CHUNK_PREFETCH_BYTES, 0, 1);
    decode_bytes(&dec, _mm512_permutexvar_epi64(columns, cm_load_once__avx512(b + kp * 64)), &lo,
                 &hi);
    _mm512_storeu_si512(dst + kp * 64, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(dst + kp * 64 + 32, _mm512_unpackhi_epi8(lo, hi));
  }
}
