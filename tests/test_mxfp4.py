"""MXFP4 (moe_comp_method=4, gpt-oss): e2m1 weights two per byte with an e8m0 scale per 32
input features, packed by convert_weight_packed (uint8) and convert_scale_packed.

* decoding: the definition (every code times 2^(scale - 127), exact in bf16, +-inf beyond
  its range, +0 for both zero codes), the reference's, and the op's on every tier for all
  16 codes x 256 scales (through a w2 column read out by a one-hot intermediate);
* the quantizer (scale choice, rounding) and the reference's dequantizer;
* the op against reference.py on every tier, bf16 and fp16, M from 1 to 512, biases and
  the clamped swiglu, -1 ids; bit for bit against the exact model (exact_reference.py)
  and against the bf16 scheme on the decoded weights; tiers, threads, decode and prefill
  paths, packed and unpacked weights bit-identical;
* the packers byte for byte against reference.py and the FORMATS.md formula;
* the shared expert, SGLang's own test shapes, torch.library.opcheck, and bad inputs.
"""

import math
import re

import pytest
import torch

import cpumoe
from cpumoe import quant, reference
from cpumoe_testing import (
    BUILT_ISAS,
    DTYPES,
    MXFP4,
    SUPPORTED_ISAS,
    apply_variant,
    assert_matches_exact,
    assert_mxfp4_close,
    assert_tiers_agree,
    flushes_denormals,
    make_bias,
    make_mxfp4_weights,
    make_routing,
    mxfp4_ref_kwargs,
    needs_two_tiers,
    pack,
    raises,
    run_fused_mxfp4,
    skip_unless_supported,
    use_isa,
)
from exact_reference import mxfp4_exact_reference

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_times_scale(code: int, scale: int) -> float:
    """The definition, in Python floats (independent of torch and of reference.py): the
    magnitude of bits 2..0, the sign of bit 3, times 2^(scale - 127); zero codes +0."""
    v = math.ldexp(E2M1[code & 7], scale - 127)
    return -v if code & 8 and v else v


def bf16_of(v: float) -> float:
    """v as a bf16 (v is exact in bf16 below 2^128 by construction: checked), inf beyond."""
    if abs(v) >= 2.0 ** 128:
        return math.copysign(math.inf, v)
    b = torch.tensor(v, dtype=torch.float64).to(torch.bfloat16)
    assert float(b) == v, (v, float(b))
    return v


def ref_mxfp4(x, c1, s1, c2, s2, tw, ti, **kw):
    return reference.fused_experts(x, c1, c2, tw, ti, **mxfp4_ref_kwargs(s1, s2), **kw)


# ---- decoding ------------------------------------------------------------------------------


