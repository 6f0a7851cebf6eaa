"""INT8 W8A8 (fused_experts_cpu moe_comp_method=1, shared_expert_cpu use_int8_w8a8=True):
int8 weights with per output channel fp32 scales, activations quantized per row inside the
op (docs/MATH.md, INT8 W8A8; docs/SGLANG.md, round half to even on every path;
docs/FORMATS.md, int8 weights).

Against reference.py (tolerance TOL_INT8, reasoning in cpumoe_testing.py) on every tier,
bit for bit against the reference with the kernels' exp (int8_exact_reference), bit for
bit across tiers and thread counts (integer GEMMs), routing edge cases, biases and swiglu,
the shared expert, int8 packing, errors, NaN isolation and the quantization helper.
"""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import quant, reference
from cpumoe_testing import (
    DROP,
    DTYPES,
    INT8,
    SUPPORTED_ISAS,
    apply_variant,
    assert_int8_close,
    assert_matches_exact,
    assert_tiers_agree,
    call_fused,
    isa_params,
    make_bias,
    make_int8_weights,
    make_quantized_hidden,
    make_routing,
    needs_two_tiers,
    pack,
    raises,
    run_fused_int8,
    use_isa,
)
from exact_reference import int8_exact_reference, kernel_activations


def make_case(M, E, topk, N, K, dtype, style="quant", **routing):
    x = make_quantized_hidden(M, K, dtype, style)
    w1, s1, w2, s2 = make_int8_weights(E, N, K, style)
    tw, ti = make_routing(M, E, topk, **routing)
    return x, w1, s1, w2, s2, tw, ti


def ref_int8(x, w1, s1, w2, s2, tw, ti, **kw):
    return reference.fused_experts(x, w1, w2, tw, ti, moe_comp_method=INT8, w1_scale=s1,
                                   w2_scale=s2, **kw)


# ---------------------------------------------------------------------------------------
# 1. Every tier against the reference, on a pairwise covering set of
#   M {1,2,5,39,130} x E {1,8,64} x topk {1,3,8} (topk <= E) x N {32,128} x K {64,256}
#   x dtype {bf16,fp16} x is_vnni {T,F} x data {quant, sglang}:
# every value of every factor meets every value of every other factor in some case
# (greedy all-pairs, cheapest case first). The costliest (130 tokens x 8 slots,
# N=128, K=256) is ~0.1 s on the scalar tier, so every tier runs every case.
# "quant": quantize_int8_per_channel of randn / sqrt(fan-in) floats, x = randn;
# "sglang": SGLang's test_int8_moe data (uniform int8, scales rand*1e-2, x = randn/sqrt(K)).
# (M, E, topk, N, K, dtype, is_vnni, style)
PAIRWISE = [
    (1, 1, 1, 32, 64, "bf16", True, "quant"),
    (2, 8, 3, 32, 256, "fp16", False, "sglang"),
    (5, 64, 8, 128, 64, "bf16", False, "sglang"),
    (39, 64, 1, 128, 256, "fp16", True, "quant"),
    (130, 8, 3, 128, 64, "bf16", True, "quant"),
    (130, 1, 1, 32, 256, "fp16", False, "sglang"),
    (5, 8, 8, 32, 256, "fp16", True, "quant"),
    (2, 1, 1, 128, 64, "bf16", True, "quant"),
    (1, 64, 3, 32, 64, "fp16", True, "sglang"),
    (39, 8, 1, 32, 64, "bf16", False, "quant"),
    (1, 8, 8, 128, 256, "bf16", False, "quant"),
    (5, 1, 1, 32, 64, "bf16", True, "quant"),
    (39, 1, 1, 32, 64, "bf16", True, "sglang"),
    (2, 64, 8, 32, 64, "bf16", True, "quant"),
    (130, 64, 8, 32, 64, "bf16", True, "quant"),
    (5, 8, 3, 32, 64, "bf16", True, "quant"),
    (39, 8, 3, 32, 64, "bf16", True, "quant"),
    (39, 8, 8, 32, 64, "bf16", True, "quant"),
    # not needed for pairs: the largest combination, on every tier
    (130, 64, 8, 128, 256, "fp16", False, "sglang"),
]


def case_id(c):
    M, E, topk, N, K, dt, vnni, style = c
    return f"M{M}-E{E}-top{topk}-N{N}-K{K}-{dt}-{'packed' if vnni else 'unpacked'}-{style}"


def tier_case_params(cases):
    return [pytest.param(t.values[0], c, marks=t.marks, id=f"{t.id}-{case_id(c)}")
            for t in isa_params() for c in cases]


@pytest.mark.parametrize("isa, case", tier_case_params(PAIRWISE), indirect=["isa"])
def test_matches_reference(isa, case):
    M, E, topk, N, K, dt, vnni, style = case
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, DTYPES[dt], style,
                                          renormalize=(M % 2 == 0))
    x_before, w1_before, s1_before = x.clone(), w1.clone(), s1.clone()
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=vnni)
    assert torch.equal(x, x_before), "inplace=False modified hidden_states"
    assert torch.equal(w1, w1_before) and torch.equal(s1, s1_before), "weights modified"
    assert out.data_ptr() != x.data_ptr()
    ref = ref_int8(x, w1, s1, w2, s2, tw, ti)
    assert (ref.float().abs().amax(-1) > 0).all()  # every row has something to compare
    assert_int8_close(out, ref, f"tier={isa}")


@pytest.mark.parametrize("M", [1, 39])
def test_sglang_int8_moe_case(M):
    """SGLang's test_int8_moe: E=8, topk=3, N=128, K=256, its data, inplace=True,
    packed weights, scales [E, 2N] / [E, K] (2-D here), tolerance 1e-2 (0.02 if M > 35)."""
    E, topk, N, K = 8, 3, 128, 256
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, torch.bfloat16, "sglang")
    s1, s2 = s1.reshape(E, 2 * N), s2.reshape(E, K)
    ref = ref_int8(x, w1, s1, w2, s2, tw, ti)
    out = torch.ops.cpumoe.fused_experts_cpu(x, pack(w1), pack(w2), tw, ti, True, INT8, s1, s2,
                                             None, None, None, True)
    assert out.data_ptr() == x.data_ptr()
    tol = 0.02 if M > 35 else 1e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_scale_shapes_equivalent(isa):
    """Scales are read by numel: [E, OC, 1] (SGLang), [E, OC] and flat [E*OC] agree."""
    E, N, K = 8, 32, 64
    x, w1, s1, w2, s2, tw, ti = make_case(11, E, 2, N, K, torch.bfloat16)
    pw1, pw2 = pack(w1), pack(w2)
    outs = [cpumoe.fused_experts(x, pw1, pw2, tw, ti, moe_comp_method=INT8, w1_scale=a,
                                 w2_scale=b)
            for a, b in [(s1, s2), (s1.reshape(E, 2 * N), s2.reshape(E, K)),
                         (s1.flatten(), s2.flatten())]]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_int8_close(outs[0], ref_int8(x, w1, s1, w2, s2, tw, ti))


