"""INT4 W4A8 (fused_experts_cpu moe_comp_method=3): AWQ/GPTQ 4-bit weights with per-group
zero points and scales, packed by convert_weight_packed_scale_zp; activations quantized per
row inside the op as for INT8 (docs/MATH.md, INT4 W4A8; docs/FORMATS.md, int4 weights).

Packing byte for byte against reference.pack_int4 and against the layout text itself;
the op against reference.py on every tier, bit for bit against the reference in the
kernels' exact order, bit for bit across tiers, thread counts and the decode/prefill
paths; AWQ and GPTQ, group sizes 32..384; routing edge cases; the errors.
"""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import quant, reference
from cpumoe_testing import (
    DTYPES,
    INT4,
    SUPPORTED_ISAS,
    Int4Weights,
    assert_int4_close,
    assert_matches_exact,
    assert_tiers_agree,
    isa_params,
    make_bias,
    make_routing,
    needs_two_tiers,
    ref_int4,
    run_fused_int4,
    use_isa,
)
from exact_reference import int4_exact_reference

# ---------------------------------------------------------------------------------------
# 1. Packing


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("oc, ic, group", [(32, 128, 32), (64, 256, 64), (96, 256, 128),
                                           (32, 512, 256), (64, 768, 384), (32, 96, 48)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("lead", [(), (3,)], ids=["2d", "3d"])
@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["f16", "bf16", "f32"])
def test_pack_matches_reference(fmt, oc, ic, group, lead, scales_dtype):
    w = torch.randn(*lead, oc, ic)
    ckpt = quant.quantize_int4(w, group, fmt, scales_dtype)
    method = 0 if fmt == "awq" else 1
    got = cpumoe.convert_weight_packed_scale_zp(*ckpt, method)
    expected = reference.pack_int4(*reference.unpack_int4_checkpoint(*ckpt, method))
    bk = min(group, 128)
    assert got[0].shape == (*lead, oc // 32, ic // bk, 16 * bk + 128)
    assert got[1].shape == got[2].shape == (*lead, oc // 32, ic // group, 32)
    assert (got[0].dtype, got[1].dtype, got[2].dtype) == (torch.uint8, torch.int8, torch.float32)
    for g, e, name in zip(got, expected, ("weight", "zeros", "scales")):
        assert torch.equal(g, e), f"{name} differs from reference.pack_int4"


def test_pack_layout_by_hand():
    """The layout text of docs/FORMATS.md (int4 weights), element by element,
    independent of reference.pack_int4: one output tile, bk = 32 (group 32), K = 64."""
    oc, ic, group = 32, 64, 32
    nib = torch.randint(0, 16, (oc, ic), dtype=torch.int32)
    zero = torch.randint(0, 16, (oc, ic // group), dtype=torch.int32)
    scale = torch.rand(oc, ic // group)
    # AWQ checkpoint from the nibbles by the AWQ word order (column j in nibble order[j])
    order = quant.AWQ_NIBBLE_OF_COLUMN
    qweight = torch.zeros(ic, oc // 8, dtype=torch.int64)
    qzeros = torch.zeros(ic // group, oc // 8, dtype=torch.int64)
    for n in range(oc):
        qweight[:, n // 8] |= nib[n, :].long() << (4 * order[n % 8])
        qzeros[:, n // 8] |= zero[n, :].long() << (4 * order[n % 8])
    wrap = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)  # noqa: E731
    packed, zeros, scales = cpumoe.convert_weight_packed_scale_zp(
        wrap(qweight), wrap(qzeros), scale.t().contiguous(), 0)
    block_bytes = 16 * group + 128
    lane_column = [c if c < 8 else c + 8 for c in range(16)]
    for kb in range(ic // group):
        block = packed[0, kb]
        assert block.numel() == block_bytes
        for k in range(group):
            kk, b = divmod(k, 4)
            for lane in range(16):
                byte = int(block[kk * 64 + lane * 4 + b])
                n = lane_column[lane]
                assert byte & 15 == nib[n, kb * group + k]
                assert byte >> 4 == nib[n + 8, kb * group + k]
        comp = block[16 * group:].view(torch.int32)
        expected = (nib[:, kb * group:(kb + 1) * group] - zero[:, kb:kb + 1]).sum(-1)
        assert torch.equal(comp, expected.to(torch.int32))
    assert torch.equal(zeros[0], zero.t().to(torch.int8))
    assert torch.equal(scales[0], scale.t())


def test_gptq_zero_points_plus_one():
    """GPTQ v1 stores zero - 1: the packer adds one back (so zero points reach 16)."""
    oc, ic, group = 32, 64, 32
    qweight = torch.zeros(ic // 8, oc, dtype=torch.int32)
    qzeros = torch.full((ic // group, oc // 8), -1, dtype=torch.int32)  # every nibble 15
    scales = torch.ones(ic // group, oc, dtype=torch.float16)
    packed, zeros, _ = cpumoe.convert_weight_packed_scale_zp(qweight, qzeros, scales, 1)
    assert (zeros == 16).all()
    comp = packed[0, 0, 16 * group:].view(torch.int32)
    assert (comp == -16 * group).all()  # w = 0 everywhere: sum of (0 - 16) over the block


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_quantize_int4_round_trip(fmt):
    w = torch.randn(2, 64, 256)
    ckpt = quant.quantize_int4(w, 64, fmt, torch.float32)
    nib, zero, scale = reference.unpack_int4_checkpoint(*ckpt, 0 if fmt == "awq" else 1)
    assert nib.min() >= 0 and nib.max() <= 15
    assert zero.min() >= (1 if fmt == "gptq" else 0) and zero.max() <= 15
    deq = reference.dequantize_int4(nib, zero, scale)
    step = scale.repeat_interleave(64, -1)
    # within half a step, plus the clipping of a GPTQ group whose zero point was raised to 1
    err = (deq - w).abs() / step
    assert err.max() <= (0.5001 if fmt == "awq" else 1.0001), err.max()
    assert err.mean() < 0.3


# ---------------------------------------------------------------------------------------
# 2. The op against the reference on every tier


# (M, E, topk, N, K, group, dtype, fmt): every M meets decode (<= 4 rows per expert) and
# prefill (several panels per expert) blocks; groups 32, 64, 128, 256 and 384 (bk 128 with
# two and three blocks per group), and 24 (6 k-quads: not a whole number of the 4-quad int16
# runs of avx2's prefill GEMM); both formats and dtypes
CASES = [
    (1, 1, 1, 32, 128, 32, "bf16", "awq"),
    (3, 8, 2, 64, 256, 64, "fp16", "gptq"),
    (5, 64, 8, 128, 128, 128, "bf16", "gptq"),
    (39, 8, 3, 128, 256, 128, "fp16", "awq"),
    (130, 8, 3, 32, 256, 32, "bf16", "gptq"),
    (130, 4, 1, 128, 512, 256, "fp16", "awq"),
    (17, 3, 3, 64, 128, 64, "bf16", "awq"),
    (4, 4, 2, 384, 768, 384, "bf16", "gptq"),
    (39, 4, 2, 96, 192, 24, "fp16", "awq"),
]


def case_id(c):
    M, E, topk, N, K, group, dt, fmt = c
    return f"M{M}-E{E}-top{topk}-N{N}-K{K}-g{group}-{dt}-{fmt}"


def make_case(M, E, topk, N, K, group, dtype, fmt, **routing):
    w = Int4Weights(E, N, K, min(group, K), fmt, group2=min(group, N))
    x = torch.randn(M, K).to(dtype)
    tw, ti = make_routing(M, E, topk, **routing)
    return x, w, tw, ti


def tier_case_params(cases):
    return [pytest.param(t.values[0], c, marks=t.marks, id=f"{t.id}-{case_id(c)}")
            for t in isa_params() for c in cases]


@pytest.mark.parametrize("isa, case", tier_case_params(CASES), indirect=["isa"])
def test_matches_reference(isa, case):
    x, w, tw, ti = make_case(*case[:6], DTYPES[case[6]], case[7])
    x_before = x.clone()
    out = run_fused_int4(x, w, tw, ti)
    assert torch.equal(x, x_before)
    ref = ref_int4(x, w, tw, ti)
    assert (ref.float().abs().amax(-1) > 0).all()
    assert_int4_close(out, ref, f"tier={isa}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_exact_reference_bitwise(case):
    """Bit for bit against reference.py with the kernels' exp and slot-order sum: the
    activation quantization, exact block sums, one fmaf per block with the group scale,
    times the row scale, 16-bit intermediate, re-quantization and the fp32 topk sum.
    On the best tier; test_tiers_bit_identical carries it to the others."""
    x, w, tw, ti = make_case(*case[:6], DTYPES[case[6]], case[7])
    out = run_fused_int4(x, w, tw, ti)
    expected = int4_exact_reference(x, w, tw, ti)
    assert_matches_exact(out, expected, INT4)


@needs_two_tiers
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tiers_bit_identical(case):
    """Every tier equals the first tier of its numerics class bit for bit, and that one
    the worst tier within CROSS_CLASS_TOLERANCE."""
    x, w, tw, ti = make_case(*case[:6], DTYPES[case[6]], case[7])
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = run_fused_int4(x, w, tw, ti)
    assert_tiers_agree(outs, INT4)


def test_decode_and_prefill_paths_agree(isa):
    """A token's output does not depend on how many other tokens share its experts: alone
    (few rows per expert: nibbles expanded in registers on avx512) and inside a batch that
    routes 60 tokens to the same experts (unpacked once per chunk, several panels)."""
    M, E, topk, N, K = 60, 4, 2, 64, 256
    x, w, tw, ti = make_case(M, E, topk, N, K, 128, torch.bfloat16, "awq")
    ti[:, 0], ti[:, 1] = 1, 2
    batch = run_fused_int4(x, w, tw, ti)
    for i in (0, 7, 59):
        alone = run_fused_int4(x[i:i + 1], w, tw[i:i + 1], ti[i:i + 1])
        assert torch.equal(alone[0], batch[i]), i
    for rows in (2, 3, 4, 5):
        assert torch.equal(run_fused_int4(x[:rows], w, tw[:rows], ti[:rows]), batch[:rows])


def test_thread_count_independent(isa):
    x, w, tw, ti = make_case(130, 8, 3, 64, 256, 64, torch.bfloat16, "gptq", drop_prob=0.1)
    outs = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        outs.append(run_fused_int4(x, w, tw, ti))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_groups_differ_between_w1_and_w2(isa):
    """w1 and w2 may have different group sizes (SGLang assumes one; each is derived from
    its own scales here)."""
    x, _, tw, ti = make_case(9, 4, 2, 64, 256, 64, torch.bfloat16, "awq")
    w = Int4Weights(4, 64, 256, 128, "awq", group2=32)
    assert_int4_close(run_fused_int4(x, w, tw, ti), ref_int4(x, w, tw, ti))


def test_group_scales_and_zeros_are_used(isa):
    """Changing one group's scale or zero point of one column changes exactly the outputs
    that depend on it (a kernel that read the wrong group would not)."""
    M, E, N, K = 4, 1, 32, 256
    x, w, tw, ti = make_case(M, E, 1, N, K, 64, torch.bfloat16, "awq")
    base = run_fused_int4(x, w, tw, ti)
    for which in ("scale", "zero"):
        packed = list(w.p1)
        t = packed[2 if which == "scale" else 1].clone()
        if which == "scale":
            t[0, 1, 2, 5] *= 4  # expert 0, gate rows 32..63 tile, group 2, column 5
        else:
            t[0, 1, 2, 5] = (t[0, 1, 2, 5] + 7) % 16
        # the zero point is also folded into the block's compensation: keep that consistent
        if which == "zero":
            u = list(w.u1)
            u[1] = u[1].clone()
            u[1][0, 37, 2] = t[0, 1, 2, 5].int()
            repacked = reference.pack_int4(*u)
            packed = [repacked[0], repacked[1], packed[2]]
            ref = reference.fused_experts(x, w.u1[0], w.u2[0], tw, ti, moe_comp_method=INT4,
                                          w1_scale=w.u1[2], w2_scale=w.u2[2], w1_zero=u[1],
                                          w2_zero=w.u2[1])
        else:
            packed[2] = t
            s = w.u1[2].clone()
            s[0, 37, 2] *= 4
            ref = reference.fused_experts(x, w.u1[0], w.u2[0], tw, ti, moe_comp_method=INT4,
                                          w1_scale=s, w2_scale=w.u2[2], w1_zero=w.u1[1],
                                          w2_zero=w.u2[1])
        out = cpumoe.fused_experts(x, packed[0], w.p2[0], tw, ti, moe_comp_method=INT4,
                                   w1_scale=packed[2], w2_scale=w.p2[2], w1_zero=packed[1],
                                   w2_zero=w.p2[1])
        assert not torch.equal(out, base), which
        assert_int4_close(out, ref, which)


# ---------------------------------------------------------------------------------------
# 3. Routing, dtypes, inplace, bias


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_minus_one_ids(isa, ids_dtype):
    x, w, tw, ti = make_case(23, 8, 3, 32, 128, 32, torch.float16, "awq", drop_prob=0.3,
                             ids_dtype=ids_dtype)
    ti[0] = -1  # a token with no expert at all gives zeros
    out = run_fused_int4(x, w, tw, ti)
    assert (out[0] == 0).all()
    assert_int4_close(out, ref_int4(x, w, tw, ti))


@pytest.mark.parametrize("wdt", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=["f32", "f64", "bf16", "f16"])
def test_topk_weights_dtypes(isa, wdt):
    """Any float topk_weights (SGLang's INT4 path requires float32; docs/SGLANG.md, inputs
    SGLang does not support)."""
    x, w, tw, ti = make_case(7, 8, 2, 32, 128, 64, torch.bfloat16, "gptq")
    tw = tw.to(wdt)
    assert_int4_close(run_fused_int4(x, w, tw, ti), ref_int4(x, w, tw.float(), ti))


def test_inplace(isa):
    x, w, tw, ti = make_case(11, 8, 2, 32, 128, 32, torch.float16, "awq")
    ref = ref_int4(x, w, tw, ti)
    out = run_fused_int4(x, w, tw, ti, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    assert_int4_close(x, ref)


def test_empty_batch():
    _, w, _, _ = make_case(1, 4, 1, 32, 128, 32, torch.bfloat16, "awq")
    x = torch.empty(0, 128, dtype=torch.bfloat16)
    out = run_fused_int4(x, w, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 128)


def test_all_tokens_one_expert(isa):
    x, w, tw, ti = make_case(70, 8, 1, 64, 128, 128, torch.bfloat16, "awq")
    ti[:] = 5
    out = run_fused_int4(x, w, tw, ti)
    (w1, z1, s1), (w2, z2, s2) = w.u1, w.u2
    expected = reference.expert_mlp_int4(x, w1[5], z1[5], s1[5], w2[5], z2[5], s2[5]) * tw
    assert_int4_close(out, expected.to(x.dtype))


def test_large_batch_spans_chunks():
    """More tokens than one pipeline chunk (1024)."""
    x, w, tw, ti = make_case(1100, 4, 2, 32, 128, 128, torch.bfloat16, "gptq")
    assert_int4_close(run_fused_int4(x, w, tw, ti), ref_int4(x, w, tw, ti))


@pytest.mark.parametrize("act", ["silu", "swiglu"])
def test_bias_and_swiglu(isa, act):
    """Biases and GPT-OSS's clamped swiglu work for INT4 too (SGLang ignores them there)."""
    M, E, topk, N, K = 9, 4, 2, 64, 128
    x, w, tw, ti = make_case(M, E, topk, N, K, 64, torch.bfloat16, "awq")
    b1, b2 = make_bias(E, N, K)
    kw = dict(w1_bias=b1, w2_bias=b2)
    if act == "swiglu":
        kw.update(alpha=1.702, limit=7.0)
    out = run_fused_int4(x, w, tw, ti, **kw)
    assert_int4_close(out, ref_int4(x, w, tw, ti, **kw))
    assert_matches_exact(out, int4_exact_reference(x, w, tw, ti, **kw), INT4)
    assert not torch.equal(out, run_fused_int4(x, w, tw, ti))


def test_sglang_int4_moe_case():
    """The data of SGLang's own CPU test test_int4_moe: AWQ qweight = randint(-127, 128)
    words, qzeros = randint(0, 10), scales rand*1e-3 bf16, a = rand/sqrt(K), group 128,
    M in {1, 6}, N=512, K=256, E=8, topk=4; compared with dequantized weights."""
    E, topk, N, K, group = 8, 4, 512, 256, 128
    for M in (1, 6):
        qw1 = torch.randint(-127, 128, (E, K, 2 * N // 8), dtype=torch.int32)
        qz1 = torch.randint(0, 10, (E, K // group, 2 * N // 8), dtype=torch.int32)
        sc1 = (torch.rand(E, K // group, 2 * N) * 1e-3).bfloat16()
        qw2 = torch.randint(-127, 128, (E, N, K // 8), dtype=torch.int32)
        qz2 = torch.randint(0, 10, (E, N // group, K // 8), dtype=torch.int32)
        sc2 = (torch.rand(E, N // group, K) * 1e-3).bfloat16()
        a = (torch.rand(M, K) / K ** 0.5).bfloat16()
        tw, ti = make_routing(M, E, topk)
        p1 = cpumoe.convert_weight_packed_scale_zp(qw1, qz1, sc1, 0)
        p2 = cpumoe.convert_weight_packed_scale_zp(qw2, qz2, sc2, 0)
        out = torch.ops.cpumoe.fused_experts_cpu(a, p1[0], p2[0], tw, ti, False, INT4, p1[2],
                                                 p2[2], p1[1], p2[1], None, True)
        u1 = reference.unpack_int4_checkpoint(qw1, qz1, sc1, 0)
        u2 = reference.unpack_int4_checkpoint(qw2, qz2, sc2, 0)
        ref = reference.fused_experts(a, u1[0], u2[0], tw, ti, moe_comp_method=INT4,
                                      w1_scale=u1[2], w2_scale=u2[2], w1_zero=u1[1],
                                      w2_zero=u2[1])
        assert_int4_close(out, ref, f"M={M}")
        # and against plain fp32 math on the dequantized weights, SGLang's 1e-2 tolerance
        deq = reference.fused_experts(a, reference.dequantize_int4(*u1).bfloat16(),
                                      reference.dequantize_int4(*u2).bfloat16(), tw, ti)
        scale = deq.float().abs().max()
        assert (out.float() - deq.float()).abs().max() <= 0.05 * scale


# ---------------------------------------------------------------------------------------
# 4. Errors


def good_call():
    x, w, tw, ti = make_case(3, 4, 2, 32, 128, 64, torch.bfloat16, "awq")
    args = dict(hidden_states=x, w1=w.p1[0], w2=w.p2[0], topk_weights=tw, topk_ids=ti)
    return args, w.op_kwargs()


def call(args, kw):
    return cpumoe.fused_experts(args["hidden_states"], args["w1"], args["w2"],
                                args["topk_weights"], args["topk_ids"], **kw)


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale", "w1_zero", "w2_zero"])
def test_missing_scale_or_zero(name):
    args, kw = good_call()
    kw[name] = None
    with pytest.raises(RuntimeError, match=f"missing {name} for moe_comp_method 3"):
        call(args, kw)


@pytest.mark.parametrize("name, bad, match", [
    ("w1_scale", lambda t: t.half(), "w1_scale must be Float"),
    ("w2_zero", lambda t: t.int(), "w2_zero must be Char"),
    ("w1_zero", lambda t: t[:, :, :1].contiguous(), "w1_zero must have the shape of w1_scale"),
    ("w2_scale", lambda t: t.reshape(t.shape[0], -1), r"w2_scale must have shape \[E=4"),
    ("w1_scale", lambda t: t[:, :1].contiguous(), "w1_scale must cover 2N"),
    ("w1_scale", lambda t: t.transpose(2, 3), "w1_scale must have shape|must be contiguous"),
], ids=["scale-f16", "zero-i32", "zero-shape", "scale-3d", "scale-odd-blocks", "scale-noncontig"])
def test_bad_scale_or_zero(name, bad, match):
    args, kw = good_call()
    kw[name] = bad(kw[name])
    with pytest.raises(RuntimeError, match=match):
        call(args, kw)


def test_weight_errors():
    args, kw = good_call()
    bad = dict(args, w1=args["w1"].view(torch.int8))
    with pytest.raises(RuntimeError, match="w1 must be uint8 for moe_comp_method 3"):
        call(bad, kw)
    bad = dict(args, w2=args["w2"].reshape(args["w2"].shape[0], -1, args["w2"].shape[-1]))
    with pytest.raises(RuntimeError, match="int4 w1 and w2 must be 4-D"):
        call(bad, kw)
    bad = dict(args, w1=args["w1"][:, :, :1].contiguous())
    with pytest.raises(RuntimeError, match="w1 must have shape"):
        call(bad, kw)
    with pytest.raises(RuntimeError, match="is_vnni=True"):
        call(args, dict(kw, is_vnni=False))
    with pytest.raises(RuntimeError, match="block_size must be None"):
        call(args, dict(kw, block_size=[128, 128]))
    # the scales say K has 2 groups, so a hidden size the groups do not divide is rejected
    x = torch.randn(3, 96).bfloat16()
    with pytest.raises(RuntimeError, match="do not divide|group size"):
        call(dict(args, hidden_states=x), kw)


def test_unsupported_group_size_in_op():
    """group 192 (K=384 in 2 groups): neither <= 128 nor a multiple of 128."""
    args, kw = good_call()
    x = torch.randn(3, 384).bfloat16()
    s = torch.ones(4, 2, 2, 32)
    z = torch.zeros(4, 2, 2, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="group size 192"):
        call(dict(args, hidden_states=x), dict(kw, w1_scale=s, w1_zero=z))


@pytest.mark.parametrize("what, match", [
    ("method", "quant_method_4bit must be 0 \\(AWQ\\) or 1 \\(GPTQ\\)"),
    ("qweight_dtype", "weight must be int32"),
    ("qzeros_dtype", "qzeros must be int32"),
    ("scales_dtype", "scales must be bfloat16, float16 or float32"),
    ("dims", "must all be 2-D or all 3-D"),
    ("experts", "same number of experts"),
    ("oc", "invalid weight out features 16"),
    ("groups", "cannot be split into 3 groups"),
    ("group192", "group size 192"),
    ("scales_shape", "scales must be"),
    ("qzeros_shape", "qzeros must be"),
    ("noncontig", "must be contiguous"),
])
def test_pack_errors(what, match):
    qw, qz, sc = quant.quantize_int4(torch.randn(2, 64, 256), 128, "awq")
    method = 0
    if what == "method":
        method = 2
    elif what == "qweight_dtype":
        qw = qw.long()
    elif what == "qzeros_dtype":
        qz = qz.to(torch.int16)
    elif what == "scales_dtype":
        sc = sc.double()
    elif what == "dims":
        qw = qw[0]
    elif what == "experts":
        qz, sc = qz[:1], sc[:1]
    elif what == "oc":
        qw, qz, sc = quant.quantize_int4(torch.randn(2, 16, 256), 128, "awq")
    elif what == "groups":
        qz = torch.zeros(2, 3, 8, dtype=torch.int32)
        sc = torch.ones(2, 3, 64, dtype=torch.float16)
    elif what == "group192":
        qw, qz, sc = quant.quantize_int4(torch.randn(2, 64, 384), 192, "awq")
    elif what == "scales_shape":
        sc = sc[:, :, :32].contiguous()
    elif what == "qzeros_shape":
        qz = qz[:, :1].contiguous()
    elif what == "noncontig":
        qw = qw.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RuntimeError, match=match):
        cpumoe.convert_weight_packed_scale_zp(qw, qz, sc, method)


def test_pack_fake_matches_real():
    """The meta kernel gives the real op's shapes and dtypes (torch.compile tracing)."""
    qw, qz, sc = quant.quantize_int4(torch.randn(2, 32, 256), 256, "gptq")
    real = cpumoe.convert_weight_packed_scale_zp(qw, qz, sc, 1)
    fake = torch.ops.cpumoe.convert_weight_packed_scale_zp(qw.to("meta"), qz.to("meta"),
                                                           sc.to("meta"), 1)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype)
    torch.library.opcheck(torch.ops.cpumoe.convert_weight_packed_scale_zp.default,
                          (qw, qz, sc, 1))
