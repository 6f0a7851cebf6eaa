"""Every bad input is a RuntimeError whose message names the argument (DESIGN.md §3),
never a crash, a hang or silent garbage."""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe_testing import make_bias, make_routing, make_weights, pack

M, E, TOPK, N, K = 4, 8, 2, 32, 64
BF16 = torch.bfloat16


def valid(dtype=BF16):
    """Valid, packed fused_experts arguments as a dict of keyword arguments."""
    x = torch.randn(M, K).to(dtype)
    w1, w2 = make_weights(E, N, K, dtype)
    tw, ti = make_routing(M, E, TOPK)
    return dict(hidden_states=x, w1=pack(w1), w2=pack(w2), topk_weights=tw, topk_ids=ti)


def fused(**over):
    args = valid()
    args.update(over)
    return cpumoe.fused_experts(args.pop("hidden_states"), args.pop("w1"), args.pop("w2"),
                                args.pop("topk_weights"), args.pop("topk_ids"), **args)


def raises(pattern):
    return pytest.raises(RuntimeError, match=pattern)


def test_valid_arguments_pass():
    """The baseline the error tests perturb is itself accepted."""
    assert fused().shape == (M, K)


# ---------------------------------------------------------------------------------------
# hidden_states


def test_hidden_float32():
    with raises(r"hidden_states must be bfloat16 or float16, got Float"):
        fused(hidden_states=torch.randn(M, K))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_hidden_other_dtypes(dtype):
    with raises(r"hidden_states must be bfloat16 or float16"):
        fused(hidden_states=torch.ones(M, K, dtype=dtype))


@pytest.mark.parametrize("shape", [(K,), (1, M, K)], ids=["1d", "3d"])
def test_hidden_rank(shape):
    with raises(r"hidden_states must be a 2-D tensor"):
        fused(hidden_states=torch.randn(*shape).to(BF16))


def test_hidden_noncontiguous():
    x = torch.randn(K, M).to(BF16).t()
    with raises(r"hidden_states must be contiguous"):
        fused(hidden_states=x)
    x2 = torch.randn(M, 2 * K).to(BF16)[:, ::2]
    with raises(r"hidden_states must be contiguous"):
        fused(hidden_states=x2)


def test_meta_tensors():
    """Any meta tensor among the arguments sends the call to the registered fake kernel
    (the Meta dispatch key outranks CPU), never into the C kernels. Observed in this
    build: all-meta arguments give an empty [M, K] meta result (shape inference);
    meta mixed with CPU tensors is a RuntimeError naming the tensor on the other
    device. Accepted: a meta result of the right shape or a RuntimeError; never a
    crash, and never a CPU tensor (it could only be uninitialized memory)."""
    args = valid()
    meta = {k: v.to("meta") for k, v in args.items()}
    out = cpumoe.fused_experts(meta["hidden_states"], meta["w1"], meta["w2"],
                               meta["topk_weights"], meta["topk_ids"])
    assert out.device.type == "meta" and out.shape == (M, K) and out.dtype == BF16
    for which in ("hidden_states", "w1", "w2", "topk_weights", "topk_ids"):
        mixed = dict(args, **{which: meta[which]})
        try:
            out = cpumoe.fused_experts(mixed["hidden_states"], mixed["w1"], mixed["w2"],
                                       mixed["topk_weights"], mixed["topk_ids"])
        except RuntimeError as e:
            other = "w1" if which == "hidden_states" else which
            assert other in str(e) and "meta" in str(e), e
            continue
        assert out.device.type == "meta", f"meta {which} gave a {out.device} result"
        assert out.shape == (M, K)
    # same for shared_expert and the packer
    x = torch.empty(M, K, dtype=BF16, device="meta")
    out = cpumoe.shared_expert(x, torch.empty(2 * N, K, dtype=BF16, device="meta"),
                               torch.empty(K, N, dtype=BF16, device="meta"))
    assert out.device.type == "meta" and out.shape == (M, K)
    p = cpumoe.convert_weight_packed(torch.empty(2, 64, 32, dtype=BF16, device="meta"))
    assert p.device.type == "meta" and p.shape == (2, 64, 32)