def test_definition_and_reference_decoding():
    """reference.dequantize_mxfp4 is the definition for every code and scale: exact values
    (bf16 denormals at scales 0 and 1), +-inf from 2^128 on, +0 for codes 0 and 8."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(256, 1)  # row s: the 16 codes
    scales = torch.arange(256, dtype=torch.uint8)[:, None]  # [256, 16 / 32] -> one group
    got = reference.dequantize_mxfp4(torch.cat([packed, packed], 1), scales)[:, :16]
    for s in range(256):
        for c in range(16):
            want = bf16_of(e2m1_times_scale(c, s))
            v = float(got[s, c])
            assert v == want and math.copysign(1, v) == math.copysign(1, want), (c, s, v, want)
    assert float(got[0, 1]) == 2.0 ** -128 and float(got[255, 1]) == 2.0 ** 127
    assert got[255, 2].isinf() and got[255, 15] == -math.inf and got[255, 8] == 0
    # the codes' order inside a byte: input feature 2i in the low nibble
    assert reference.mxfp4_codes(torch.tensor([[0x21]], dtype=torch.uint8)).tolist() == [[1, 2]]


def _readout_problem(dt, M):
    """A layer whose output is one column of w2, exactly: w1's codes are all zero (h = b1),
    b1 makes the intermediate one-hot with value 1 at column N0 (silu(64) = 64 in fp32 times
    1/64), so out[m, k] = w2[k, N0] rounded to the activation dtype. w2's column N0 holds,
    over its 4096 rows k, code k % 16 with scale k // 16 (its row's scale): every code with
    every scale."""
    N, K, N0 = 32, 4096, 5
    k = torch.arange(K)
    col = (k % 16).to(torch.uint8)
    codes2 = torch.zeros(1, K, N, dtype=torch.uint8)
    codes2[0, :, N0] = col
    c2 = codes2[..., 0::2] | (codes2[..., 1::2] << 4)
    s2 = (k // 16).to(torch.uint8).reshape(1, K, 1)
    c1 = torch.zeros(1, 2 * N, K // 2, dtype=torch.uint8)
    s1 = torch.full((1, 2 * N, K // 32), 127, dtype=torch.uint8)
    b1 = torch.zeros(1, 2 * N)
    b1[0, N0], b1[0, N + N0] = 64.0, 1.0 / 64
    b2 = torch.zeros(1, K)
    x = torch.randn(M, K).to(dt)
    tw = torch.ones(M, 1)
    ti = torch.zeros(M, 1, dtype=torch.int32)
    want = torch.tensor([e2m1_times_scale(int(c), int(s)) for c, s in zip(col, k // 16)],
                        dtype=torch.float64)
    return (x, c1, s1, c2, s2, tw, ti, dict(w1_bias=b1, w2_bias=b2)), want


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_every_code_and_scale_decodes_exactly(isa, dt, path):
    """The op's decoding of all 16 codes x 256 scales, read out through w2: the exact
    values (bf16 activations: each is a bf16 number, infinities from 2^128 on; fp16: the
    same values rounded to fp16). On the flushing classes (docs/NUMERICS.md) the bf16 dot
    products treat the denormal weights of scales 0 and 1 as zero; everywhere else they
    come out exactly."""
    dtype = DTYPES[dt]
    M = 1 if path == "decode" else 40
    args, want = _readout_problem(dtype, M)
    *inputs, kw = args
    out = run_fused_mxfp4(*inputs, **kw)
    expected = want.to(torch.float32)
    # amx runs every MXFP4 block on the tile unit; avx512bf16 its decode blocks on vdpbf16ps
    flushed = dtype == torch.bfloat16 and (cpumoe.numerics_class(isa) == "amx-bf16" or (
        flushes_denormals(isa) and path == "decode"))
    if flushed:
        expected = torch.where(expected.abs() < 2.0 ** -126, torch.zeros_like(expected),
                               expected)
    expected = expected.to(dtype).expand(M, -1)
    assert torch.equal(out.isnan(), expected.isnan()) and not out.isnan().any()
    bad = (out != expected).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} of {out.numel()} weights decoded wrongly, first (token, row) "
        f"{bad[0].tolist()}: got {out[tuple(bad[0])].item()}, expected "
        f"{expected[tuple(bad[0])].item()} (code {int(bad[0][1]) % 16}, scale "
        f"{int(bad[0][1]) // 16})")


# ---- the quantizer -------------------------------------------------------------------------


def test_quantizer_scale_and_rounding():
    """quantize_mxfp4: the scale 127 + ceil(log2(amax / 6)) (SGLang's test utility and
    modelopt choose it so), the nearest code with ties to the even mantissa, magnitude 0
    as code 0; checked against a brute force over the 8 magnitudes."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 64, 128, generator=g) * torch.logspace(-6, 6, 64)[None, :, None]
    w[0, 0, :32] = 0.0  # an all-zero group
    w[0, 1, :32] = torch.tensor(E2M1 * 4) * 2.0 ** -3  # exact values, ties absent
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    w[0, 2, :32] = ties * torch.tensor([1.0, -1.0] * 16)  # amax 6: scale 127, every midpoint
    codes, scales = quant.quantize_mxfp4(w)
    assert codes.shape == (4, 64, 64) and scales.shape == (4, 64, 4)
    assert codes.dtype == scales.dtype == torch.uint8
    groups = w.reshape(4, 64, 4, 32)
    amax = groups.abs().amax(-1)
    want_scale = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)) + 127,
                             torch.zeros_like(amax))
    assert torch.equal(scales.float(), want_scale)
    dq = reference.dequantize_mxfp4(codes, scales).reshape(4, 64, 4, 32)
    step = torch.exp2(scales.float() - 127)[..., None]
    cand = torch.tensor(E2M1)[None, None, None, None, :] * step[..., None]  # [.., 32, 8]
    err = (groups.abs()[..., None] - cand).abs()
    best = err.min(-1).values
    assert torch.equal((dq.abs() - groups.abs()).abs(), best), "not the nearest code"
    assert torch.equal(dq[0, 1, 0], w[0, 1, :32])  # exact values stay
    # ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    want_ties = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0] * 4) * torch.tensor(
        [1.0, -1.0] * 16)
    assert torch.equal(dq[0, 2, 0], want_ties)
    zero_codes = reference.mxfp4_codes(codes[0, 0, :16])
    assert scales[0, 0, 0] == 0 and (zero_codes == 0).all()