def test_scales_are_per_channel(isa):
    """Each scale multiplies its own output channel: scaling one w1 channel's scale (and
    the int8 row of an up channel) or one w2 channel's scale moves exactly what the
    reference says (guards against scales read per expert, transposed or shifted)."""
    E, N, K = 4, 32, 64
    x, w1, s1, w2, s2, tw, ti = make_case(9, E, 2, N, K, torch.float16)
    s1b, s2b = s1.clone(), s2.clone()
    s1b[1, N + 3] *= 4  # an up channel of expert 1
    s1b[2, 5] *= 0.25   # a gate channel of expert 2
    s2b[3, 17] *= 2     # one output channel of expert 3
    out = run_fused_int8(x, w1, s1b, w2, s2b, tw, ti, is_vnni=True)
    assert_int8_close(out, ref_int8(x, w1, s1b, w2, s2b, tw, ti))
    assert not torch.equal(out, run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True))


# ---------------------------------------------------------------------------------------
# 2. Exactness: integer GEMMs and the same fp32 steps everywhere, so the kernels equal
# the reference with the kernels' exp bit for bit, and tiers and thread counts agree.

EXACT_CASES = [
    # (M, E, topk, N, K, dtype, style, variant)
    (1, 8, 3, 128, 256, "bf16", "sglang", "silu"),
    (39, 8, 3, 128, 256, "fp16", "sglang", "silu"),
    (5, 64, 8, 32, 64, "fp16", "quant", "silu_drop"),
    (70, 4, 3, 64, 96, "bf16", "quant", "silu_drop"),
    (33, 8, 2, 96, 160, "bf16", "quant", "silu_bias"),
    (33, 8, 2, 96, 160, "fp16", "quant", "swiglu_bias"),
    (7, 3, 3, 32, 64, "bf16", "quant", "duplicates"),
    (130, 8, 1, 32, 512, "fp16", "quant", "silu"),
    # blocks of one panel (3-4 rows) take the whole reduction in one call: K = 1056 is more
    # than one stretch of avx2's widened rows (int8/gemm-avx2.c: 512 k) and not a multiple
    (7, 2, 1, 32, 1056, "bf16", "quant", "silu"),
]


def exact_case(case):
    M, E, topk, N, K, dt, style, variant = case
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, DTYPES[dt], style,
                                          drop_prob=0.25 if variant == "silu_drop" else 0.0)
    x, kw = apply_variant(variant, x, ti, E, N, K)
    return (x, w1, s1, w2, s2, tw, ti), kw


def exact_id(c):
    return "-".join(map(str, c))


@pytest.mark.parametrize("case", EXACT_CASES, ids=exact_id)
def test_matches_exact_reference_bitwise(isa, case):
    """The kernels equal reference.py bit for bit once reference.py uses the kernels' exp
    (csrc/kernels/common/numeric.h) and sums the slots in slot order: every rounding step
    (per-row quantization with one fp32 division and round-half-even, (acc * row_scale) *
    channel_scale, 16-bit intermediate, re-quantization, fp32 topk weight and sum) is
    pinned, for bf16 and fp16, biases and swiglu. If numeric.h's exp changes, update
    kernel_expf in exact_reference.py."""
    args, kw = exact_case(case)
    out = run_fused_int8(*args, is_vnni=True, **kw)
    expected = int8_exact_reference(*args, **kw)
    assert_matches_exact(out, expected, INT8)
    assert_int8_close(out, ref_int8(*args, **kw))


@needs_two_tiers
@pytest.mark.parametrize("case", EXACT_CASES, ids=exact_id)
def test_tiers_bit_identical(case):
    """Every tier equals the first tier of its numerics class bit for bit, and that one
    the worst tier within CROSS_CLASS_TOLERANCE."""
    args, kw = exact_case(case)
    x, w1, s1, w2, s2, tw, ti = args
    pw1, pw2 = pack(w1), pack(w2)
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = cpumoe.fused_experts(x, pw1, pw2, tw, ti, moe_comp_method=INT8,
                                              w1_scale=s1, w2_scale=s2, **kw)
    assert_int8_close(assert_tiers_agree(outs, INT8), ref_int8(*args, **kw))