# ---------------------------------------------------------------------------------------
# weights


def test_w1_wrong_dtype():
    w1, _ = make_weights(E, N, K, torch.float16)
    with raises(r"\bw1 must .*BFloat16.*got Half"):
        fused(w1=pack(w1))


def test_w2_wrong_dtype():
    _, w2 = make_weights(E, N, K, torch.float16)
    with raises(r"\bw2 must .*BFloat16.*got Half"):
        fused(w2=pack(w2))


def test_w1_wrong_k():
    w1, _ = make_weights(E, N, 2 * K, BF16)
    with raises(r"\bw1 must .*got (shape )?\[8, 64, 128\]"):
        fused(w1=pack(w1))


@pytest.mark.parametrize("shape", [(E, K, 2 * N), (E, 2 * K, N), (E, K)],
                         ids=["N-doubled", "K-doubled", "2d"])
def test_w2_wrong_shape(shape):
    with raises(r"w2 must (have shape|be a 3-D tensor)"):
        fused(w2=torch.zeros(*shape, dtype=BF16))


def test_e_mismatch():
    _, w2 = make_weights(E + 1, N, K, BF16)
    with raises(r"w2 must have shape \[8, 64, 32\], got \[9, 64, 32\]"):
        fused(w2=pack(w2))


def test_w1_rank():
    with raises(r"w1 must be a 3-D tensor"):
        fused(w1=torch.zeros(2 * N, K, dtype=BF16))


def test_w1_odd_rows():
    with raises(r"w1.size\(1\) must be 2N"):
        fused(w1=torch.zeros(E, 2 * N + 1, K, dtype=BF16))


def test_w1_noncontiguous():
    w1 = torch.zeros(E, 2 * N, 2 * K, dtype=BF16)[:, :, ::2]
    with raises(r"w1 must be contiguous"):
        fused(w1=w1)


@pytest.mark.parametrize("n", [16, 48, 40])
def test_n_not_multiple_of_32(n):
    w1, w2 = make_weights(E, n, K, BF16)
    with raises(r"intermediate size N=\d+ .*must be a multiple of 32"):
        fused(w1=w1, w2=w2, is_vnni=False)


@pytest.mark.parametrize("k", [16, 48, 100])
def test_k_not_multiple_of_32(k):
    w1, w2 = make_weights(E, N, k, BF16)
    with raises(r"hidden size K=\d+ must be a multiple of 32"):
        fused(hidden_states=torch.randn(M, k).to(BF16), w1=w1, w2=w2, is_vnni=False)


# ---------------------------------------------------------------------------------------
# routing


def test_routing_shape_mismatch():
    tw, ti = make_routing(M, E, TOPK)
    with raises(r"topk_weights and topk_ids must have the same shape"):
        fused(topk_weights=tw[:, :1])
    with raises(r"topk_weights and topk_ids must have the same shape"):
        fused(topk_ids=torch.cat([ti, ti], dim=1))