def test_quantizer_rejects():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_mxfp4(torch.randn(32, 48))
    w = torch.randn(32, 64)
    w[3, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        quant.quantize_mxfp4(w)


# ---- the op against the reference -------------------------------------------------------

# (M, E, topk, N, K, dtype, variant, is_vnni): M from 1 to 512, odd ones; variants of
# cpumoe_testing.apply_variant plus "drop" (-1 ids) and "i64" (int64 ids, bf16 weights)
CASES = [
    (1, 4, 2, 64, 96, "bf16", "plain", True),
    (1, 3, 3, 32, 64, "fp16", "swiglu_bias", True),
    (2, 3, 2, 32, 64, "fp16", "bias", False),
    (2, 4, 2, 96, 64, "bf16", "drop", True),
    (3, 5, 2, 64, 160, "bf16", "swiglu_bias", True),
    (7, 5, 3, 96, 64, "bf16", "i64", True),
    (13, 2, 2, 32, 288, "fp16", "duplicates", False),
    (121, 8, 4, 64, 128, "fp16", "drop", True),
    (121, 8, 4, 64, 96, "bf16", "bias", True),
    (512, 8, 2, 64, 64, "bf16", "swiglu_bias", True),
    (517, 4, 1, 32, 64, "fp16", "plain", True),
]


def case_id(c):
    M, E, topk, N, K, dt, variant, vnni = c
    return f"M{M}-E{E}-top{topk}-N{N}-K{K}-{dt}-{variant}-{'packed' if vnni else 'unpacked'}"


def make_case(M, E, topk, N, K, dt, variant):
    dtype = DTYPES[dt]
    c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
    x = torch.randn(M, K).to(dtype)
    tw, ti = make_routing(M, E, topk, drop_prob=0.3 if variant == "drop" else 0.0,
                          ids_dtype=torch.int64 if variant == "i64" else torch.int32,
                          weights_dtype=torch.bfloat16 if variant == "i64" else torch.float32)
    x, kw = apply_variant(variant, x, ti, E, N, K)
    return x, c1, s1, c2, s2, tw, ti, kw


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(isa, case):
    *shape, vnni = case
    x, c1, s1, c2, s2, tw, ti, kw = make_case(*shape)
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, is_vnni=vnni, **kw)
    assert_mxfp4_close(out, ref_mxfp4(x, c1, s1, c2, s2, tw, ti, **kw), case_id(case))


EXACT_CASES = [c for c in CASES if c[0] <= 121 and c[4] <= 160]


@pytest.mark.parametrize("case", EXACT_CASES, ids=case_id)
def test_matches_exact_reference_bitwise(isa, case):
    """Bit for bit against the kernels' operation order on fp32-chain tiers (and the classes
    that give its bits on these denormal-free data), within the tolerance elsewhere."""
    *shape, vnni = case
    x, c1, s1, c2, s2, tw, ti, kw = make_case(*shape)
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, is_vnni=vnni, **kw)
    exact = mxfp4_exact_reference(x, c1, s1, c2, s2, tw, ti, **kw)
    assert_matches_exact(out, exact, MXFP4, case_id(case))


@pytest.mark.parametrize("M", [1, 2, 3, 40], ids=lambda m: f"M{m}")
def test_equals_bf16_scheme_on_decoded_weights(isa, M):
    """MXFP4 computes what the bf16 scheme computes on the decoded weights, bit for bit:
    the same chains, the same kernels once decoded. (On amx the bf16 scheme sends experts of
    1 or 2 rows to vdpbf16ps, MXFP4 to the tile unit: there they agree bit for bit from 3
    rows per expert, within the tolerance below.)"""
    E, topk, N, K = 4, 2, 64, 128
    c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
    x = torch.randn(M, K).to(torch.bfloat16)
    tw, ti = make_routing(M, E, topk)
    if M >= 3:
        ti[:] = torch.tensor([0, 1], dtype=ti.dtype)  # every expert gets all M rows or none
    b1, b2 = make_bias(E, N, K)
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, w1_bias=b1, w2_bias=b2)
    w1 = reference.dequantize_mxfp4(c1, s1).to(torch.bfloat16)
    w2 = reference.dequantize_mxfp4(c2, s2).to(torch.bfloat16)
    bf16 = cpumoe.fused_experts(x, pack(w1), pack(w2), tw, ti, w1_bias=b1, w2_bias=b2)
    if M < 3 and cpumoe.numerics_class(isa) == "amx-bf16":
        assert_mxfp4_close(out, bf16)
    else:
        assert torch.equal(out, bf16), (isa, M)


@needs_two_tiers
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tiers_bit_identical(case):
    *shape, vnni = case
    x, c1, s1, c2, s2, tw, ti, kw = make_case(*shape)
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, is_vnni=vnni, **kw)
    assert_tiers_agree(outs, MXFP4, case_id(case))