def test_thread_count_independent(isa):
    M, E, topk, N, K = 130, 8, 3, 96, 160
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, torch.bfloat16, drop_prob=0.1)
    b1, b2 = make_bias(E, N, K)
    xs, w1s, s1s, w2s, s2s, _, _ = make_case(M, 1, 1, N, K, torch.float16)
    fused = torch.randn(M, K).to(torch.float16)
    pw1, pw2, pw1s, pw2s = pack(w1), pack(w2), pack(w1s[0]), pack(w2s[0])
    outs = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        outs.append((
            cpumoe.fused_experts(x, pw1, pw2, tw, ti, moe_comp_method=INT8, w1_scale=s1,
                                 w2_scale=s2),
            cpumoe.fused_experts(x, pw1, pw2, tw, ti, moe_comp_method=INT8, w1_scale=s1,
                                 w2_scale=s2, w1_bias=b1, w2_bias=b2, alpha=1.702, limit=7.0),
            cpumoe.shared_expert(xs, pw1s, pw2s, fused, 2.5, use_int8_w8a8=True,
                                 w1_scale=s1s[0], w2_scale=s2s[0]),
        ))
    for o in outs[1:]:
        for got, first in zip(o, outs[0]):
            assert torch.equal(got, first)
    assert_int8_close(outs[0][0], ref_int8(x, w1, s1, w2, s2, tw, ti))


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_unpacked_equals_packed_bitwise(isa, dt):
    x, w1, s1, w2, s2, tw, ti = make_case(9, 8, 2, 64, 96, DTYPES[dt])
    packed = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True)
    unpacked = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=False)
    assert torch.equal(packed, unpacked)
    assert_int8_close(packed, ref_int8(x, w1, s1, w2, s2, tw, ti))


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_hand_computed_rounding(isa, dt, vnni):
    """Exact values through both quantizations, round half to even in both (SGLang's fp16
    path rounds half away from zero; we use round-half-even for every dtype).

    K = N = 32, one expert, topk 1, weight 1. x[0] = 127 is the row's amax, so the row
    scale is 1 and q = round(x). Gate rows read x[1] = 64 (gate 64) or x[2] = 32 (gate 32):
    silu is exact there (exp(-32) vanishes next to 1). Up rows are the identity, so
    a[n] = gate[n] * q[n], exact in 16 bits; a[0] = 64 * 127 = 8128 is the amax of a,
    so the second scale is 64 and q2 = round(a / 64): q for gate 64, round(q / 2) for
    gate 32. w2 = identity with scale 1/64 gives out = q2 exactly."""
    dtype = DTYPES[dt]
    K = N = 32
    # column: (x value, gate 64 or 32)
    cols = [(127.0, 64), (64.0, 64), (32.0, 32),
            # stage 1 ties and near-ties (gate 64: out = round_half_even(x))
            (2.5, 64), (-2.5, 64), (0.5, 64), (-0.5, 64), (1.5, 64), (-1.5, 64),
            (3.5, 64), (126.5, 64), (-126.5, 64), (2.25, 64), (-2.75, 64), (0.0, 64),
            (-127.0, 64),
            # stage 2 ties: q odd, gate 32 -> q/2 is a half (out = round_half_even(q / 2))
            (5.0, 32), (-5.0, 32), (7.0, 32), (-7.0, 32), (1.0, 32), (-1.0, 32),
            (3.0, 32), (-3.0, 32), (125.0, 32), (-125.0, 32), (4.5, 32), (9.0, 32),
            (6.0, 32), (-11.0, 32), (0.5, 32), (13.0, 32)]
    assert len(cols) == K

    def rne(v):  # round half to even, in Python
        return float(round(v))

    expected = []
    for v, gate in cols:
        q = rne(v)
        expected.append(q if gate == 64 else rne(q / 2))
    x = torch.tensor([[v for v, _ in cols]]).to(dtype)
    assert torch.equal(x.float(), torch.tensor([[v for v, _ in cols]]))  # exact in 16 bits
    w1 = torch.zeros(1, 2 * N, K, dtype=torch.int8)
    for n, (_, gate) in enumerate(cols):
        w1[0, n, 1 if gate == 64 else 2] = 1
    w1[0, N:] = torch.eye(N, dtype=torch.int8)
    s1 = torch.ones(1, 2 * N, 1)
    w2 = torch.eye(K, dtype=torch.int8)[None].contiguous()
    s2 = torch.full((1, K, 1), 1 / 64)
    tw, ti = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=vnni)
    exp_t = torch.tensor([expected]).to(dtype)
    assert torch.equal(out, exp_t), (out.float() - exp_t.float()).nonzero().flatten().tolist()
    assert torch.equal(ref_int8(x, w1, s1, w2, s2, tw, ti), exp_t)
    # half away from zero would differ (the test can tell the two apart)
    assert expected[3] == 2.0 and expected[16] == 2.0


def test_extreme_values_exact(isa):
    """The widest int32 sums the packer accepts: K = 65536 with u8 activations at 255
    (q = +127) and weights at 127 or -128: 255 * 127 * 65536 = 2.12e9 and
    255 * -128 * 65536 = -2.14e9, just inside int32 (no saturation: SGLang's AVX2-less
    vpmaddubsw pairs would saturate int16). Bit for bit against the exact reference."""
    M, E, N, K = 2, 1, 32, 65536
    x = torch.full((M, K), 0.75)  # q = +127, stored as u8 255
    x[1, K // 2:] = -0.75  # row 1: second half q = -127 (u8 1)
    x = x.to(torch.bfloat16)
    w1 = torch.full((E, 2 * N, K), 127, dtype=torch.int8)
    w1[0, 1::2] = -128
    w1[0, 4, : K // 2] = -128
    w2 = torch.full((E, K, N), -128, dtype=torch.int8)
    w2[0, ::3] = 127
    s1 = torch.full((E, 2 * N, 1), 1.6e-7)  # gate/up ~ +-1
    s2 = torch.full((E, K, 1), 1e-3)
    tw, ti = torch.ones(M, 1), torch.zeros(M, 1, dtype=torch.int32)
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True)
    expected = int8_exact_reference(x, w1, s1, w2, s2, tw, ti)
    assert_matches_exact(out, expected, INT8)
    # the integer sums really reach the extremes: row 0, gate channel 0 = 127*127*K
    q, s = reference.quantize_rows_int8(x.float())
    assert (q.double() @ w1[0].double().t()).abs().max() >= 127 * 127 * K
    assert torch.isfinite(out.float()).all() and out.float().abs().max() > 1


def test_zero_rows(isa):
    """All-zero activation rows (amax floored at 1e-7) and all-zero intermediate rows give
    exact zeros, never NaN."""
    E, N, K = 4, 32, 64
    x, w1, s1, w2, s2, tw, _ = make_case(6, E, 2, N, K, torch.bfloat16)
    ti = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 1], [3, 2]], dtype=torch.int32)
    x[2] = 0
    w1z = w1.clone()
    w1z[[0, 1], N:] = 0  # up rows of token 4's experts: its intermediate rows are 0
    out = run_fused_int8(x, w1z, s1, w2, s2, tw, ti, is_vnni=True)
    assert torch.equal(out[2], torch.zeros(K, dtype=x.dtype))
    assert torch.equal(out[4], torch.zeros(K, dtype=x.dtype))
    assert_int8_close(out, ref_int8(x, w1z, s1, w2, s2, tw, ti))
    assert out.float().abs().sum() > 0


# ---------------------------------------------------------------------------------------
# 3. Routing, inplace, M == 0, biases.


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_minus_one_ids(isa, ids_dtype):
    """-1 = expert on another rank: the slot contributes nothing; all -1 gives zeros."""
    M, E, topk, N, K = 40, 8, 4, 64, 96
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, torch.bfloat16,
                                          ids_dtype=ids_dtype, drop_prob=0.4)
    ti[3] = -1
    ti[5, 1:] = -1
    tw = tw.masked_fill(ti == -1, float("nan"))  # never read
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True)
    assert (ti == -1).any(dim=1).sum() > 5
    assert torch.equal(out[3], torch.zeros(K, dtype=x.dtype))
    tw0 = tw.masked_fill(ti == -1, 0.0)
    assert_matches_exact(out, int8_exact_reference(x, w1, s1, w2, s2, tw0, ti), INT8)
    assert_int8_close(out, ref_int8(x, w1, s1, w2, s2, tw0, ti))
    # dropping a slot equals a zero weight on a real expert (up to the reference's order)
    assert_int8_close(out, ref_int8(x, w1, s1, w2, s2, tw0, ti.clamp(min=0)))
    ti.fill_(-1)
    assert torch.equal(run_fused_int8(x, w1, s1, w2, s2, tw0, ti, is_vnni=False),
                       torch.zeros_like(x))