def test_routing_rank():
    tw, ti = make_routing(M, E, TOPK)
    with raises(r"topk_weights must be 2-D"):
        fused(topk_weights=tw.flatten())
    with raises(r"topk_ids must be 2-D"):
        fused(topk_ids=ti.flatten())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_topk_ids_dtype(dtype):
    _, ti = make_routing(M, E, TOPK)
    with raises(r"topk_ids must be int32 or int64"):
        fused(topk_ids=ti.to(dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_topk_weights_integer(dtype):
    tw, _ = make_routing(M, E, TOPK)
    with raises(r"topk_weights must be float32, float64, bfloat16 or float16"):
        fused(topk_weights=tw.to(dtype))


def test_topk_ids_wrong_m():
    tw, ti = make_routing(M + 1, E, TOPK)
    with raises(r"topk_ids must have M = hidden_states.size\(0\) = 4 rows"):
        fused(topk_weights=tw, topk_ids=ti)


def test_topk_zero():
    with raises(r"topk must be at least 1"):
        fused(topk_weights=torch.empty(M, 0), topk_ids=torch.empty(M, 0, dtype=torch.int32))


@pytest.mark.parametrize("bad", [E, E + 5, -2, -100, 2 ** 31 - 1, -(2 ** 31)],
                         ids=["E", "E+5", "-2", "-100", "int32max", "int32min"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_ids_out_of_range(ids_dtype, bad):
    _, ti = make_routing(M, E, TOPK, ids_dtype=ids_dtype)
    ti[2, 1] = bad
    with raises(rf"topk_ids\[2, 1\] = {bad} is outside \[0, {E}\)"):
        fused(topk_ids=ti)


@pytest.mark.parametrize("bad", [2 ** 40, -(2 ** 40), 2 ** 32 + 3], ids=["2^40", "-2^40", "2^32+3"])
def test_ids_out_of_range_int64_huge(bad):
    """Values that would alias a valid id if truncated to 32 bits must still be rejected
    (2^32 + 3 truncates to 3)."""
    _, ti = make_routing(M, E, TOPK, ids_dtype=torch.int64)
    ti[0, 0] = bad
    with raises(rf"topk_ids\[0, 0\] = {bad} is outside"):
        fused(topk_ids=ti)


def test_bad_id_does_not_touch_output_inplace():
    """A rejected call with inplace=True leaves hidden_states untouched."""
    args = valid()
    x = args["hidden_states"]
    before = x.clone()
    args["topk_ids"][1, 0] = E
    with raises(r"topk_ids"):
        fused(**dict(args, inplace=True))
    assert torch.equal(x, before)


# ---------------------------------------------------------------------------------------
# biases, alpha/limit


def test_w1_bias_without_w2_bias():
    b1, _ = make_bias(E, N, K)
    with raises(r"w1_bias and w2_bias must be given together \(got only w1_bias\)"):
        fused(w1_bias=b1)


def test_w2_bias_without_w1_bias():
    _, b2 = make_bias(E, N, K)
    with raises(r"w1_bias and w2_bias must be given together \(got only w2_bias\)"):
        fused(w2_bias=b2)


@pytest.mark.parametrize("which", ["w1_bias", "w2_bias"])
@pytest.mark.parametrize("dtype", [BF16, torch.float64])
def test_bias_dtype(which, dtype):
    b = dict(zip(("w1_bias", "w2_bias"), make_bias(E, N, K)))
    b[which] = b[which].to(dtype)
    with raises(rf"{which} must be float32"):
        fused(**b)


@pytest.mark.parametrize("which, shape", [
    ("w1_bias", (E, N)), ("w1_bias", (E + 1, 2 * N)), ("w2_bias", (E, N)), ("w2_bias", (1, K)),
])
def test_bias_shape(which, shape):
    b = dict(zip(("w1_bias", "w2_bias"), make_bias(E, N, K)))
    b[which] = torch.zeros(*shape)
    with raises(rf"{which} must have shape"):
        fused(**b)


@pytest.mark.parametrize("which", ["w1_bias", "w2_bias"])
def test_bias_rank_and_contiguity(which):
    b = dict(zip(("w1_bias", "w2_bias"), make_bias(E, N, K)))
    good = b[which]
    with raises(rf"{which} must be a 2-D tensor"):
        fused(**dict(b, **{which: good.flatten()}))
    nc = torch.zeros(good.shape[1], good.shape[0]).t()
    with raises(rf"{which} must be contiguous"):
        fused(**dict(b, **{which: nc}))


def test_alpha_without_limit():
    with raises(r"alpha and limit must be given together.*got only alpha"):
        fused(alpha=1.702)
    with raises(r"alpha and limit must be given together.*got only limit"):
        fused(limit=7.0)


# ---------------------------------------------------------------------------------------
# moe_comp_method and its scale/zero arguments


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale", "w1_zero", "w2_zero"])
def test_scales_with_method_0(name):
    with raises(rf"{name} must be None for moe_comp_method 0"):
        fused(**{name: torch.ones(E, 2 * N, 1)})


def test_block_size_with_method_0():
    with raises(r"block_size must be None for moe_comp_method 0"):
        fused(block_size=[64, 128])


@pytest.mark.parametrize("method", [4, 5, 7, -1, 100])
def test_unknown_method(method):
    with raises(rf"moe_comp_method must be 0 \(bf16/fp16\), 1 \(int8 w8a8\), 2 \(fp8 w8a16\) or 3 "
                rf"\(int4 w4a8\), got {method}"):
        fused(moe_comp_method=method)


def test_int4_method_with_bf16_weights():
    """moe_comp_method 3 (INT4 W4A8) is implemented (tests/test_int4.py): 3-D bf16 weights
    are rejected as not packed by convert_weight_packed_scale_zp."""
    with raises(r"int4 w1 and w2 must be 4-D \[E, out_features/32, in_features/bk, 16\*bk\+128\]"):
        fused(moe_comp_method=3, w1_scale=torch.ones(E, 2 * N, 1),
              w2_scale=torch.ones(E, K, 1))


def test_fp8_method_with_bf16_weights():
    """moe_comp_method 2 (FP8 W8A16) is implemented (tests/test_fp8.py): it needs
    block_size first, then rejects bf16 weights naming w1 and the scheme."""
    with raises(r"missing block_size for fp8 w8a16"):
        fused(moe_comp_method=2, w1_scale=torch.ones(E, 2 * N, 1), w2_scale=torch.ones(E, K, 1))
    with raises(r"w1 must be Float8_e4m3fn for moe_comp_method 2 \(fp8 w8a16\), got BFloat16"):
        fused(moe_comp_method=2, w1_scale=torch.ones(E, 1, 1), w2_scale=torch.ones(E, 1, 1),
              block_size=[128, 128])


def test_int8_method_with_bf16_weights():
    """moe_comp_method 1 (INT8 W8A8) is being implemented: with bf16 weights the call is
    either "not implemented" (before) or rejects w1's dtype (after), clearly either way."""
    with raises(r"moe_comp_method 1 \(INT8 W8A8\) is not implemented|"
                r"w1 must be Char for moe_comp_method 1"):
        fused(moe_comp_method=1, w1_scale=torch.ones(E, 2 * N, 1), w2_scale=torch.ones(E, K, 1))


def test_errors_via_bias_overload():
    """The 17-argument overload validates the same way."""
    args = valid()
    op = torch.ops.cpumoe.fused_experts_cpu.bias
    b1, b2 = make_bias(E, N, K)
    bad_ids = args["topk_ids"].clone()
    bad_ids[0, 0] = -2
    with raises(r"topk_ids\[0, 0\] = -2"):
        op(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"], bad_ids, False, 0,
           None, None, None, None, None, b1, b2, 1.702, 7.0, True)
    with raises(r"moe_comp_method must be 0"):
        op(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"], args["topk_ids"],
           False, 9, None, None, None, None, None, b1, b2, 1.702, 7.0, True)


# ---------------------------------------------------------------------------------------
# shared_expert_cpu


def shared_valid(dtype=BF16):
    x = torch.randn(M, K).to(dtype)
    w1 = (torch.randn(2 * N, K) / K ** 0.5).to(dtype)
    w2 = (torch.randn(K, N) / N ** 0.5).to(dtype)
    return x, pack(w1), pack(w2)


def shared(x=None, w1=None, w2=None, fused_out=None, factor=None, **kw):
    dx, dw1, dw2 = shared_valid()
    return cpumoe.shared_expert(dx if x is None else x, dw1 if w1 is None else w1,
                                dw2 if w2 is None else w2, fused_out, factor, **kw)


def test_shared_valid_arguments_pass():
    assert shared().shape == (M, K)


def test_shared_fused_out_without_factor():
    with raises(r"fused_experts_out and routed_scaling_factor must be given together "
                r"\(got only fused_experts_out\)"):
        shared(fused_out=torch.zeros(M, K, dtype=BF16))


def test_shared_factor_without_fused_out():
    with raises(r"fused_experts_out and routed_scaling_factor must be given together "
                r"\(got only routed_scaling_factor\)"):
        shared(factor=16.0)


@pytest.mark.parametrize("shape", [(M + 1, K), (M, 2 * K), (M * K,)],
                         ids=["rows", "cols", "1d"])
def test_shared_fused_out_shape(shape):
    with raises(r"fused_experts_out must (have the shape of hidden_states|be a 2-D tensor)"):
        shared(fused_out=torch.zeros(*shape, dtype=BF16), factor=16.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_shared_fused_out_dtype(dtype):
    with raises(r"fused_experts_out must have the dtype of hidden_states"):
        shared(fused_out=torch.zeros(M, K, dtype=dtype), factor=16.0)


def test_shared_fused_out_noncontiguous():
    with raises(r"fused_experts_out must be contiguous"):
        shared(fused_out=torch.zeros(K, M, dtype=BF16).t(), factor=16.0)


def test_shared_int8_with_bf16_weights():
    """use_int8_w8a8 is being implemented: "not implemented" before, a w1 dtype error
    naming the scheme after."""
    with raises(r"use_int8_w8a8=True is not implemented|w1 must be Char for moe_comp_method 1"):
        shared(use_int8_w8a8=True)


def test_shared_fp8_needs_block_size():
    """use_fp8_w8a16=True is implemented (tests/test_fp8.py): without block_size it is an
    error naming block_size; with use_int8_w8a8=True as well, an error naming both."""
    with raises(r"shared_expert_cpu: missing block_size for fp8 w8a16"):
        shared(use_fp8_w8a16=True)
    with raises(r"shared_expert_cpu: use_int8_w8a8 and use_fp8_w8a16 cannot both be True"):
        shared(use_fp8_w8a16=True, use_int8_w8a8=True, block_size=[128, 128])


def test_shared_w1_3d():
    w1, _ = make_weights(1, N, K, BF16)
    with raises(r"w1 must be a 2-D tensor \[2N, K\]"):
        shared(w1=pack(w1))


def test_shared_w2_3d():
    _, w2 = make_weights(1, N, K, BF16)
    with raises(r"w2 must be a 2-D tensor"):
        shared(w2=pack(w2))


def test_shared_hidden_errors():
    with raises(r"hidden_states must be bfloat16 or float16"):
        shared(x=torch.randn(M, K))
    with raises(r"hidden_states must be contiguous"):
        shared(x=torch.randn(K, M).to(BF16).t())
    with raises(r"hidden_states must be a 2-D tensor"):
        shared(x=torch.randn(K).to(BF16))


def test_shared_weight_errors():
    _, w1, w2 = shared_valid()
    with raises(r"\bw1 must .*BFloat16.*got Half"):
        shared(w1=w1.to(torch.float16))
    with raises(r"\bw1 must .*got (shape )?\[64, 128\]"):
        shared(w1=torch.zeros(2 * N, 2 * K, dtype=BF16))
    with raises(r"w1.size\(0\) must be 2N"):
        shared(w1=torch.zeros(2 * N + 1, K, dtype=BF16))
    with raises(r"w2 must have shape \[64, 32\]"):
        shared(w2=torch.zeros(K, 2 * N, dtype=BF16))
    with raises(r"intermediate size N=48 .*multiple of 32"):
        shared(w1=torch.zeros(96, K, dtype=BF16), w2=torch.zeros(K, 48, dtype=BF16))


def test_shared_scales_and_block_size():
    with raises(r"w1_scale (and w2_scale )?must be None"):
        shared(w1_scale=torch.ones(2 * N, 1))
    with raises(r"block_size must be None"):
        shared(block_size=[64, 128])