def test_thread_count_independent(isa):
    x, c1, s1, c2, s2, tw, ti, kw = make_case(150, 6, 3, 96, 128, "bf16", "swiglu_bias")
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, **kw))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_decode_path_equals_prefill_path(isa, dt):
    """A token alone (every expert 1 row: the register-decode kernels) and the same token
    in a batch of 64 copies (the chunk path, or on amx the tile kernel either way) give the
    same bits on every tier: MXFP4's two paths are one arithmetic within each class, and on
    amx both run on the tile unit (unlike bf16 and FP8 there)."""
    E, N, K = 4, 64, 96
    c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
    x = torch.randn(1, K).to(DTYPES[dt])
    tw, ti = make_routing(1, E, 2)
    alone = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti)
    batch = run_fused_mxfp4(x.expand(64, -1).contiguous(), c1, s1, c2, s2, tw.expand(64, -1),
                            ti.expand(64, -1))
    assert torch.equal(batch, alone.expand(64, -1)), isa


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_unpacked_equals_packed_bitwise(isa, dt):
    x, c1, s1, c2, s2, tw, ti, kw = make_case(9, 4, 2, 64, 96, dt, "bias")
    packed = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, is_vnni=True, **kw)
    unpacked = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, is_vnni=False, **kw)
    assert torch.equal(packed, unpacked)


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous view one element past the start of its storage."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def test_unaligned_tensors_accepted(isa):
    """Contiguous tensors that do not start on an alignment boundary (uint8 codes and
    scales one byte off) give the bits of aligned copies, packed and packed per call; the
    packers read them too (test_errors' version covers the other schemes)."""
    x, c1, s1, c2, s2, tw, ti, kw = make_case(9, 4, 2, 64, 96, "bf16", "bias")
    ps1, ps2 = cpumoe.convert_scale_packed(s1), cpumoe.convert_scale_packed(s2)
    assert _unaligned(c1).data_ptr() % 2 == 1 and _unaligned(x).data_ptr() % 4 != 0

    def fused(x, w1, w2, sc1, sc2, tw, ti, b1, b2, **extra):
        return cpumoe.fused_experts(x, w1, w2, tw, ti, moe_comp_method=MXFP4, w1_scale=sc1,
                                    w2_scale=sc2, w1_bias=b1, w2_bias=b2, **extra)

    b1, b2 = kw["w1_bias"], kw["w2_bias"]
    for vnni in (True, False):
        w1, w2 = (pack(c1), pack(c2)) if vnni else (c1, c2)
        aligned = fused(x, w1, w2, ps1, ps2, tw, ti, b1, b2, is_vnni=vnni)
        moved = fused(*map(_unaligned, (x, w1, w2, ps1, ps2, tw, ti, b1, b2)), is_vnni=vnni)
        assert torch.equal(moved, aligned), vnni
    assert torch.equal(pack(_unaligned(c1)), pack(c1))
    assert torch.equal(cpumoe.convert_scale_packed(_unaligned(s1)), ps1)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_minus_one_ids(isa, ids_dtype):
    """-1 ids skip their slots: the result equals the call with those slots' weights 0 and
    any valid id."""
    x, c1, s1, c2, s2, tw, ti, kw = make_case(20, 4, 3, 32, 64, "bf16", "plain")
    ti = ti.to(ids_dtype)
    ti[::3, 1] = -1
    ti[5] = -1  # a token with no slot at all: 0
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti)
    tw0, ti0 = tw.clone(), ti.clone()
    tw0[ti == -1] = 0.0
    ti0[ti == -1] = 0
    assert torch.equal(out, run_fused_mxfp4(x, c1, s1, c2, s2, tw0, ti0))
    assert (out[5] == 0).all()
    assert_mxfp4_close(out, ref_mxfp4(x, c1, s1, c2, s2, tw, ti))


@pytest.mark.parametrize("M", [1, 2, 8])
def test_bias_with_silu(isa, M):
    """w1_bias with SiLU is applied at every M (SGLang drops it at small M for bf16)."""
    x, c1, s1, c2, s2, tw, ti, _ = make_case(M, 4, 2, 32, 64, "bf16", "plain")
    b1, b2 = make_bias(4, 32, 64)
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, w1_bias=b1, w2_bias=b2)
    assert_mxfp4_close(out, ref_mxfp4(x, c1, s1, c2, s2, tw, ti, w1_bias=b1, w2_bias=b2))
    no_bias = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, w1_bias=b1 * 0, w2_bias=b2)
    assert not torch.equal(out, no_bias)


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
def test_inplace(isa, vnni):
    x, c1, s1, c2, s2, tw, ti, kw = make_case(5, 4, 2, 32, 64, "fp16", "bias")
    want = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, is_vnni=vnni, **kw)
    y = x.clone()
    got = run_fused_mxfp4(y, c1, s1, c2, s2, tw, ti, is_vnni=vnni, inplace=True, **kw)
    assert got.data_ptr() == y.data_ptr() and torch.equal(y, want)