def test_int64_ids(isa):
    x, w1, s1, w2, s2, tw, ti = make_case(21, 16, 4, 64, 96, torch.float16,
                                          ids_dtype=torch.int64)
    assert ti.dtype == torch.int64
    out64 = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True)
    out32 = run_fused_int8(x, w1, s1, w2, s2, tw, ti.int(), is_vnni=True)
    assert torch.equal(out64, out32)
    assert_int8_close(out64, ref_int8(x, w1, s1, w2, s2, tw, ti))


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float16, torch.float64],
                         ids=["bf16", "f16", "f64"])
def test_topk_weights_dtypes(isa, wdt):
    x, w1, s1, w2, s2, tw, ti = make_case(19, 8, 3, 64, 96, torch.bfloat16, weights_dtype=wdt)
    assert tw.dtype == wdt
    pw1, pw2 = pack(w1), pack(w2)

    def run(weights):
        return cpumoe.fused_experts(x, pw1, pw2, weights, ti, moe_comp_method=INT8,
                                    w1_scale=s1, w2_scale=s2)

    out = run(tw)
    assert torch.equal(out, run(tw.float()))  # converted exactly like Tensor.float()
    assert_int8_close(out, ref_int8(x, w1, s1, w2, s2, tw, ti))


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_inplace(isa, dt, vnni):
    x, w1, s1, w2, s2, tw, ti = make_case(37, 8, 2, 64, 96, DTYPES[dt])
    ref = ref_int8(x, w1, s1, w2, s2, tw, ti)
    not_inplace = run_fused_int8(x.clone(), w1, s1, w2, s2, tw, ti, is_vnni=vnni)
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=vnni, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(x, not_inplace)
    assert_int8_close(x, ref)


def test_inplace_large_m(isa):
    """inplace across more than one 1024-token chunk: later chunks quantize their own
    rows, not rows an earlier chunk already overwrote."""
    x, w1, s1, w2, s2, tw, ti = make_case(2100, 4, 2, 32, 64, torch.bfloat16)
    ref = ref_int8(x, w1, s1, w2, s2, tw, ti)
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    assert_int8_close(x, ref)


@pytest.mark.parametrize("overload", ["default", "bias"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
def test_empty_batch(overload, inplace, vnni):
    E, N, K = 4, 32, 64
    x = torch.empty(0, K, dtype=torch.float16)
    _, w1, s1, w2, s2, _, _ = make_case(1, E, 1, N, K, torch.float16)
    if vnni:
        w1, w2 = pack(w1), pack(w2)
    kw = {}
    if overload == "bias":
        kw = dict(zip(("w1_bias", "w2_bias"), make_bias(E, N, K)), alpha=1.702, limit=7.0)
    out = cpumoe.fused_experts(x, w1, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32),
                               inplace=inplace, moe_comp_method=INT8, w1_scale=s1, w2_scale=s2,
                               is_vnni=vnni, **kw)
    assert out.shape == (0, K) and out.dtype == torch.float16
    if inplace:
        assert out.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("topk", [1, 2])
def test_all_tokens_one_expert(isa, topk):
    M, E, N, K = 100, 8, 64, 96
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, torch.bfloat16)
    ti[:, 0] = 3
    if topk == 2:
        ti[:, 1] = 6
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True)
    assert_int8_close(out, ref_int8(x, w1, s1, w2, s2, tw, ti))
    # independent of the reference's routing loop: expert 3 alone, scaled per token
    expected = reference.expert_mlp_int8(x, w1[3], s1[3], w2[3], s2[3]) * tw[:, :1]
    if topk == 2:
        expected = expected + reference.expert_mlp_int8(x, w1[6], s1[6], w2[6], s2[6]) * tw[:, 1:]
    assert_int8_close(out, expected.to(x.dtype))


@pytest.mark.parametrize("shape", [(1, 32, 64), (32, 64, 128), (5, 128, 64)],
                         ids=lambda s: "M{}-N{}-K{}".format(*s))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_bias_swiglu(isa, dt, shape):
    """Biases and alpha/limit swiglu through the .bias overload are honoured for int8 (a
    deliberate deviation: SGLang ignores them for int8), vs the reference; and they really
    change the result."""
    dtype = DTYPES[dt]
    M, N, K = shape
    E, topk = 4, 2
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, dtype)
    x = (x.float() * 3).to(dtype)  # push some gate/up values past the clamp at 7
    b1, b2 = make_bias(E, N, K)
    kw = dict(w1_bias=b1, w2_bias=b2, alpha=1.702, limit=7.0)
    vnni = M != 5
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=vnni, **kw)
    assert_int8_close(out, ref_int8(x, w1, s1, w2, s2, tw, ti, **kw))
    # positional 17-argument call of the .bias overload gives the same bits
    pw1, pw2 = (pack(w1), pack(w2)) if vnni else (w1, w2)
    pos = torch.ops.cpumoe.fused_experts_cpu(x, pw1, pw2, tw, ti, False, INT8, s1, s2, None,
                                             None, None, b1, b2, 1.702, 7.0, vnni)
    assert torch.equal(pos, out)
    # each ingredient matters (SGLang's int8 path would drop all of them)
    for other in (dict(kw, w1_bias=torch.zeros_like(b1)), dict(kw, w2_bias=torch.zeros_like(b2)),
                  dict(w1_bias=b1, w2_bias=b2)):
        changed = ref_int8(x, w1, s1, w2, s2, tw, ti, **other)
        assert not torch.allclose(out.float(), changed.float(), atol=0.05, rtol=0.05), other


@pytest.mark.parametrize("M", [1, 2, 8])
def test_bias_with_silu(isa, M):
    """w1_bias/w2_bias without alpha/limit: silu with biases, honoured at every M."""
    E, topk, N, K = 4, 2, 64, 96
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, torch.bfloat16)
    b1, b2 = make_bias(E, N, K)
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True, w1_bias=b1, w2_bias=b2)
    assert_int8_close(out, ref_int8(x, w1, s1, w2, s2, tw, ti, w1_bias=b1, w2_bias=b2))
    dropped = ref_int8(x, w1, s1, w2, s2, tw, ti, w1_bias=torch.zeros_like(b1), w2_bias=b2)
    assert not torch.allclose(out.float(), dropped.float(), atol=0.05, rtol=0.05)