def test_every_overload_and_positional_schema():
    """The 13- and 17-argument schemas positionally, as SGLang's callers write them."""
    x, c1, s1, c2, s2, tw, ti, kw = make_case(3, 4, 2, 32, 64, "bf16", "swiglu_bias")
    p1, p2 = pack(c1), pack(c2)
    q1, q2 = cpumoe.convert_scale_packed(s1), cpumoe.convert_scale_packed(s2)
    op = torch.ops.cpumoe.fused_experts_cpu
    plain = op(x, p1, p2, tw, ti, False, 4, q1, q2, None, None, None, True)
    assert torch.equal(plain, run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti))
    full = op(x, p1, p2, tw, ti, False, 4, q1, q2, None, None, None, kw["w1_bias"],
              kw["w2_bias"], kw["alpha"], kw["limit"], True)
    assert torch.equal(full, run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, **kw))


# SGLang's test_mxfp4_moe: M in {2, 121}, N in {352, 512}, K in {256, 320}, E 8, topk 4,
# weights randn / 10 quantized with its utility (our quantizer chooses the same scales),
# activations randn / sqrt(K); its tolerance 1e-2 against the dequantized weights.
SGLANG_CASES = [(M, N, K) for M in (2, 121) for N in (352, 512) for K in (256, 320)]


@pytest.mark.parametrize("M, N, K", SGLANG_CASES, ids=lambda v: str(v))
def test_sglang_mxfp4_moe_case(M, N, K):
    E, topk = 8, 4
    c1, s1, c2, s2 = make_mxfp4_weights(E, N, K, style="sglang")
    x = (torch.randn(M, K) / K ** 0.5).to(torch.bfloat16)
    tw, ti = make_routing(M, E, topk)
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti)
    ref = ref_mxfp4(x, c1, s1, c2, s2, tw, ti)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    assert_mxfp4_close(out, ref)


@pytest.mark.parametrize("M, N, K", [(1, 128, 128), (32, 64, 64)], ids=lambda v: str(v))
def test_sglang_mxfp4_moe_bias_case(M, N, K):
    """SGLang's test_mxfp4_moe_bias: biases randn / 10 and the clamped swiglu (1.702, 7)."""
    E, topk = 4, 2
    c1, s1, c2, s2 = make_mxfp4_weights(E, N, K, style="sglang")
    x = (torch.randn(M, K) / K ** 0.5).to(torch.bfloat16)
    tw, ti = make_routing(M, E, topk)
    kw = dict(w1_bias=torch.randn(E, 2 * N) / 10, w2_bias=torch.randn(E, K) / 10, alpha=1.702,
              limit=7.0)
    out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, **kw)
    assert_mxfp4_close(out, ref_mxfp4(x, c1, s1, c2, s2, tw, ti, **kw))


# ---- packers -------------------------------------------------------------------------------