# ---------------------------------------------------------------------------------------
# 4. shared_expert_cpu with use_int8_w8a8=True.


def make_shared(M, N, K, dtype, style="quant"):
    x, w1, s1, w2, s2, _, _ = make_case(M, 1, 1, N, K, dtype, style)
    fused = (torch.randn(M, K) * 0.1).to(dtype)  # routed output, O(1) after * 16
    return x, w1[0], s1[0], w2[0], s2[0], fused  # scales [2N, 1] and [K, 1]


def call_shared(x, w1, s1, w2, s2, fused, factor, *, vnni, inplace=False):
    if vnni:
        w1, w2 = pack(w1), pack(w2)
    return cpumoe.shared_expert(x, w1, w2, fused, factor, inplace=inplace, use_int8_w8a8=True,
                                w1_scale=s1, w2_scale=s2, is_vnni=vnni)


def ref_shared(x, w1, s1, w2, s2, fused, factor):
    return reference.shared_expert(x, w1, w2, fused, factor, use_int8_w8a8=True, w1_scale=s1,
                                   w2_scale=s2)


SHARED_SHAPES = {1: (1, 32, 64), 2: (2, 128, 32), 121: (121, 96, 160)}


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("residual", [True, False], ids=["fused_out", "no_fused_out"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("M", sorted(SHARED_SHAPES))
def test_shared_matches_reference(isa, M, dt, residual, vnni):
    dtype = DTYPES[dt]
    M, N, K = SHARED_SHAPES[M]
    x, w1, s1, w2, s2, fused = make_shared(M, N, K, dtype, "sglang" if M == 2 else "quant")
    assert s1.shape == (2 * N, 1) and s2.shape == (K, 1)
    fused, factor = (fused, 16.0) if residual else (None, None)
    x_before = x.clone()
    out = call_shared(x, w1, s1, w2, s2, fused, factor, vnni=vnni)
    assert torch.equal(x, x_before), "inplace=False modified hidden_states"
    assert_int8_close(out, ref_shared(x, w1, s1, w2, s2, fused, factor))
    with kernel_activations():  # bit for bit with the kernels' exp
        exact = ref_shared(x, w1, s1, w2, s2, fused, factor)
    assert_matches_exact(out, exact, INT8)
    if residual:  # the routed term is really added, scaled by 16
        plain = ref_shared(x, w1, s1, w2, s2, None, None)
        assert not torch.allclose(out.float(), plain.float(), atol=0.1, rtol=0.1)


def test_shared_equals_fused_with_one_expert(isa):
    """Without a residual, the int8 shared expert is fused_experts with E=1, weight 1."""
    M, N, K = 17, 64, 96
    x, w1, s1, w2, s2, _ = make_shared(M, N, K, torch.bfloat16)
    shared = call_shared(x, w1, s1, w2, s2, None, None, vnni=True)
    fused = cpumoe.fused_experts(x, pack(w1[None]), pack(w2[None]), torch.ones(M, 1),
                                 torch.zeros(M, 1, dtype=torch.int32), moe_comp_method=INT8,
                                 w1_scale=s1[None], w2_scale=s2[None])
    assert torch.equal(shared, fused)


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("residual", [True, False], ids=["fused_out", "no_fused_out"])
def test_shared_inplace(isa, residual, vnni):
    """DeepSeek's call: inplace=True with the routed output folded in."""
    M, N, K = 33, 64, 96
    x, w1, s1, w2, s2, fused = make_shared(M, N, K, torch.float16)
    fused, factor = (fused, 16.0) if residual else (None, None)
    fused_before = None if fused is None else fused.clone()
    ref = ref_shared(x, w1, s1, w2, s2, fused, factor)
    expected = call_shared(x.clone(), w1, s1, w2, s2, fused, factor, vnni=vnni)
    out = call_shared(x, w1, s1, w2, s2, fused, factor, vnni=vnni, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(x, expected)
    assert_int8_close(x, ref)
    if fused is not None:
        assert torch.equal(fused, fused_before), "fused_experts_out was modified"


def per_token_quant_int8(w):
    """SGLang's per_token_quant_int8 (test utils): absmax.clamp_min(1e-10), round."""
    amax = w.float().abs().amax(-1, keepdim=True).clamp_min(1e-10)
    scale = amax / 127
    return torch.round(w.float() / scale).clamp(-128, 127).to(torch.int8), scale


def test_shared_sglang_case():
    """SGLang's test_shared_expert int8 case: weights randn quantized per row with
    per_token_quant_int8 (scales [2N, 1] / [K, 1]), hidden randn/k, is_vnni=False,
    inplace on a clone, factor 16, tolerance 1e-2."""
    for m, n, k in [(2, 32, 32), (121, 128, 64)]:
        hidden = torch.randn(m, k, dtype=torch.bfloat16) / k
        w1, s1 = per_token_quant_int8(torch.randn(2 * n, k, dtype=torch.bfloat16))
        w2, s2 = per_token_quant_int8(torch.randn(k, n, dtype=torch.bfloat16))
        fused = torch.randn(m, k, dtype=torch.bfloat16)
        ref = ref_shared(hidden, w1, s1, w2, s2, fused, 16.0)
        h = hidden.clone()
        out = torch.ops.cpumoe.shared_expert_cpu(h, w1, w2, fused, 16.0, True, True, False,
                                                 s1, s2, None, False)
        assert out.data_ptr() == h.data_ptr()
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------
# 5. int8 packing (convert_weight_packed): VNNI-4 + int32 compensation.


@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (256, 64), (1, 32, 64), (3, 64, 128),
                                   (8, 96, 32)], ids=lambda s: "x".join(map(str, s)))
def test_pack_matches_reference(shape):
    w = torch.randint(-128, 128, shape, dtype=torch.int8)
    w_before = w.clone()
    packed = cpumoe.convert_weight_packed(w)
    assert packed.dtype == torch.int8 and packed.is_contiguous()
    assert packed.shape == (*shape[:-1], shape[-1] + 4)
    assert torch.equal(packed, reference.pack_vnni4_int8(w))
    assert torch.equal(w, w_before), "input modified"


def test_pack_hand_block():
    """One 32-row block of a 2-block, 2-expert weight, read byte by byte: body
    dst[(k/4)*128 + 4n + k%4] = W[32b + n][k], then comp[n] = 128 * sum_k W[32b + n][k]
    as 32 little-endian int32 at byte 32*IC of the block."""
    E, OC, IC = 2, 64, 64
    w = torch.randint(-128, 128, (E, OC, IC), dtype=torch.int8)
    w[1, 32 + 7] = -128  # comp = 128 * -128 * 64 = -2^20, a negative int32
    w[1, 32 + 9] = 127
    packed = cpumoe.convert_weight_packed(w)
    flat = packed[1].flatten().tolist()  # expert 1
    base = 32 * (IC + 4)  # block b = 1
    for n in range(32):
        for k in range(IC):
            assert flat[base + (k // 4) * 128 + 4 * n + k % 4] == int(w[1, 32 + n, k]), (n, k)
    comp_bytes = bytes(b & 0xFF for b in flat[base + 32 * IC: base + 32 * IC + 128])
    comp = [int.from_bytes(comp_bytes[4 * n: 4 * n + 4], "little", signed=True)
            for n in range(32)]
    assert comp == [128 * int(w[1, 32 + n].int().sum()) for n in range(32)]
    assert comp[7] == -(2 ** 20) and comp[9] == 128 * 127 * 64


def test_pack_max_input_features():
    """IC = 65536 is the longest exact int32 reduction: accepted, comp still exact."""
    w = torch.full((32, 65536), -128, dtype=torch.int8)
    w[1] = 127
    packed = cpumoe.convert_weight_packed(w)
    comp = packed.flatten()[32 * 65536:].contiguous().view(torch.int32)
    assert comp[0] == 128 * -128 * 65536 and comp[1] == 128 * 127 * 65536


@pytest.mark.parametrize("shape, pattern", [
    ((48, 64), r"invalid weight out features 48"),
    ((2, 80, 64), r"invalid weight out features 80"),
    ((16, 64), r"invalid weight out features 16"),
    ((32, 48), r"invalid weight input features 48"),
    ((2, 64, 100), r"invalid weight input features 100"),
    ((32, 65568), r"65568 input features.*exact only up to 65536"),
], ids=["oc48", "oc80-3d", "oc16", "ic48", "ic100-3d", "ic65568"])
def test_pack_errors(shape, pattern):
    w = torch.zeros(shape, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"convert_weight_packed.*" + pattern):
        cpumoe.convert_weight_packed(w)


# ---------------------------------------------------------------------------------------
# 6. Errors: a RuntimeError naming the argument.

E_, N_, K_, M_, TOPK_ = 8, 32, 64, 4, 2


def int8_valid():
    x, w1, s1, w2, s2, tw, ti = make_case(M_, E_, TOPK_, N_, K_, torch.bfloat16)
    return dict(hidden_states=x, w1=pack(w1), w2=pack(w2), topk_weights=tw, topk_ids=ti,
                moe_comp_method=INT8, w1_scale=s1, w2_scale=s2)


def fused_int8(**over):
    return call_fused(int8_valid(), **over)


def test_errors_baseline_passes():
    assert fused_int8().shape == (M_, K_)


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
def test_missing_scale(name):
    with raises(rf"fused_experts_cpu: missing {name} for int8 w8a8"):
        fused_int8(**{name: DROP})


@pytest.mark.parametrize("name, shape", [
    ("w1_scale", (E_, N_, 1)), ("w1_scale", (E_, 2 * N_ + 1)), ("w1_scale", (2 * N_, 1)),
    ("w2_scale", (E_, K_ // 2, 1)), ("w2_scale", (E_, 2 * K_, 1)), ("w2_scale", (1,)),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_scale_wrong_numel(name, shape):
    numel = E_ * 2 * N_ if name == "w1_scale" else E_ * K_
    with raises(rf"{name} must hold one scale per output channel \({numel} values\), got "
                rf"shape \[{', '.join(map(str, shape))}\]"):
        fused_int8(**{name: torch.ones(shape)})


@pytest.mark.parametrize("dtype, dname", [(torch.float16, "Half"), (torch.float64, "Double"),
                                          (torch.bfloat16, "BFloat16")])
@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
def test_scale_wrong_dtype(name, dtype, dname):
    oc = 2 * N_ if name == "w1_scale" else K_
    with raises(rf"{name} must be float32, got {dname}"):
        fused_int8(**{name: torch.ones(E_, oc, 1, dtype=dtype)})


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale"])
def test_scale_noncontiguous(name):
    oc = 2 * N_ if name == "w1_scale" else K_
    s = torch.rand(E_, 2 * oc)[:, ::2]
    assert s.numel() == E_ * oc and not s.is_contiguous()
    with raises(rf"{name} must be contiguous"):
        fused_int8(**{name: s})


def test_bf16_weights_with_method_1():
    args = int8_valid()
    x = args["hidden_states"]
    w1 = pack(torch.randn(E_, 2 * N_, K_).to(torch.bfloat16))
    with raises(r"\bw1 must be Char for moe_comp_method 1 \(int8 w8a8\), got BFloat16"):
        fused_int8(w1=w1)
    with raises(r"\bw1 must be Char for moe_comp_method 1 \(int8 w8a8\), got BFloat16"):
        fused_int8(w1=torch.randn(E_, 2 * N_, K_).to(x.dtype), is_vnni=False)
    with raises(r"\bw2 must be Char for moe_comp_method 1 \(int8 w8a8\), got BFloat16"):
        fused_int8(w2=torch.zeros(E_, K_, N_ + 4, dtype=torch.bfloat16))


def test_int8_weights_with_method_0():
    args = int8_valid()
    with raises(r"\bw1 must be BFloat16 for moe_comp_method 0 \(bf16/fp16 weights\), got Char"):
        cpumoe.fused_experts(args["hidden_states"], args["w1"], args["w2"],
                             args["topk_weights"], args["topk_ids"])
    with raises(r"\bw1 must be BFloat16 for moe_comp_method 0 .*got Char"):
        cpumoe.fused_experts(args["hidden_states"], torch.zeros(E_, 2 * N_, K_, dtype=torch.int8),
                             torch.zeros(E_, K_, N_, dtype=torch.int8), args["topk_weights"],
                             args["topk_ids"], is_vnni=False)
    # and the int8 scales are rejected for method 0
    with raises(r"w1_scale must be None for moe_comp_method 0"):
        cpumoe.fused_experts(args["hidden_states"], pack(torch.zeros(E_, 2 * N_, K_,
                                                                     dtype=torch.bfloat16)),
                             pack(torch.zeros(E_, K_, N_, dtype=torch.bfloat16)),
                             args["topk_weights"], args["topk_ids"], w1_scale=args["w1_scale"])


def test_packed_weights_wrong_last_dim():
    """is_vnni=True needs [E, 2N, K+4] / [E, K, N+4]; unpacked int8 shapes are rejected,
    and packed shapes with is_vnni=False too."""
    _, w1, _, w2, _, _, _ = make_case(1, E_, 1, N_, K_, torch.bfloat16)
    with raises(r"\bw1 must have shape \[8, 64, 68\] \(packed by convert_weight_packed\), "
                r"got \[8, 64, 64\]"):
        fused_int8(w1=w1)
    with raises(r"\bw2 must have shape \[8, 64, 36\] \(packed by convert_weight_packed\), "
                r"got \[8, 64, 32\]"):
        fused_int8(w2=w2)
    with raises(r"\bw1 must have shape \[8, 64, 64\], got \[8, 64, 68\]"):
        fused_int8(is_vnni=False)


@pytest.mark.parametrize("name", ["w1_zero", "w2_zero"])
def test_zeros_with_method_1(name):
    with raises(rf"{name} must be None for moe_comp_method 1 \(int8 w8a8\)"):
        fused_int8(**{name: torch.zeros(E_, 2 * N_, 1, dtype=torch.int8)})


def test_block_size_with_method_1():
    with raises(r"block_size must be None for moe_comp_method 1 \(int8 w8a8\)"):
        fused_int8(block_size=[64, 128])


def test_reduction_longer_than_exact_limit():
    """K or N > 65536 would overflow the int32 sums: a clear error, also for weights
    packed elsewhere (is_vnni=True skips our packer's check)."""
    K = 65568
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    tw, ti = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    w1 = torch.zeros(1, 64, K + 4, dtype=torch.int8)
    w2 = torch.zeros(1, K, 36, dtype=torch.int8)
    s1, s2 = torch.ones(1, 64, 1), torch.ones(1, K, 1)
    with raises(r"fused_experts_cpu: .*K=65568.*65536"):
        cpumoe.fused_experts(x, w1, w2, tw, ti, moe_comp_method=INT8, w1_scale=s1, w2_scale=s2)
    with raises(r"65568 input features"):
        cpumoe.fused_experts(x, w1[..., :K].contiguous(), w2[..., :32].contiguous(), tw, ti,
                             moe_comp_method=INT8, w1_scale=s1, w2_scale=s2, is_vnni=False)


def test_errors_via_bias_overload():
    args = int8_valid()
    b1, b2 = make_bias(E_, N_, K_)
    op = torch.ops.cpumoe.fused_experts_cpu.bias
    with raises(r"missing w2_scale for int8 w8a8"):
        op(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"],
           args["topk_ids"], False, INT8, args["w1_scale"], None, None, None, None, b1, b2,
           1.702, 7.0, True)


def test_shared_both_schemes():
    x, w1, s1, w2, s2, _ = make_shared(M_, N_, K_, torch.bfloat16)
    with raises(r"shared_expert_cpu: use_int8_w8a8 and use_fp8_w8a16 cannot both be True"):
        cpumoe.shared_expert(x, pack(w1), pack(w2), use_int8_w8a8=True, use_fp8_w8a16=True,
                             w1_scale=s1, w2_scale=s2)


def test_shared_fp8_with_int8_weights():
    """use_fp8_w8a16=True is implemented (tests/test_fp8.py): without block_size its scales
    are per tensor, so int8 weights with per-channel scales get an error naming w1 and
    the scheme; with use_int8_w8a8 as well, an error naming both flags."""
    x, w1, s1, w2, s2, _ = make_shared(M_, N_, K_, torch.bfloat16)
    with raises(r"shared_expert_cpu: w1 must be Float8_e4m3fn for use_fp8_w8a16=True"):
        cpumoe.shared_expert(x, pack(w1), pack(w2), use_fp8_w8a16=True, w1_scale=s1,
                             w2_scale=s2)
    with raises(r"shared_expert_cpu: use_int8_w8a8 and use_fp8_w8a16 cannot both be True"):
        cpumoe.shared_expert(x, pack(w1), pack(w2), use_int8_w8a8=True, use_fp8_w8a16=True,
                             w1_scale=s1, w2_scale=s2, block_size=[64, 128])


def test_shared_int8_argument_errors():
    x, w1, s1, w2, s2, _ = make_shared(M_, N_, K_, torch.bfloat16)
    pw1, pw2 = pack(w1), pack(w2)

    def call(a=pw1, b=pw2, sa=s1, sb=s2, **kw):
        return cpumoe.shared_expert(x, a, b, use_int8_w8a8=True, w1_scale=sa, w2_scale=sb, **kw)

    assert call().shape == (M_, K_)
    with raises(r"shared_expert_cpu: missing w1_scale for int8 w8a8"):
        call(sa=None)
    with raises(r"shared_expert_cpu: missing w2_scale for int8 w8a8"):
        call(sb=None)
    with raises(r"w1_scale must hold one scale per output channel \(64 values\)"):
        call(sa=torch.ones(N_, 1))
    with raises(r"w2_scale must be float32, got Half"):
        call(sb=s2.half())
    with raises(r"\bw1 must be Char for use_int8_w8a8=True \(int8 w8a8\), got BFloat16"):
        call(a=pack(torch.randn(2 * N_, K_).to(torch.bfloat16)))
    with raises(r"\bw1 must have shape \[64, 68\] \(packed by convert_weight_packed\)"):
        call(a=w1)
    with raises(r"block_size must be None for use_int8_w8a8=True"):
        call(block_size=[64, 128])
    with raises(r"w1_scale must be None for bf16/fp16 weights \(use_int8_w8a8 and "
                r"use_fp8_w8a16 False\)"):  # int8 flag off
        cpumoe.shared_expert(x, pack(w1.to(torch.bfloat16)), pack(w2.to(torch.bfloat16)),
                             w1_scale=s1)


# ---------------------------------------------------------------------------------------
# 7. Non-finite activations stay in their token.


def test_nonfinite_token_isolated(isa):
    """NaN (or inf) in one token's activations makes that token's row scale NaN, so its
    whole output row is NaN; tokens sharing its panels, experts and tiles are untouched."""
    M, E, topk, N, K = 30, 4, 2, 64, 96
    x, w1, s1, w2, s2, tw, ti = make_case(M, E, topk, N, K, torch.bfloat16)
    pw1, pw2 = pack(w1), pack(w2)

    def run(h):
        return cpumoe.fused_experts(h, pw1, pw2, tw, ti, moe_comp_method=INT8, w1_scale=s1,
                                    w2_scale=s2)

    clean = run(x)
    bad = x.clone()
    bad[0, 5] = float("nan")
    bad[13, 40] = float("inf")
    out = run(bad)
    keep = torch.ones(M, dtype=torch.bool)
    keep[[0, 13]] = False
    assert torch.isfinite(out[keep].float()).all()
    assert torch.equal(out[keep], clean[keep])
    assert torch.isnan(out[0].float()).all()
    assert not torch.isfinite(out[13].float()).any()
    ref = ref_int8(bad, w1, s1, w2, s2, tw, ti)
    assert torch.isnan(ref[0].float()).all()


# ---------------------------------------------------------------------------------------
# 8. The quantizers: reference.quantize_rows_int8 and quant.quantize_int8_per_channel.


def _reciprocal_trap_rows(dtype, count=16, K=32):
    """Rows of `dtype` values with amax in column 0 and v = +-amax/2 in column 1 (a tie
    127/2 in exact arithmetic), chosen so that rint(v * fl(127 / amax)) differs from
    rint(v * fl(fl(1 / amax) * 127)): they tell the kernels' one fp32 division from
    torch's `127 / tensor` (reciprocal, then multiply). Other columns are small."""
    import numpy as np

    cand = torch.linspace(0.3, 6.0, 4000).to(dtype).float().unique().numpy()
    rows = []
    for i, amax in enumerate(cand.astype(np.float32)):
        inv1 = np.float32(127.0) / amax
        inv2 = np.float32(np.float32(1.0) / amax) * np.float32(127.0)
        v = np.float32(amax / np.float32(2.0)) * np.float32(1 if i % 2 else -1)
        if np.rint(np.float32(v * inv1)) != np.rint(np.float32(v * inv2)):
            rows.append((float(amax), float(v)))
        if len(rows) == count:
            break
    x = torch.rand(len(rows), K) * 0.25 - 0.125
    for i, (amax, v) in enumerate(rows):
        x[i, 0], x[i, 1] = amax, v
    x = x.to(dtype)
    assert torch.equal(x[:, :2].float(), torch.tensor(rows))  # exact in `dtype`
    return x


def test_reference_quantize_rows_int8():
    """The reference's activation quantizer against numpy float32 arithmetic written out:
    amax floored at 1e-7, inv = float32(127) / amax (one division, as the kernels do),
    q = rint(x * inv) (round half to even), scale = amax / 127; NaN rows get a NaN scale.
    Includes rows built to expose torch's `127 / tensor` (reciprocal * 127)."""
    import numpy as np

    trap = _reciprocal_trap_rows(torch.bfloat16).float()
    assert trap.shape[0] == 16
    x = torch.randn(2000, 32) * torch.rand(2000, 1) * 10
    x[0] = 0
    x[1, :] = torch.tensor([127.0, 2.5, -2.5, 0.5] * 8)
    x = torch.cat([x, trap])
    q, scale = reference.quantize_rows_int8(x)
    xn = x.numpy().astype(np.float32)
    amax = np.maximum(np.abs(xn).max(1), np.float32(1e-7)).astype(np.float32)
    inv = (np.float32(127.0) / amax).astype(np.float32)
    qn = np.clip(np.rint((xn * inv[:, None]).astype(np.float32)), -127, 127)
    assert np.array_equal(q.numpy(), qn)
    assert np.array_equal(scale.numpy(), (amax / np.float32(127.0)).astype(np.float32))
    assert q[1, :4].tolist() == [127.0, 2.0, -2.0, 0.0] and torch.equal(q[0], torch.zeros(32))
    xnan = x[:3].clone()
    xnan[2, 7] = float("nan")
    qnan, snan = reference.quantize_rows_int8(xnan)
    assert torch.isnan(snan[2]) and torch.isfinite(snan[:2]).all()
    assert torch.equal(qnan[2], torch.zeros(32))  # NaN codes become 0 (the row's scale is NaN)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_trap_rows_through_the_op(isa, dt):
    """The op quantizes the reciprocal-trap rows with one fp32 division (127.0f / amax),
    as the reference does: bit for bit against int8_exact_reference."""
    x = _reciprocal_trap_rows(DTYPES[dt])
    M, K, N, E = x.shape[0], x.shape[1], 32, 2
    _, w1, s1, w2, s2, tw, ti = make_case(M, E, 1, N, K, DTYPES[dt])
    out = run_fused_int8(x, w1, s1, w2, s2, tw, ti, is_vnni=True)
    assert_matches_exact(out, int8_exact_reference(x, w1, s1, w2, s2, tw, ti), INT8)


# quant.quantize_int8_per_channel


@pytest.mark.parametrize("shape", [(64, 32), (3, 128, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
def test_quantize_int8_per_channel(shape, dtype):
    w = (torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 3).to(dtype)
    w[..., 3, :] = 0  # an all-zero channel
    q, scale = quant.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-1], 1)
    assert q.abs().max() <= 127
    nonzero = w.float().abs().amax(-1) > 0
    assert (q.abs().amax(-1)[nonzero] == 127).all()  # each nonzero channel spans the range
    # round trip: within half a step of each element, so |q*s - w| <= s/2 (+ fp rounding)
    err = (q.float() * scale - w.float()).abs()
    assert (err <= scale * 0.5 * (1 + 1e-5)).all()
    assert torch.equal(q[..., 3, :], torch.zeros_like(q[..., 3, :]))
    assert (scale[..., 3, :] > 0).all()  # no zero scale for a zero channel
    torch.testing.assert_close(scale[..., :3, 0],
                               w.float()[..., :3, :].abs().amax(-1) / 127)
    # usable by the op: its weights quantized this way give a close result to float math
    if len(shape) == 3 and dtype == torch.float32:
        E, OC, IC = shape
        N, K = OC // 2, IC
        w2f = torch.randn(E, K, N) / N ** 0.5
        w2q, s2 = quant.quantize_int8_per_channel(w2f)
        x = torch.randn(5, K).to(torch.bfloat16)
        tw, ti = make_routing(5, E, 2)
        out = run_fused_int8(x, q, scale, w2q, s2, tw, ti, is_vnni=True)
        flt = reference.fused_experts(x, w.float(), w2f, tw, ti)  # float weights, fp32 math
        rel = (out.float() - flt.float()).norm() / flt.float().norm()
        assert rel < 0.05, rel  # int8 weights and activations: a few % of quantization noise