def formula_packed_byte(codes, e, oc_row0, c, j):
    """FORMATS.md: byte j of packed column c of the 32-row block from row oc_row0: low nibble
    = the nibble j % 2 of row oc_row0 + j // 2's byte c, high nibble that of row
    oc_row0 + 16 + j // 2."""
    low = (int(codes[e, oc_row0 + j // 2, c]) >> (4 * (j % 2))) & 15
    high = (int(codes[e, oc_row0 + 16 + j // 2, c]) >> (4 * (j % 2))) & 15
    return low | high << 4


PACK_SHAPES = [(32, 16), (64, 48), (2, 32, 16), (3, 96, 80), (1, 64, 1440), (2, 256, 1024)]


@pytest.mark.parametrize("shape", PACK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pack_codes_matches_reference(shape):
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    packed = cpumoe.convert_weight_packed(codes)
    assert packed.shape == codes.shape and packed.dtype == torch.uint8
    assert torch.equal(packed, reference.pack_mxfp4(codes))


@pytest.mark.parametrize("shape", [(2, 64, 16), (32, 32)], ids=["3d-64x16", "2d-32x32"])
def test_pack_codes_hand_formula(shape):
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    packed = cpumoe.convert_weight_packed(codes)
    c3 = codes.reshape(-1, *shape[-2:])
    p3 = packed.reshape(-1, shape[-2], shape[-1])
    cols = shape[-1]
    for e in range(c3.shape[0]):
        for b in range(shape[-2] // 32):
            flat = p3[e, 32 * b:32 * b + 32].reshape(-1)  # the block's bytes in memory order
            for c in range(cols):
                for j in range(32):
                    assert int(flat[c * 32 + j]) == formula_packed_byte(c3, e, 32 * b, c, j)


@pytest.mark.parametrize("shape", [(32, 1), (64, 3), (2, 32, 4), (3, 96, 90)],
                         ids=lambda s: "x".join(map(str, s)))
def test_pack_scales_matches_reference(shape):
    s = torch.randint(0, 256, shape, dtype=torch.uint8)
    packed = cpumoe.convert_scale_packed(s)
    assert packed.shape == s.shape and packed.dtype == torch.uint8
    assert torch.equal(packed, reference.pack_e8m0_scales(s))
    # by the formula: packed[b][g][n] = s[32 b + n][g]
    flat = packed.reshape(-1, shape[-2] // 32, shape[-1], 32)
    src = s.reshape(-1, shape[-2] // 32, 32, shape[-1])
    assert torch.equal(flat, src.transpose(-1, -2))


def test_packers_thread_count_independent():
    codes = torch.randint(0, 256, (4, 256, 512), dtype=torch.uint8)
    scales = torch.randint(0, 256, (4, 256, 32), dtype=torch.uint8)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append((cpumoe.convert_weight_packed(codes), cpumoe.convert_scale_packed(scales)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_pack_small_oc_and_empty():
    """SGLang's 2-D small-OC case applies to uint8 too; empty expert banks pack to empty."""
    w = torch.randint(0, 256, (8, 16), dtype=torch.uint8)
    assert torch.equal(cpumoe.convert_weight_packed(w), w.float().t())
    assert cpumoe.convert_weight_packed(torch.empty(0, 32, 16, dtype=torch.uint8)).shape == (
        0, 32, 16)
    assert cpumoe.convert_scale_packed(torch.empty(0, 32, 2, dtype=torch.uint8)).shape == (
        0, 32, 2)


@pytest.mark.parametrize("tensor, pattern", [
    (torch.zeros(48, 16, dtype=torch.uint8),
     r"convert_weight_packed: invalid weight out features 48 \(must be a multiple of 32"),
    (torch.zeros(2, 32, 24, dtype=torch.uint8),
     r"convert_weight_packed: invalid weight input features 48 \(must be a multiple of 32\)"),
], ids=["oc48", "ic48"])
def test_pack_codes_errors(tensor, pattern):
    with raises(pattern):
        cpumoe.convert_weight_packed(tensor)


@pytest.mark.parametrize("tensor, pattern", [
    (torch.zeros(48, 2, dtype=torch.uint8),
     r"convert_scale_packed: scale has 48 rows \(the weight's out features\), which must be a "
     r"multiple of 32"),
    (torch.zeros(32, 2, dtype=torch.float32),
     r"convert_scale_packed: expect scale to be uint8 \(e8m0 exponents\), got Float"),
    (torch.zeros(2, 2, 32, 2, dtype=torch.uint8),
     r"convert_scale_packed: expect scale to be 2d or 3d, got 4d tensor"),
    (torch.zeros(2, 32, dtype=torch.uint8).t(), r"convert_scale_packed: scale must be contiguous"),
], ids=["oc48", "float", "4d", "noncontiguous"])
def test_pack_scales_errors(tensor, pattern):
    with raises(pattern):
        torch.ops.cpumoe.convert_scale_packed(tensor)


def test_opcheck_packers_and_op():
    codes = torch.randint(0, 256, (2, 64, 32), dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 64, 2), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.cpumoe.convert_scale_packed.default, (scales,))
    torch.library.opcheck(torch.ops.cpumoe.convert_weight_packed.default, (codes,))
    x, c1, s1, c2, s2, tw, ti, kw = make_case(3, 4, 2, 32, 64, "bf16", "swiglu_bias")
    args = (x, pack(c1), pack(c2), tw, ti, False, 4, cpumoe.convert_scale_packed(s1),
            cpumoe.convert_scale_packed(s2), None, None, None)
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.default, (*args, True))
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.bias,
                          (*args, kw["w1_bias"], kw["w2_bias"], kw["alpha"], kw["limit"], True))


def test_compile_fullgraph_matches_eager():
    """Packing codes and scales and the op, traced under torch.compile with fullgraph=True
    (the fake kernels), give the eager bits."""
    x, c1, s1, c2, s2, tw, ti, kw = make_case(6, 4, 2, 32, 64, "bf16", "swiglu_bias")

    def layer(x, c1, s1, c2, s2, tw, ti):
        out = cpumoe.fused_experts(x, cpumoe.convert_weight_packed(c1),
                                   cpumoe.convert_weight_packed(c2), tw, ti, moe_comp_method=4,
                                   w1_scale=cpumoe.convert_scale_packed(s1),
                                   w2_scale=cpumoe.convert_scale_packed(s2), **kw)
        return out.float()

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, c1, s1, c2, s2, tw, ti)
    assert torch.equal(got, layer(x, c1, s1, c2, s2, tw, ti))


# ---- the shared expert ---------------------------------------------------------------------


SHARED_CASES = [(dt, act) for dt in ("bf16", "fp16") for act in ("silu", "swiglu")]


@pytest.mark.parametrize("dt, act", SHARED_CASES, ids=lambda v: str(v))
def test_shared_expert_is_one_expert_of_fused(isa, dt, act):
    """shared_expert_cpu with use_mxfp4 (the .mxfp4 overload, SGLang's newer schema) runs
    the MXFP4 row as a fused MoE with one expert and one slot per token: without
    fused_experts_out it gives a one-expert fused_experts call's bits (the clamped swiglu
    too), packed or packed per call; with it, the reference's mlp(x) + factor * routed."""
    M, N, K = 11, 64, 96
    c1, s1, c2, s2 = (t[0] for t in make_mxfp4_weights(1, N, K))
    p1, p2 = cpumoe.convert_scale_packed(s1), cpumoe.convert_scale_packed(s2)
    x = torch.randn(M, K).to(DTYPES[dt])
    swiglu = dict(alpha=1.702, limit=7.0) if act == "swiglu" else {}
    tw, ti = torch.ones(M, 1), torch.zeros(M, 1, dtype=torch.int32)
    fused = run_fused_mxfp4(x, c1[None], s1[None], c2[None], s2[None], tw, ti, **swiglu)
    op = torch.ops.cpumoe.shared_expert_cpu.mxfp4
    alpha, limit = swiglu.get("alpha"), swiglu.get("limit")
    for vnni in (True, False):
        w1, w2 = (pack(c1), pack(c2)) if vnni else (c1, c2)
        out = op(x, w1, w2, None, None, False, False, False, True, p1, p2, None, alpha, limit,
                 vnni)
        assert torch.equal(out, fused), vnni
    assert torch.equal(cpumoe.shared_expert(x, pack(c1), pack(c2), use_mxfp4=True,
                                            w1_scale=p1, w2_scale=p2, **swiglu), fused)
    assert_mxfp4_close(fused, reference.shared_expert(x, c1, c2, w1_scale=s1, w2_scale=s2,
                                                      use_mxfp4=True, **swiglu))
    factor, routed = 2.5, torch.randn(M, K).to(DTYPES[dt])
    y = x.clone()
    out = cpumoe.shared_expert(y, pack(c1), pack(c2), routed, factor, inplace=True,
                               use_mxfp4=True, w1_scale=p1, w2_scale=p2, **swiglu)
    assert out.data_ptr() == y.data_ptr()
    want = reference.shared_expert(x, c1, c2, routed, factor, w1_scale=s1, w2_scale=s2,
                                   use_mxfp4=True, **swiglu)
    assert_mxfp4_close(out, want)


def test_shared_expert_rejects_mxfp4_mismatches():
    """use_mxfp4 with another scheme's weights or without scales, and MXFP4 weights without
    the flag, are errors naming the argument (catalogue: tests/test_errors.py)."""
    N, K = 64, 96
    c1, s1, c2, s2 = (t[0] for t in make_mxfp4_weights(1, N, K))
    p1, p2 = cpumoe.convert_scale_packed(s1), cpumoe.convert_scale_packed(s2)
    x = torch.randn(3, K).to(torch.bfloat16)
    with raises(r"shared_expert_cpu: .*w1_scale"):
        cpumoe.shared_expert(x, pack(c1), pack(c2), use_mxfp4=True, w2_scale=p2)
    with raises(r"shared_expert_cpu: w1 must be"):
        cpumoe.shared_expert(x, pack(torch.zeros(2 * N, K).bfloat16()), pack(c2),
                             use_mxfp4=True, w1_scale=p1, w2_scale=p2)
    with raises(r"shared_expert_cpu: "):
        cpumoe.shared_expert(x, pack(c1), pack(c2))  # uint8 weights, no flag


# ---- bad inputs ----------------------------------------------------------------------------


def _valid():
    x, c1, s1, c2, s2, tw, ti, _ = make_case(2, 4, 2, 32, 64, "bf16", "plain")
    return dict(hidden_states=x, w1=pack(c1), w2=pack(c2), topk_weights=tw, topk_ids=ti,
                moe_comp_method=4, w1_scale=cpumoe.convert_scale_packed(s1),
                w2_scale=cpumoe.convert_scale_packed(s2))


def _call(**over):
    args = {**_valid(), **over}
    return cpumoe.fused_experts(args.pop("hidden_states"), args.pop("w1"), args.pop("w2"),
                                args.pop("topk_weights"), args.pop("topk_ids"), **args)


def test_errors_baseline_passes():
    _call()


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
def test_missing_scale(name):
    shape = "[4, 64, 2]" if name == "w1_scale" else "[4, 64, 1]"
    with raises(rf"fused_experts_cpu: missing {name} for mxfp4 \(uint8 e8m0 scales of shape "
                rf"{re.escape(shape)}, packed by convert_scale_packed\)"):
        _call(**{name: None})


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
@pytest.mark.parametrize("dtype, dname", [(torch.float32, "Float"), (torch.int8, "Char"),
                                          (torch.bfloat16, "BFloat16")])
def test_scale_wrong_dtype(name, dtype, dname):
    s = _valid()[name]
    with raises(rf"fused_experts_cpu: {name} must be uint8 \(e8m0 exponents\) for mxfp4, got "
                rf"{dname}"):
        _call(**{name: s.to(dtype)})


@pytest.mark.parametrize("name, shape", [
    ("w1_scale", (4, 64, 1)), ("w1_scale", (4, 32, 2)), ("w1_scale", (4, 64 * 2)),
    ("w2_scale", (4, 64, 2)), ("w2_scale", (3, 64, 1)), ("w2_scale", (4 * 64,)),
], ids=lambda v: str(v))
def test_scale_wrong_shape(name, shape):
    """Exact shapes (SGLang's own check only rejects empty scales): a scale tensor of the
    right size but the wrong shape is refused too."""
    want = "[4, 64, 2]" if name == "w1_scale" else "[4, 64, 1]"
    with raises(rf"fused_experts_cpu: {name} must have shape {re.escape(want)} \(out_features, "
                rf"in_features / 32\), got"):
        _call(**{name: torch.zeros(shape, dtype=torch.uint8)})


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
def test_scale_noncontiguous(name):
    s = _valid()[name]
    bad = torch.zeros(*s.shape[:-1], 2 * s.shape[-1], dtype=torch.uint8)[..., ::2]
    assert bad.shape == s.shape and not bad.is_contiguous()
    with raises(rf"fused_experts_cpu: {name} must be contiguous"):
        _call(**{name: bad})


def test_weights_wrong_dtype_or_shape():
    v = _valid()
    with raises(r"fused_experts_cpu: w1 must be Byte for moe_comp_method 4 \(mxfp4\), got Char"):
        _call(w1=v["w1"].view(torch.int8))
    with raises(r"fused_experts_cpu: w2 must have shape \[4, 64, 16\], got \[4, 64, 32\]"):
        _call(w2=torch.zeros(4, 64, 32, dtype=torch.uint8))
    with raises(r"fused_experts_cpu: w1 must be a 3-D tensor \[E, 2N, K\], got shape \[64, 32\]"):
        _call(w1=v["w1"][0])


def test_other_arguments_refused():
    z = torch.zeros(4, 1, 2, 32, dtype=torch.int8)
    with raises(r"fused_experts_cpu: block_size must be None for moe_comp_method 4 \(mxfp4\)"):
        _call(block_size=[32, 32])
    with raises(r"fused_experts_cpu: w1_zero must be None for moe_comp_method 4 \(mxfp4\)"):
        _call(w1_zero=z)


def test_other_methods_refuse_uint8_and_mxfp4_refuses_others():
    v = _valid()
    with raises(r"w1 must be BFloat16 for moe_comp_method 0"):
        _call(moe_comp_method=0, w1_scale=None, w2_scale=None)
    w = torch.randn(4, 64, 64).to(torch.bfloat16)
    with raises(r"w1 must be Byte for moe_comp_method 4 \(mxfp4\), got BFloat16"):
        _call(w1=pack(w), w2=v["w2"])


@pytest.mark.parametrize("tier", BUILT_ISAS)
def test_bad_scales_rejected_on_every_tier(tier):
    """The checks come before any kernel: the same error on every tier."""
    skip_unless_supported(tier)
    with use_isa(tier), raises(r"w1_scale must be uint8"):
        _call(w1_scale=_valid()["w1_scale"].float())
