"""Every bad input is a RuntimeError whose message names the argument (docs/ERRORS.md),
never a crash, a hang or silent garbage.

The end of this file holds CATALOGUE, one case per distinct rejection; docs/ERRORS.md
lists them with their messages, and test_errors_doc keeps the two identical
(``python tests/test_errors.py --write-doc`` rewrites the doc's tables)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import cpumoe
from cpumoe_testing import make_bias, make_routing, make_weights, pack, raises

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
    with raises(r"topk = topk_ids.size\(1\) must be at least 1"):
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
    """alpha alone is an error; limit alone is DeepSeek-V4's clamped silu (tested in
    test_activation.py), which needs a limit >= 0."""
    with raises(r"alpha needs limit .*got only alpha"):
        fused(alpha=1.702)
    assert fused(limit=7.0).shape == (M, K)
    with raises(r"limit must be >= 0 \(not NaN\) for the clamped silu"):
        fused(limit=float("nan"))


# ---------------------------------------------------------------------------------------
# moe_comp_method and its scale/zero arguments


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale", "w1_zero", "w2_zero"])
def test_scales_with_method_0(name):
    with raises(rf"{name} must be None for moe_comp_method 0"):
        fused(**{name: torch.ones(E, 2 * N, 1)})


def test_block_size_with_method_0():
    with raises(r"block_size must be None for moe_comp_method 0"):
        fused(block_size=[64, 128])


@pytest.mark.parametrize("method", [5, 7, -1, 100])
def test_unknown_method(method):
    with raises(rf"moe_comp_method must be 0 \(bf16/fp16\), 1 \(int8 w8a8\), 2 \(fp8 w8a16\), 3 "
                rf"\(int4 w4a8\) or 4 \(mxfp4\), got {method}"):
        fused(moe_comp_method=method)


def test_mxfp4_method_with_bf16_weights():
    """moe_comp_method 4 (MXFP4) is implemented (tests/test_mxfp4.py): the weights are
    checked before the scales, so bf16 weights are rejected naming w1 and the scheme, with
    or without the uint8 scales."""
    with raises(r"w1 must be Byte for moe_comp_method 4 \(mxfp4\), got BFloat16"):
        fused(moe_comp_method=4)
    with raises(r"w1 must be Byte for moe_comp_method 4 \(mxfp4\), got BFloat16"):
        fused(moe_comp_method=4, w1_scale=torch.zeros(E, 2 * N, K // 32, dtype=torch.uint8),
              w2_scale=torch.zeros(E, K, N // 32, dtype=torch.uint8))


def test_int4_method_with_bf16_weights():
    """moe_comp_method 3 (INT4 W4A8) is implemented (tests/test_int4.py): 3-D bf16 weights
    are rejected as not packed by convert_weight_packed_scale_zp."""
    with raises(r"int4 w1 and w2 must be 4-D \[E, out_features/32, in_features/bk, 16\*bk\+128\]"):
        fused(moe_comp_method=3, w1_scale=torch.ones(E, 2 * N, 1),
              w2_scale=torch.ones(E, K, 1))


def test_fp8_method_with_bf16_weights():
    """moe_comp_method 2 (FP8 W8A16) is implemented (tests/test_fp8.py): it rejects bf16
    weights naming w1 and the scheme, with per-tensor (no block_size) or block scales."""
    with raises(r"w1 must be Float8_e4m3fn for moe_comp_method 2 \(fp8 w8a16\), got BFloat16"):
        fused(moe_comp_method=2, w1_scale=torch.ones(E), w2_scale=torch.ones(E))
    with raises(r"w1 must be Float8_e4m3fn for moe_comp_method 2 \(fp8 w8a16\), got BFloat16"):
        fused(moe_comp_method=2, w1_scale=torch.ones(E, 1, 1), w2_scale=torch.ones(E, 1, 1),
              block_size=[128, 128])


def test_int8_method_with_bf16_weights():
    """moe_comp_method 1 (INT8 W8A8) is being implemented: with bf16 weights the call is
    either "not implemented" (before) or rejects w1's dtype (after), clearly either way."""
    with raises(r"moe_comp_method 1 \(INT8 W8A8\) is not implemented|"
                r"w1 must be Char for moe_comp_method 1"):
        fused(moe_comp_method=1, w1_scale=torch.ones(E, 2 * N, 1), w2_scale=torch.ones(E, K, 1))


@pytest.mark.parametrize("block", [[2 ** 31 - 1, 2 ** 31 - 2], [64, 2 ** 20]],
                         ids=["int32max", "2^20"])
def test_fp8_huge_block_size_is_one_block(block):
    """Accepted, not an error: a block larger than the weight is one block per expert
    (scales [E, 1, 1]), with the bits of block_size = [2N, K] (= [64, 64] here), up to
    2^31 - 1 (larger values are rejected: see CATALOGUE)."""
    from cpumoe_testing import make_fp8_weights

    x = torch.randn(M, K).to(BF16)
    tw, ti = make_routing(M, E, TOPK)
    w1, s1, w2, s2 = make_fp8_weights(E, N, K, (64, 64))
    assert s1.shape == s2.shape == (E, 1, 1)
    pw1, pw2 = pack(w1), pack(w2)

    def run(bs):
        return cpumoe.fused_experts(x, pw1, pw2, tw, ti, moe_comp_method=2, w1_scale=s1,
                                    w2_scale=s2, block_size=bs)

    assert torch.equal(run(block), run([64, 64]))


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view one element past the start of its storage (torch allocates at
    64 bytes; this view starts 1, 2 or 4 bytes later)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("method", [0, 1, 2], ids=["bf16", "int8", "fp8"])
def test_unaligned_tensors_accepted(isa, method):
    """Accepted, not an error: contiguous tensors that do not start on an alignment
    boundary (views with a storage offset) give the bits of aligned copies, for every
    tensor argument, packed or packed per call, and in shared_expert_cpu."""
    from cpumoe_testing import make_scheme_weights

    x = torch.randn(M, K).to(BF16)
    tw, ti = make_routing(M, E, TOPK)
    w1, w2, kw = make_scheme_weights(method, E, N, K)
    del kw["moe_comp_method"]
    b1, b2 = make_bias(E, N, K)
    off = {k: _unaligned(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    assert _unaligned(x).data_ptr() % 4 != 0

    def fused(*a, **k):
        return cpumoe.fused_experts(*a, moe_comp_method=method, **k)

    aligned = fused(x, pack(w1), pack(w2), tw, ti, w1_bias=b1, w2_bias=b2, **kw)
    moved = fused(_unaligned(x), _unaligned(pack(w1)), _unaligned(pack(w2)), _unaligned(tw),
                  _unaligned(ti), w1_bias=_unaligned(b1), w2_bias=_unaligned(b2), **off)
    assert torch.equal(moved, aligned)
    assert torch.equal(fused(_unaligned(x), _unaligned(w1), _unaligned(w2), tw, ti,
                             is_vnni=False, **off), fused(x, w1, w2, tw, ti, is_vnni=False,
                                                          **kw))
    assert torch.equal(pack(_unaligned(w1)), pack(w1))
    skw = dict(use_int8_w8a8=method == 1, use_fp8_w8a16=method == 2,
               **{k: v[0] if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    soff = {k: _unaligned(v) if isinstance(v, torch.Tensor) else v for k, v in skw.items()}
    fo = torch.randn(M, K).to(BF16)
    assert torch.equal(
        cpumoe.shared_expert(_unaligned(x), _unaligned(pack(w1[0])), _unaligned(pack(w2[0])),
                             _unaligned(fo), 2.0, **soff),
        cpumoe.shared_expert(x, pack(w1[0]), pack(w2[0]), fo, 2.0, **skw))


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
    with raises(r"use_int8_w8a8=True is not implemented|"
                r"w1 must be Char for use_int8_w8a8=True \(int8 w8a8\)"):
        shared(use_int8_w8a8=True)


def test_shared_fp8_without_block_size():
    """use_fp8_w8a16=True is implemented (tests/test_fp8.py): without block_size the scales
    are per tensor, and bf16 weights are an error naming w1; with use_int8_w8a8=True as
    well, an error naming both."""
    with raises(r"shared_expert_cpu: w1 must be Float8_e4m3fn for use_fp8_w8a16=True"):
        shared(use_fp8_w8a16=True, w1_scale=torch.ones(()), w2_scale=torch.ones(()))
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


# ---------------------------------------------------------------------------------------
# CATALOGUE: every distinct rejection, with the argument its message names. Each case
# starts from valid arguments (M=4, E=8, topk=2, N=32, K=64) and breaks one thing.
# test_rejected checks the exception type, the op prefix and the argument's name;
# test_errors_doc checks that docs/ERRORS.md lists exactly these cases and messages.

FP8_BLOCK = [32, 32]
CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
DROP = object()  # an override that leaves the argument out (None)


def scheme_args(method: int, lead: tuple):
    """Valid packed w1 [*lead, 2N, K], w2 [*lead, K, N] and the scheme's keyword arguments
    (scales, zeros, block_size) for moe_comp_method 0..4. Values do not matter here."""
    if method == 4:  # MXFP4: uint8 codes [.., OC, IC / 2], packed e8m0 scales [.., OC, IC / 32]
        codes = (torch.zeros(*lead, 2 * N, K // 2, dtype=torch.uint8),
                 torch.zeros(*lead, K, N // 2, dtype=torch.uint8))
        scales = (torch.full((*lead, 2 * N, K // 32), 127, dtype=torch.uint8),
                  torch.full((*lead, K, N // 32), 127, dtype=torch.uint8))
        return pack(codes[0]), pack(codes[1]), dict(
            w1_scale=cpumoe.convert_scale_packed(scales[0]),
            w2_scale=cpumoe.convert_scale_packed(scales[1]))
    if method == 3:
        from cpumoe_testing import Int4Weights

        assert lead == (E,), "shared_expert_cpu has no int4 scheme"
        w = Int4Weights(E, N, K, 32)
        return w.p1[0], w.p2[0], dict(w1_scale=w.p1[2], w2_scale=w.p2[2], w1_zero=w.p1[1],
                                      w2_zero=w.p2[1])
    dt = {0: BF16, 1: torch.int8, 2: torch.float8_e4m3fn}[method]
    w1 = pack(torch.zeros(*lead, 2 * N, K).to(dt))
    w2 = pack(torch.zeros(*lead, K, N).to(dt))
    if method == 1:
        return w1, w2, dict(w1_scale=torch.ones(*lead, 2 * N, 1),
                            w2_scale=torch.ones(*lead, K, 1))
    if method == 2:
        return w1, w2, dict(w1_scale=torch.ones(*lead, 2 * N // 32, K // 32),
                            w2_scale=torch.ones(*lead, K // 32, 1), block_size=FP8_BLOCK)
    return w1, w2, {}


def _apply(args: dict, over: dict) -> dict:
    """args with `over` applied; an override may be a function of the valid args."""
    for k, v in over.items():
        args[k] = v(args) if callable(v) and not isinstance(v, torch.Tensor) else v
    return {k: (None if v is DROP else v) for k, v in args.items()}


def call_fused(method=0, *, cpu_kernel=False, **over):
    """fused_experts_cpu with valid arguments of `method`, `over` applied. cpu_kernel=True
    calls the CPU kernel directly (redispatch), past the Meta kernel a meta tensor would
    select: that is how a tensor of another device reaches the binding's own checks."""
    w1, w2, kw = scheme_args(method, (E,))
    tw, ti = make_routing(M, E, TOPK)
    a = _apply(dict(hidden_states=torch.zeros(M, K, dtype=BF16), w1=w1, w2=w2, topk_weights=tw,
                    topk_ids=ti, moe_comp_method=method, **kw), over)
    if cpu_kernel:
        return torch.ops.cpumoe.fused_experts_cpu.bias.redispatch(
            CPU_KEYS, a["hidden_states"], a["w1"], a["w2"], a["topk_weights"], a["topk_ids"],
            False, method, a.get("w1_scale"), a.get("w2_scale"), a.get("w1_zero"),
            a.get("w2_zero"),
            a.get("block_size"), a.get("w1_bias"), a.get("w2_bias"), None, None, True)
    return cpumoe.fused_experts(a.pop("hidden_states"), a.pop("w1"), a.pop("w2"),
                                a.pop("topk_weights"), a.pop("topk_ids"), **a)


def call_shared(method=0, *, cpu_kernel=False, **over):
    """shared_expert_cpu with valid arguments of `method` (the use_*_w8a* flags; 4 sets
    use_mxfp4, the .mxfp4 overload's flag), `over` applied; cpu_kernel as in call_fused."""
    w1, w2, kw = scheme_args(method, ())
    a = _apply(dict(hidden_states=torch.zeros(M, K, dtype=BF16), w1=w1, w2=w2,
                    fused_experts_out=None, routed_scaling_factor=None,
                    use_int8_w8a8=method == 1, use_fp8_w8a16=method == 2,
                    **({"use_mxfp4": True} if method == 4 else {}), **kw), over)
    if cpu_kernel:
        return torch.ops.cpumoe.shared_expert_cpu.default.redispatch(
            CPU_KEYS, a["hidden_states"], a["w1"], a["w2"], a["fused_experts_out"],
            a["routed_scaling_factor"], False, a["use_int8_w8a8"], a["use_fp8_w8a16"],
            a.get("w1_scale"), a.get("w2_scale"), a.get("block_size"), True)
    return cpumoe.shared_expert(a.pop("hidden_states"), a.pop("w1"), a.pop("w2"),
                                a.pop("fused_experts_out"), a.pop("routed_scaling_factor"), **a)


def call_fused_out(**over):
    """fused_experts_cpu.out (vLLM's out-variant) with valid bf16 arguments, `over`
    applied (out, hidden_states, a1_scale)."""
    w1, w2, _ = scheme_args(0, (E,))
    tw, ti = make_routing(M, E, TOPK)
    a = _apply(dict(out=torch.zeros(M, K, dtype=BF16), hidden_states=torch.zeros(M, K, dtype=BF16),
                    a1_scale=None), over)
    torch.ops.cpumoe.fused_experts_cpu.out(a["out"], a["hidden_states"], w1, w2, tw, ti, 0, None,
                                           None, None, None, a["a1_scale"], None, None, None,
                                           None, None, True)
    return a["out"]


def call_pack(weight, *, cpu_kernel=False):
    if cpu_kernel:
        return torch.ops.cpumoe.convert_weight_packed.default.redispatch(CPU_KEYS, weight)
    return cpumoe.convert_weight_packed(weight)


def _meta(name):
    return lambda a: a[name].to("meta")


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view with t's shape and values."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _noncontig(name):
    return lambda a: _transposed(a[name])


def _bad_id(a):
    ti = a["topk_ids"].clone()
    ti[2, 1] = E
    return ti


@dataclasses.dataclass(frozen=True)
class Rejected:
    section: str  # the docs/ERRORS.md table that lists the case
    arg: str  # the argument the message names ("" for torch's own dispatcher errors)
    what: str  # the rejected input, in the table's words
    call: Callable[[], object]
    exc: type = RuntimeError
    truncate: bool = False  # the doc shows the first sentence (torch's long messages)
    unnamed: bool = False  # a known gap: the message does not name `arg` (yet)

    def __str__(self):
        return f"{self.section}/{self.arg or '-'}/{self.what}"


def B1():
    return make_bias(E, N, K)[0]


def B2():
    return make_bias(E, N, K)[1]


WITH_BIAS = dict(w1_bias=lambda a: B1(), w2_bias=lambda a: B2())
SPARSE = dict(exc=NotImplementedError, truncate=True)


def _f(arg, what, **over):
    return Rejected("fused", arg, what, lambda: call_fused(0, **over))


def _f1(arg, what, **over):
    return Rejected("fused-int8", arg, what, lambda: call_fused(1, **over))


def _f2(arg, what, **over):
    return Rejected("fused-fp8", arg, what, lambda: call_fused(2, **over))


def _s(arg, what, method=0, **over):
    return Rejected("shared", arg, what, lambda: call_shared(method, **over))


def _o(arg, what, **over):
    return Rejected("fused-out", arg, what, lambda: call_fused_out(**over))


def _p(arg, what, weight_fn, section="pack"):
    return Rejected(section, arg, what, lambda: call_pack(weight_fn()))


def _f4(arg, what, **over):
    return Rejected("int4", arg, what, lambda: call_fused(3, **over))


def _f5(arg, what, **over):
    return Rejected("fused-mxfp4", arg, what, lambda: call_fused(4, **over))


def call_pack_scales(scale, *, cpu_kernel=False):
    if cpu_kernel:
        return torch.ops.cpumoe.convert_scale_packed.default.redispatch(CPU_KEYS, scale)
    return cpumoe.convert_scale_packed(scale)


def _ps(arg, what, scale_fn):
    return Rejected("pack-scales", arg, what, lambda: call_pack_scales(scale_fn()))


def call_pack_int4(cpu_kernel=False, method=0, oc=64, ic=256, group=128, **over):
    """convert_weight_packed_scale_zp of valid AWQ tensors [2, oc, ic], `over` applied."""
    from cpumoe import quant

    qw, qz, sc = quant.quantize_int4(torch.zeros(2, oc, ic), group, "awq")
    a = _apply(dict(qweight=qw, qzeros=qz, scales=sc), over)
    if cpu_kernel:
        return torch.ops.cpumoe.convert_weight_packed_scale_zp.default.redispatch(
            CPU_KEYS, a["qweight"], a["qzeros"], a["scales"], method)
    return cpumoe.convert_weight_packed_scale_zp(a["qweight"], a["qzeros"], a["scales"], method)


def _q(arg, what, unnamed=False, **over):
    return Rejected("int4", arg, what, lambda: call_pack_int4(**over), unnamed=unnamed)


ROUTING_OPS = ("topk_softmax", "topk_sigmoid", "grouped_topk", "biased_grouped_topk",
               "biased_topk", "hash_topk")


def call_routing(op="biased_grouped_topk", *, cpu_kernel=False, **over):
    """torch.ops.cpumoe.<op>_cpu with valid arguments (E experts in 4 groups keeping 2,
    topk = TOPK; hash_topk: a table [M, TOPK] of ids in [0, E)), `over` applied; cpu_kernel
    as in call_fused."""
    a = _apply(dict(hidden_states=torch.zeros(M, K, dtype=BF16),
                    gating_output=torch.randn(M, E).to(BF16), correction_bias=torch.zeros(E),
                    topk=TOPK, renormalize=True, scoring_func="sigmoid", num_expert_group=4,
                    topk_group=2, num_fused_shared_experts=0, routed_scaling_factor=None,
                    num_token_non_padded=None, apply_routed_scaling_factor_on_output=False,
                    tid2eid=torch.arange(M * TOPK, dtype=torch.int32).reshape(M, TOPK) % E,
                    num_experts=E),
               over)
    head = (a["hidden_states"], a["gating_output"])
    scaling = (a["num_fused_shared_experts"], a["routed_scaling_factor"])
    args = {
        "topk_softmax": (*head, a["topk"], a["renormalize"]),
        "topk_sigmoid": (*head, a["topk"], a["renormalize"]),
        "grouped_topk": (*head, a["topk"], a["renormalize"], a["num_expert_group"],
                         a["topk_group"], *scaling, a["num_token_non_padded"]),
        "biased_grouped_topk": (*head, a["correction_bias"], a["topk"], a["renormalize"],
                                a["num_expert_group"], a["topk_group"], *scaling,
                                a["num_token_non_padded"]),
        "biased_topk": (*head, a["correction_bias"], a["topk"], a["renormalize"],
                        a["scoring_func"], *scaling,
                        a["apply_routed_scaling_factor_on_output"]),
        "hash_topk": (a["gating_output"], a["tid2eid"], a["topk"], a["scoring_func"],
                      a["num_fused_shared_experts"],  a["num_experts"],
                      1.0 if a["routed_scaling_factor"] is None else a["routed_scaling_factor"]),
    }[op]
    packet = getattr(torch.ops.cpumoe, op + "_cpu").default
    return packet.redispatch(CPU_KEYS, *args) if cpu_kernel else packet(*args)


def _r(arg, what, op="biased_grouped_topk", **over):
    return Rejected("routing", arg, f"{what} ({op}_cpu)", lambda: call_routing(op, **over))


def _big_k_int8():
    """K = 65568 > 65536 with int8 weights (the int32 sums would overflow)."""
    k = 65568
    return cpumoe.fused_experts(
        torch.zeros(1, k, dtype=BF16), torch.zeros(1, 64, k + 4, dtype=torch.int8),
        torch.zeros(1, k, 36, dtype=torch.int8), torch.ones(1, 1),
        torch.zeros(1, 1, dtype=torch.int32), moe_comp_method=1,
        w1_scale=torch.ones(1, 64, 1), w2_scale=torch.ones(1, k, 1))


def _empty_k(call):
    return call(hidden_states=torch.zeros(M, 0, dtype=BF16), is_vnni=False,
                w1=lambda a: torch.zeros(*a["w1"].shape[:-1], 0, dtype=BF16),
                w2=lambda a: torch.zeros(*a["w2"].shape[:-2], 0, N, dtype=BF16))


def call_fp32(**over):
    """fused_experts_fp32_cpu (cpumoe's float32-sum op) with valid bf16 arguments, `over`
    applied."""
    w1, w2, _ = scheme_args(0, (E,))
    tw, ti = make_routing(M, E, TOPK)
    a = _apply(dict(hidden_states=torch.zeros(M, K, dtype=BF16), w1=w1, w2=w2,
                    topk_weights=tw, topk_ids=ti), over)
    return cpumoe.fused_experts_fp32(a.pop("hidden_states"), a.pop("w1"), a.pop("w2"),
                                     a.pop("topk_weights"), a.pop("topk_ids"), **a)


def _f32(arg, what, **over):
    return Rejected("fp32", arg, what, lambda: call_fp32(**over))


def call_distributed(**over):
    """cpumoe.distributed.fused_experts as the second of two ranks (experts [8, 16) of 16),
    `over` applied. With valid arguments it stops at torch.distributed, which this test
    process never initializes."""
    import cpumoe.distributed as ep

    w1, w2, _ = scheme_args(0, (E,))
    tw, ti = make_routing(M, 2 * E, TOPK)
    a = _apply(dict(hidden_states=torch.zeros(M, K, dtype=BF16), w1=w1, w2=w2,
                    topk_weights=tw, topk_ids=ti, first_expert=E, num_experts=2 * E), over)
    return ep.fused_experts(a.pop("hidden_states"), a.pop("w1"), a.pop("w2"),
                            a.pop("topk_weights"), a.pop("topk_ids"), **a)


def _d(arg, what, **over):
    return Rejected("distributed", arg, what, lambda: call_distributed(**over))


def _bad_global_id(a):
    ti = a["topk_ids"].clone()
    ti[2, 1] = 2 * E
    return ti


def _shard(tensor, rank=0, world_size=2):
    import cpumoe.distributed as ep

    return lambda: ep.shard_experts(tensor, rank, world_size)


def _range(num_experts=2 * E, rank=0, world_size=2):
    import cpumoe.distributed as ep

    return lambda: ep.expert_range(num_experts, rank, world_size)


CATALOGUE = [
    # -- fused_experts_cpu, every scheme ------------------------------------------------
    _f("moe_comp_method", "not 0 to 4 (here 7)", moe_comp_method=7),
    _f("hidden_states", "float32 (any dtype but bfloat16/float16)",
       hidden_states=torch.zeros(M, K)),
    _f("hidden_states", "not 2-D", hidden_states=torch.zeros(1, M, K, dtype=BF16)),
    _f("hidden_states", "not contiguous", hidden_states=_noncontig("hidden_states")),
    Rejected("fused", "hidden_states", "no columns (K = 0)", lambda: _empty_k(call_fused)),
    _f("hidden_states", "K not a multiple of 32 (here 48)", is_vnni=False,
       hidden_states=torch.zeros(M, 48, dtype=BF16), w1=torch.zeros(E, 2 * N, 48, dtype=BF16),
       w2=torch.zeros(E, 48, N, dtype=BF16)),
    _f("w1", "not 3-D", w1=torch.zeros(2 * N, K, dtype=BF16)),
    _f("w1", "no experts (E = 0)", w1=torch.zeros(0, 2 * N, K, dtype=BF16)),
    _f("w1", "odd number of rows", w1=torch.zeros(E, 2 * N + 1, K, dtype=BF16)),
    _f("w1", "N = w1.size(1) / 2 not a multiple of 32 (here 48)", is_vnni=False,
       w1=torch.zeros(E, 96, K, dtype=BF16), w2=torch.zeros(E, K, 48, dtype=BF16)),
    _f("w1", "dtype other than the scheme's (float16 for bfloat16 activations)",
       w1=lambda a: a["w1"].half()),
    _f("w1", "shape other than [E, 2N, K] (here K doubled)",
       w1=torch.zeros(E, 2 * N, 2 * K, dtype=BF16)),
    _f("w1", "not contiguous", w1=_noncontig("w1")),
    _f("w2", "not 3-D", w2=torch.zeros(K, N, dtype=BF16)),
    _f("w2", "dtype other than the scheme's", w2=lambda a: a["w2"].half()),
    _f("w2", "shape other than [E, K, N] (here E + 1 experts)",
       w2=torch.zeros(E + 1, K, N, dtype=BF16)),
    _f("w2", "not contiguous", w2=_noncontig("w2")),
    _f("topk_weights", "not 2-D", topk_weights=lambda a: a["topk_weights"].flatten()),
    _f("topk_weights", "integer dtype", topk_weights=lambda a: a["topk_weights"].int()),
    _f("topk_weights", "shape other than topk_ids'",
       topk_weights=lambda a: a["topk_weights"][:, :1]),
    _f("topk_ids", "not 2-D", topk_ids=lambda a: a["topk_ids"].flatten()),
    _f("topk_ids", "dtype other than int32/int64", topk_ids=lambda a: a["topk_ids"].float()),
    _f("topk_ids", "rows other than M", topk_weights=torch.ones(M + 1, TOPK),
       topk_ids=torch.zeros(M + 1, TOPK, dtype=torch.int32)),
    _f("topk_ids", "no columns (topk = 0)", topk_weights=torch.ones(M, 0),
       topk_ids=torch.zeros(M, 0, dtype=torch.int32)),
    _f("topk_ids", "a value outside [0, E) other than -1 (here 8 at [2, 1])", topk_ids=_bad_id),
    _f("w1_bias", "without w2_bias", w1_bias=lambda a: B1()),
    _f("w2_bias", "without w1_bias", w2_bias=lambda a: B2()),
    _f("w1_bias", "not float32", **dict(WITH_BIAS, w1_bias=lambda a: B1().to(BF16))),
    _f("w1_bias", "not 2-D", **dict(WITH_BIAS, w1_bias=lambda a: B1().flatten())),
    _f("w1_bias", "shape other than [E, 2N]", **dict(WITH_BIAS, w1_bias=torch.zeros(E, N))),
    _f("w1_bias", "not contiguous", **dict(WITH_BIAS, w1_bias=lambda a: _transposed(B1()))),
    _f("w2_bias", "shape other than [E, K]", **dict(WITH_BIAS, w2_bias=torch.zeros(E, N))),
    _f("alpha", "without limit", alpha=1.702),
    _f("limit", "NaN, without alpha (the clamped silu)", limit=float("nan")),
    _f("limit", "negative, without alpha (the clamped silu)", limit=-1.0),
    _f("activation", "a name other than silu or gelu", activation="relu"),
    _f("activation", "gelu with alpha and limit", activation="gelu", alpha=1.702, limit=7.0),
    _f("activation", "gelu with limit alone", activation="gelu", limit=7.0),
    _f("w1_scale", "given for moe_comp_method 0", w1_scale=torch.ones(E, 2 * N, 1)),
    _f("w2_scale", "given for moe_comp_method 0", w2_scale=torch.ones(E, K, 1)),
    _f("w1_zero", "given for moe_comp_method 0", w1_zero=torch.zeros(E, 2 * N, 1)),
    _f("w2_zero", "given for moe_comp_method 0", w2_zero=torch.zeros(E, K, 1)),
    _f("block_size", "given for moe_comp_method 0", block_size=[32, 32]),
    # -- fused_experts_cpu, moe_comp_method 1 (INT8 W8A8) --------------------------------
    _f1("w1_scale", "missing", w1_scale=DROP),
    _f1("w2_scale", "missing", w2_scale=DROP),
    _f1("w1_scale", "numel other than E * 2N", w1_scale=torch.ones(E, N, 1)),
    _f1("w2_scale", "numel other than E * K", w2_scale=torch.ones(E, 2 * K, 1)),
    _f1("w1_scale", "not float32", w1_scale=lambda a: a["w1_scale"].half()),
    _f1("w1_scale", "not contiguous", w1_scale=torch.ones(E, 4 * N)[:, ::2]),
    _f1("w1_zero", "given", w1_zero=torch.zeros(E, 2 * N, 1, dtype=torch.int8)),
    _f1("block_size", "given", block_size=[32, 32]),
    _f1("w1", "not int8", w1=pack(torch.zeros(E, 2 * N, K, dtype=BF16))),
    _f1("w1", "not packed ([E, 2N, K] where is_vnni=True needs [E, 2N, K + 4])",
        w1=torch.zeros(E, 2 * N, K, dtype=torch.int8)),
    _f1("w2", "not packed", w2=torch.zeros(E, K, N, dtype=torch.int8)),
    Rejected("fused-int8", "K", "K or N above 65536", _big_k_int8),
    # -- fused_experts_cpu, moe_comp_method 2 (FP8 W8A16) --------------------------------
    _f2("w1_scale", "block scales without block_size (per-tensor scales [E] expected)",
        block_size=DROP),
    _f2("w1_scale", "missing, without block_size", block_size=DROP, w1_scale=DROP),
    _f2("block_size", "not 2 values", block_size=[32]),
    _f2("block_size", "a value < 1", block_size=[0, 32]),
    _f2("block_size", "odd block_k", block_size=[32, 33]),
    _f2("block_size", "a value above 2^31 - 1", block_size=[2 ** 63 - 1, 32]),
    _f2("w1_scale", "missing", w1_scale=DROP),
    _f2("w2_scale", "missing", w2_scale=DROP),
    _f2("w1_scale", "shape other than [E, ceil(2N / block_n), ceil(K / block_k)]",
        w1_scale=torch.ones(E, 2 * N // 32, 1)),
    _f2("w2_scale", "shape other than [E, ceil(K / block_n), ceil(N / block_k)]",
        w2_scale=torch.ones(E, K // 32, 2)),
    _f2("w1_scale", "not float32", w1_scale=lambda a: a["w1_scale"].half()),
    _f2("w2_scale", "not contiguous", w2_scale=lambda a: torch.ones(E, 2, 2)[:, :, :1]),
    _f2("w1_zero", "given", w1_zero=torch.zeros(E, 2, 2)),
    _f2("w1", "not float8_e4m3fn", w1=pack(torch.zeros(E, 2 * N, K, dtype=torch.int8))),
    # -- fused_experts_cpu, moe_comp_method 4 (MXFP4) -------------------------------------
    _f5("w1_scale", "missing", w1_scale=DROP),
    _f5("w2_scale", "missing", w2_scale=DROP),
    _f5("w1_scale", "not uint8", w1_scale=lambda a: a["w1_scale"].float()),
    _f5("w1_scale", "shape other than [E, 2N, K / 32] (here the size of [E, 2N, K / 32] "
        "flattened)", w1_scale=lambda a: a["w1_scale"].flatten(1)),
    _f5("w2_scale", "shape other than [E, K, N / 32] (here [E, K / 2, 2 N / 32])",
        w2_scale=torch.zeros(E, K // 2, 2, dtype=torch.uint8)),
    _f5("w2_scale", "not contiguous",
        w2_scale=lambda a: torch.zeros(E, K, 2, dtype=torch.uint8)[:, :, :1]),
    _f5("block_size", "given", block_size=[32, 32]),
    _f5("w1_zero", "given", w1_zero=torch.zeros(E, 2 * N, 1, dtype=torch.int8)),
    _f5("w1", "not uint8", w1=lambda a: a["w1"].view(torch.int8)),
    _f5("w1", "shape other than [E, 2N, K / 2] (here [E, 2N, K])",
        w1=torch.zeros(E, 2 * N, K, dtype=torch.uint8)),
    _f5("w2", "not contiguous", w2=lambda a: _transposed(a["w2"])),
    # -- fused_experts_cpu.out (vLLM's out-variant) -------------------------------------
    _o("a1_scale", "given (vLLM's per-token activation scales of its FP8 W8A8 MoE)",
       a1_scale=torch.ones(M, 1)),
    _o("out", "not 2-D", out=torch.zeros(M * K, dtype=BF16)),
    _o("out", "not contiguous", out=_transposed(torch.zeros(M, K, dtype=BF16))),
    _o("out", "dtype other than hidden_states'", out=torch.zeros(M, K, dtype=torch.float16)),
    _o("out", "shape other than hidden_states'", out=torch.zeros(M + 1, K, dtype=BF16)),
    # -- shared_expert_cpu ---------------------------------------------------------------
    _s("use_int8_w8a8", "use_int8_w8a8 and use_fp8_w8a16 both True", use_int8_w8a8=True,
       use_fp8_w8a16=True),
    _s("hidden_states", "float32", hidden_states=torch.zeros(M, K)),
    _s("hidden_states", "not 2-D", hidden_states=torch.zeros(K, dtype=BF16)),
    _s("hidden_states", "not contiguous", hidden_states=_noncontig("hidden_states")),
    Rejected("shared", "hidden_states", "no columns (K = 0)", lambda: _empty_k(call_shared)),
    _s("w1", "not 2-D", w1=torch.zeros(1, 2 * N, K, dtype=BF16)),
    _s("w1", "odd number of rows", w1=torch.zeros(2 * N + 1, K, dtype=BF16)),
    _s("w1", "N = w1.size(0) / 2 not a multiple of 32 (here 48)",
       w1=torch.zeros(96, K, dtype=BF16), w2=torch.zeros(K, 48, dtype=BF16)),
    _s("w1", "dtype other than the scheme's", w1=lambda a: a["w1"].half()),
    _s("w1", "shape other than [2N, K]", w1=torch.zeros(2 * N, 2 * K, dtype=BF16)),
    _s("w1", "not contiguous", w1=_noncontig("w1")),
    _s("w2", "not 2-D", w2=torch.zeros(1, K, N, dtype=BF16)),
    _s("w2", "dtype other than the scheme's", w2=lambda a: a["w2"].half()),
    _s("w2", "shape other than [K, N]", w2=torch.zeros(K, 2 * N, dtype=BF16)),
    _s("w2", "not contiguous", w2=_noncontig("w2")),
    _s("fused_experts_out", "without routed_scaling_factor",
       fused_experts_out=torch.zeros(M, K, dtype=BF16)),
    _s("routed_scaling_factor", "without fused_experts_out", routed_scaling_factor=2.0),
    _s("fused_experts_out", "not 2-D", fused_experts_out=torch.zeros(M * K, dtype=BF16),
       routed_scaling_factor=2.0),
    _s("fused_experts_out", "dtype other than hidden_states'",
       fused_experts_out=torch.zeros(M, K, dtype=torch.float16), routed_scaling_factor=2.0),
    _s("fused_experts_out", "shape other than hidden_states'",
       fused_experts_out=torch.zeros(M + 1, K, dtype=BF16), routed_scaling_factor=2.0),
    _s("fused_experts_out", "not contiguous",
       fused_experts_out=_transposed(torch.zeros(M, K, dtype=BF16)), routed_scaling_factor=2.0),
    _s("w1_scale", "given for bf16/fp16 weights", w1_scale=torch.ones(2 * N, 1)),
    _s("block_size", "given for bf16/fp16 weights", block_size=[32, 32]),
    _s("w1_scale", "missing (use_int8_w8a8)", 1, w1_scale=DROP),
    _s("w2_scale", "numel other than K (use_int8_w8a8)", 1, w2_scale=torch.ones(2 * K, 1)),
    _s("w1", "not int8 (use_int8_w8a8)", 1, w1=pack(torch.zeros(2 * N, K, dtype=BF16))),
    _s("block_size", "given (use_int8_w8a8)", 1, block_size=[32, 32]),
    _s("w1_scale", "block scales without block_size (use_fp8_w8a16: per-tensor scale [] "
       "expected)", 2, block_size=DROP),
    _s("w1_scale", "missing (use_fp8_w8a16)", 2, w1_scale=DROP),
    _s("w2_scale", "shape other than [ceil(K / block_n), ceil(N / block_k)] (use_fp8_w8a16)",
       2, w2_scale=torch.ones(2, 2)),
    _s("use_mxfp4", "with use_int8_w8a8 (any two flags; .mxfp4 overload)", 1, use_mxfp4=True),
    _s("w1_scale", "missing (use_mxfp4, .mxfp4 overload)", 4, w1_scale=DROP),
    _s("w1", "bf16 weights with use_mxfp4 (.mxfp4 overload)", 4,
       w1=pack(torch.zeros(2 * N, K, dtype=BF16))),
    _s("w2_scale", "not uint8 (use_mxfp4, .mxfp4 overload)", 4,
       w2_scale=lambda a: a["w2_scale"].float()),
    _s("w2_scale", "shape other than [K, N / 32] (use_mxfp4, .mxfp4 overload; here [K / 2, "
       "2 N / 32])", 4, w2_scale=torch.zeros(K // 2, 2 * N // 32, dtype=torch.uint8)),
    _s("alpha", "without limit (.mxfp4 overload)", alpha=1.702),
    _s("limit", "NaN, without alpha (.mxfp4 overload)", limit=float("nan")),
    # -- convert_weight_packed ------------------------------------------------------------
    _p("weight", "not 2-D or 3-D", lambda: torch.zeros(64, dtype=BF16)),
    _p("weight", "float32 (or another dtype without a packed layout)",
       lambda: torch.zeros(32, 64)),
    _p("weight", "not contiguous", lambda: _transposed(torch.zeros(2, 32, 64, dtype=BF16))),
    _p("weight", "16-bit or fp8, rows (OC) not a multiple of 16 (here 24)",
       lambda: torch.zeros(24, 64, dtype=BF16)),
    _p("weight", "int8, rows (OC) not a multiple of 32 (here 48)",
       lambda: torch.zeros(48, 64, dtype=torch.int8)),
    _p("weight", "columns (IC) not a multiple of 32 (here 48)",
       lambda: torch.zeros(32, 48, dtype=BF16)),
    _p("weight", "int8, columns (IC) above 65536", lambda: torch.zeros(32, 65568,
                                                                        dtype=torch.int8)),
    _p("weight", "uint8 (MXFP4), rows (OC) not a multiple of 32 (here 48)",
       lambda: torch.zeros(48, 16, dtype=torch.uint8)),
    _p("weight", "uint8 (MXFP4), input features (2 per byte) not a multiple of 32 (here 48)",
       lambda: torch.zeros(32, 24, dtype=torch.uint8)),
    # -- convert_scale_packed ----------------------------------------------------------
    _ps("scale", "not 2-D or 3-D", lambda: torch.zeros(2, 2, 32, 2, dtype=torch.uint8)),
    _ps("scale", "not uint8", lambda: torch.zeros(32, 2)),
    _ps("scale", "not contiguous", lambda: _transposed(torch.zeros(2, 64, 32, dtype=torch.uint8))),
    _ps("scale", "rows (OC) not a multiple of 32 (here 48)",
        lambda: torch.zeros(48, 2, dtype=torch.uint8)),
    # -- devices and layouts (any tensor argument of any op) ------------------------------
    Rejected("devices", "w1", "a meta tensor among CPU tensors",
             lambda: call_fused(0, w1=_meta("w1"))),
    Rejected("devices", "w1_bias", "a meta tensor among CPU tensors (any optional tensor too)",
             lambda: call_fused(0, **dict(WITH_BIAS, w1_bias=lambda a: B1().to("meta")))),
    Rejected("devices", "out", "a meta tensor among CPU tensors (fused_experts_cpu.out)",
             lambda: call_fused_out(out=torch.zeros(M, K, dtype=BF16, device="meta"))),
    Rejected("devices", "fused_experts_out", "a meta tensor among CPU tensors",
             lambda: call_shared(0, fused_experts_out=torch.zeros(M, K, dtype=BF16,
                                                                  device="meta"),
                                 routed_scaling_factor=2.0)),
    *[Rejected("devices", name, "not a CPU tensor, reaching the CPU kernel",
               lambda m=m, over=over: call_fused(m, cpu_kernel=True, **over))
      for name, m, over in [
          ("hidden_states", 0, dict(hidden_states=_meta("hidden_states"))),
          ("w1", 0, dict(w1=_meta("w1"))), ("w2", 0, dict(w2=_meta("w2"))),
          ("topk_weights", 0, dict(topk_weights=_meta("topk_weights"))),
          ("topk_ids", 0, dict(topk_ids=_meta("topk_ids"))),
          ("w1_bias", 0, dict(WITH_BIAS, w1_bias=lambda a: B1().to("meta"))),
          ("w2_bias", 0, dict(WITH_BIAS, w2_bias=lambda a: B2().to("meta"))),
          ("w1_scale", 1, dict(w1_scale=_meta("w1_scale"))),
          ("w2_scale", 2, dict(w2_scale=_meta("w2_scale")))]],
    Rejected("devices", "w1_scale", "not a CPU tensor, reaching the CPU kernel (mxfp4's uint8 "
             "scales)", lambda: call_fused(4, cpu_kernel=True, w1_scale=_meta("w1_scale"))),
    *[Rejected("devices", name, "not a CPU tensor, reaching the CPU kernel (shared_expert_cpu)",
               lambda over=over: call_shared(0, cpu_kernel=True, **over))
      for name, over in [
          ("hidden_states", dict(hidden_states=_meta("hidden_states"))),
          ("w2", dict(w2=_meta("w2"))),
          ("fused_experts_out", dict(fused_experts_out=torch.zeros(M, K, dtype=BF16,
                                                                   device="meta"),
                                     routed_scaling_factor=2.0))]],
    Rejected("devices", "weight", "not a CPU tensor, reaching the CPU kernel "
             "(convert_weight_packed)",
             lambda: call_pack(torch.zeros(32, 64, dtype=BF16, device="meta"), cpu_kernel=True)),
    Rejected("devices", "scale", "not a CPU tensor, reaching the CPU kernel "
             "(convert_scale_packed)",
             lambda: call_pack_scales(torch.zeros(32, 2, dtype=torch.uint8, device="meta"),
                                      cpu_kernel=True)),
    Rejected("devices", "", "a sparse tensor (fused_experts_cpu)",
             lambda: call_fused(0, hidden_states=lambda a: a["hidden_states"].to_sparse()),
             **SPARSE),
    Rejected("devices", "", "a sparse tensor (convert_weight_packed)",
             lambda: call_pack(torch.zeros(32, 64, dtype=BF16).to_sparse()), **SPARSE),
    # -- INT4 W4A8 (moe_comp_method 3) ----------------------------------------------------
    # Weights from convert_weight_packed_scale_zp: w1 [E, 2N/32, K/bk, 16 bk + 128] uint8,
    # scales fp32 and zeros int8 [E, OC/32, groups, 32]; group 32 here (bk = 32).
    _f4("is_vnni", "False (there is no unpacked int4 format)", is_vnni=False),
    _f4("block_size", "given", block_size=[32, 32]),
    _f4("w1", "not 4-D", w1=lambda a: a["w1"].flatten(1, 2)),
    _f4("w1_scale", "missing", w1_scale=DROP),
    _f4("w2_zero", "missing", w2_zero=DROP),
    _f4("w1_scale", "not float32", w1_scale=lambda a: a["w1_scale"].half()),
    _f4("w1_zero", "not int8", w1_zero=lambda a: a["w1_zero"].int()),
    _f4("w2_scale", "not 4-D [E, OC/32, groups, 32]", w2_scale=lambda a: a["w2_scale"][..., 0]),
    _f4("w1_scale", "an odd number of 32-row blocks (2N must be even)",
        w1_scale=lambda a: a["w1_scale"][:, :1].contiguous(),
        w1_zero=lambda a: a["w1_zero"][:, :1].contiguous()),
    _f4("w1_zero", "shape other than w1_scale's",
        w1_zero=lambda a: a["w1_zero"][:, :, :1].contiguous()),
    _f4("w2_scale", "blocks of 32 rows other than K / 32",
        w2_scale=lambda a: a["w2_scale"][:, :1].contiguous(),
        w2_zero=lambda a: a["w2_zero"][:, :1].contiguous()),
    _f4("w1_scale", "not contiguous", w1_scale=lambda a: _transposed(a["w1_scale"])),
    _f4("w1", "a group size int4 does not support (here 192)",
        hidden_states=torch.zeros(M, 384, dtype=BF16), w1_scale=torch.ones(E, 2, 2, 32),
        w1_zero=torch.zeros(E, 2, 2, 32, dtype=torch.int8)),
    _f4("w1", "not uint8", w1=lambda a: a["w1"].view(torch.int8)),
    _f4("w1", "shape other than the packed one", w1=lambda a: a["w1"][..., :-1].contiguous()),
    _f4("w2", "not contiguous",
        w2=lambda a: a["w2"].transpose(0, 1).contiguous().transpose(0, 1)),
    _q("quant_method_4bit", "not 0 (AWQ) or 1 (GPTQ)", method=2),
    _q("weight", "not int32", qweight=lambda a: a["qweight"].long()),
    _q("qzeros", "not int32", qzeros=lambda a: a["qzeros"].short()),
    _q("scales", "not bfloat16/float16/float32", scales=lambda a: a["scales"].double()),
    _q("scales", "not 2-D or 3-D", scales=lambda a: a["scales"][None]),
    _q("weight", "2-D while the others are 3-D", qweight=lambda a: a["qweight"][0]),
    _q("qzeros", "not contiguous", qzeros=lambda a: _transposed(a["qzeros"])),
    _q("weight", "experts other than qzeros' and scales'",
       qzeros=lambda a: a["qzeros"][:1], scales=lambda a: a["scales"][:1]),
    _q("scales", "columns other than out_features",
       scales=lambda a: a["scales"][..., :32].contiguous()),
    _q("qzeros", "shape other than [groups, out_features / 8]",
       qzeros=lambda a: a["qzeros"][:, :1].contiguous()),
    _q("weight", "out_features not a multiple of 32", oc=16),
    _q("scales", "groups that do not divide in_features (here 3)",
       qzeros=torch.zeros(2, 3, 8, dtype=torch.int32),
       scales=torch.ones(2, 3, 64, dtype=torch.float16)),
    _q("scales", "a group size int4 does not support (here 192)", ic=384, group=192),
    Rejected("int4", "weight", "not a CPU tensor, reaching the CPU kernel",
             lambda: call_pack_int4(cpu_kernel=True, qweight=_meta("qweight"))),
    # -- routing (topk_softmax_cpu, ..., biased_topk_cpu, hash_topk_cpu) --------------------
    _r("hidden_states", "not 2-D", "topk_softmax", hidden_states=torch.zeros(M * K, dtype=BF16)),
    _r("gating_output", "not 2-D", "topk_sigmoid",
       gating_output=lambda a: a["gating_output"].flatten()),
    _r("gating_output", "float64 (any dtype but float32/bfloat16/float16)", "topk_softmax",
       gating_output=lambda a: a["gating_output"].double()),
    _r("gating_output", "rows other than M", "topk_softmax", gating_output=torch.zeros(M + 1, E)),
    _r("gating_output", "no columns (E = 0)", "topk_softmax", gating_output=torch.zeros(M, 0)),
    _r("topk", "0", "topk_softmax", topk=0),
    _r("topk", "more than E (here 9)", "topk_sigmoid", topk=E + 1),
    _r("correction_bias", "numel other than E", correction_bias=torch.zeros(E + 1)),
    _r("correction_bias", "integer dtype", "biased_topk",
       correction_bias=torch.zeros(E, dtype=torch.int32)),
    _r("num_expert_group", "0", "grouped_topk", num_expert_group=0),
    _r("num_expert_group", "not dividing E (here 3)", num_expert_group=3),
    _r("topk_group", "above num_expert_group (here 5)", "grouped_topk", topk_group=5),
    _r("topk_group", "0", topk_group=0),
    _r("topk", "more than the experts of the groups kept (here 5 > 2 groups of 2)",
       "grouped_topk", topk=5),
    _r("num_fused_shared_experts", "negative", num_fused_shared_experts=-1),
    _r("num_fused_shared_experts", "given without routed_scaling_factor",
       num_fused_shared_experts=1),
    _r("topk", "1 with a fused shared expert (no routed slot left)", "grouped_topk", topk=1,
       num_fused_shared_experts=1, routed_scaling_factor=2.5),
    _r("topk", "more than E + 1 with a fused shared expert", "biased_topk", topk=E + 2,
       num_fused_shared_experts=1, routed_scaling_factor=2.5),
    _r("routed_scaling_factor", "0", routed_scaling_factor=0.0),
    _r("routed_scaling_factor", "beyond float32 (here 1e39)", "grouped_topk",
       routed_scaling_factor=1e39),
    _r("num_token_non_padded", "float32", num_token_non_padded=torch.tensor([2.0])),
    _r("num_token_non_padded", "more than one value", "grouped_topk",
       num_token_non_padded=torch.tensor([2, 3], dtype=torch.int32)),
    _r("scoring_func", "not sigmoid or sqrtsoftplus (here softmax)", "biased_topk",
       scoring_func="softmax"),
    _r("apply_routed_scaling_factor_on_output", "True without routed_scaling_factor",
       "biased_topk", apply_routed_scaling_factor_on_output=True),
    _r("gating_output", "float64", "hash_topk", gating_output=lambda a: a["gating_output"].double()),
    _r("num_experts", "other than gating_output.size(1)", "hash_topk", num_experts=E + 1),
    _r("scoring_func", "not softmax, sigmoid or sqrtsoftplus (here tanh)", "hash_topk",
       scoring_func="tanh"),
    _r("num_fused_shared_experts", "negative", "hash_topk", num_fused_shared_experts=-1),
    _r("routed_scaling_factor", "0 with a fused shared expert", "hash_topk", topk=TOPK + 1,
       num_fused_shared_experts=1, routed_scaling_factor=0.0),
    _r("routed_scaling_factor", "NaN with a fused shared expert", "hash_topk", topk=TOPK + 1,
       num_fused_shared_experts=1, routed_scaling_factor=float("nan")),
    _r("topk", "0", "hash_topk", topk=0, tid2eid=torch.zeros(M, 0, dtype=torch.int32)),
    _r("topk", "1 with a fused shared expert (no routed slot left)", "hash_topk", topk=1,
       num_fused_shared_experts=1, routed_scaling_factor=2.5,
       tid2eid=torch.zeros(M, 0, dtype=torch.int32)),
    _r("tid2eid", "int64", "hash_topk", tid2eid=lambda a: a["tid2eid"].long()),
    _r("tid2eid", "columns other than topk", "hash_topk", topk=TOPK + 1),
    _r("tid2eid", "columns other than topk - 1 with a fused shared expert", "hash_topk",
       num_fused_shared_experts=1, routed_scaling_factor=2.5),
    _r("tid2eid", "rows other than M", "hash_topk",
       tid2eid=torch.zeros(M + 1, TOPK, dtype=torch.int32)),
    _r("tid2eid", "not 2-D", "hash_topk", tid2eid=lambda a: a["tid2eid"].flatten()),
    _r("tid2eid", "an id outside [0, E) (here E at [2, 1])", "hash_topk",
       tid2eid=lambda a: a["tid2eid"].index_put((torch.tensor(2), torch.tensor(1)),
                                                torch.tensor(E, dtype=torch.int32))),
    _r("tid2eid", "a negative id", "hash_topk", tid2eid=lambda a: a["tid2eid"] - E),
    *[Rejected("devices", name, f"not a CPU tensor, reaching the CPU kernel ({op}_cpu)",
               lambda op=op, name=name: call_routing(op, cpu_kernel=True,
                                                     **{name: _meta(name)}))
      for op, name in [("topk_softmax", "hidden_states"), ("topk_softmax", "gating_output"),
                       ("biased_grouped_topk", "correction_bias"), ("hash_topk", "tid2eid")]],
    Rejected("devices", "num_token_non_padded",
             "not a CPU tensor, reaching the CPU kernel (grouped_topk_cpu)",
             lambda: call_routing("grouped_topk", cpu_kernel=True,
                                  num_token_non_padded=torch.tensor([2], device="meta"))),
    Rejected("devices", "gating_output", "a meta tensor among CPU tensors (routing ops)",
             lambda: call_routing("biased_topk", gating_output=_meta("gating_output"))),
    # -- fused_experts_fp32_cpu: fused_experts_cpu's checks, its own name -----------------
    _f32("hidden_states", "float32 (any dtype but bfloat16/float16)",
         hidden_states=torch.zeros(M, K)),
    _f32("w1", "dtype other than the scheme's", w1=lambda a: a["w1"].half()),
    _f32("topk_ids", "an id outside [0, E) other than -1 (here 8 at [2, 1])", topk_ids=_bad_id),
    _f32("activation", "not silu or gelu", activation="relu"),
    # -- cpumoe.distributed ---------------------------------------------------------------
    _d("w1", "0-D (no expert dim)", w1=torch.tensor(1.0)),
    _d("first_expert", "a local range [first_expert, first_expert + E) beyond num_experts",
       first_expert=E + 1),
    _d("num_experts", "0", num_experts=0),
    _d("topk_ids", "a global id outside [0, num_experts) other than -1 (here 16 at [2, 1])",
       topk_ids=_bad_global_id),
    _d("topk_ids", "not int32 or int64", topk_ids=lambda a: a["topk_ids"].float()),
    _d("torch.distributed", "not initialized (valid arguments otherwise)"),
    Rejected("distributed", "tensor", "E not divisible by world_size (shard_experts)",
             _shard(torch.zeros(E + 1, 4))),
    Rejected("distributed", "tensor", "0-D (shard_experts)", _shard(torch.tensor(1.0))),
    Rejected("distributed", "rank", "outside [0, world_size) (expert_range, shard_experts)",
             _range(rank=2)),
    Rejected("distributed", "world_size", "0 (expert_range)", _range(world_size=0)),
    Rejected("distributed", "num_experts", "not divisible by world_size (expert_range)",
             _range(num_experts=2 * E + 1)),
]

# -- the dense linear ops ---------------------------------------------------------------
# Valid arguments: mat1 [M, K] bf16, one weight of N rows, per op; each case breaks one.

LINEAR_OPS = {"wpl": "weight_packed_linear", "int8": "int8_scaled_mm_with_quant",
              "fp8": "fp8_scaled_mm_cpu", "int4": "int4_scaled_mm_cpu"}


def linear_args(op: str) -> dict:
    """Valid arguments of the linear op `op` (a key of LINEAR_OPS), by schema name."""
    from cpumoe import quant

    f = torch.randn(N, K) / 8
    mat1 = torch.zeros(M, K, dtype=BF16)
    if op == "wpl":
        return dict(mat1=mat1, mat2=pack(f.to(BF16)), bias=None, is_vnni=True)
    if op == "int8":
        q, s = quant.quantize_int8_per_channel(f)
        return dict(mat1=mat1, mat2=pack(q), scales2=s, bias=None, out_dtype=BF16, is_vnni=True)
    if op == "fp8":
        q, s = quant.quantize_fp8_blockwise(f, FP8_BLOCK)
        return dict(mat1=mat1, mat2=pack(q), scales2=s, block_size=list(FP8_BLOCK), bias=None,
                    out_dtype=BF16, is_vnni=True)
    w, z, s = cpumoe.convert_weight_packed_scale_zp(*quant.quantize_int4(f, 32, "awq"), 0)
    return dict(x=mat1, w=w, w_zeros=z, w_scales=s, bias=None)


def call_linear(op="wpl", *, cpu_kernel=False, **over):
    """torch.ops.cpumoe.<LINEAR_OPS[op]> with valid arguments, `over` applied; cpu_kernel
    as in call_fused."""
    a = _apply(linear_args(op), over)
    fn = getattr(torch.ops.cpumoe, LINEAR_OPS[op]).default
    if cpu_kernel:
        return fn.redispatch(CPU_KEYS, *a.values())
    return fn(*a.values())


def _l(arg, what, op="wpl", **over):
    return Rejected("linear", arg, f"{what} ({LINEAR_OPS[op]})", lambda: call_linear(op, **over))


def _wide_mat2(a):
    """A weight of 48 rows (not a multiple of 32), unpacked (packing needs 16)."""
    return torch.zeros(48, K, dtype=BF16)


LINEAR_CATALOGUE = [
    _l("mat1", "float32 (any dtype but bfloat16/float16)", mat1=torch.zeros(M, K)),
    _l("mat1", "not 2-D", "int8", mat1=torch.zeros(1, M, K, dtype=BF16)),
    _l("mat1", "K not a multiple of 32 (here 48)", mat1=torch.zeros(M, 48, dtype=BF16)),
    _l("mat1", "no columns (K = 0)", "fp8", mat1=torch.zeros(M, 0, dtype=BF16)),
    _l("x", "float32", "int4", x=torch.zeros(M, K)),
    _l("out_dtype", "other than mat1's", "int8", out_dtype=torch.float32),
    _l("out_dtype", "other than mat1's", "fp8", out_dtype=torch.float16),
    _l("mat2", "not 2-D", mat2=lambda a: a["mat2"][None]),
    _l("mat2", "float32 (convert_weight_packed's copy of a weight of fewer than 16 rows)",
       mat2=lambda a: cpumoe.convert_weight_packed(torch.zeros(8, K, dtype=BF16))),
    _l("mat2", "dtype other than mat1's", mat2=lambda a: a["mat2"].half()),
    _l("mat2", "not int8", "int8", mat2=lambda a: a["mat2"].to(BF16)),
    _l("mat2", "not float8_e4m3fn", "fp8", mat2=lambda a: a["mat2"].view(torch.int8)),
    _l("mat2", "columns other than K", mat2=torch.zeros(N, 2 * K, dtype=BF16)),
    _l("mat2", "packed columns other than K + 4", "int8",
       mat2=lambda a: a["mat2"][:, :K].contiguous()),
    _l("mat2", "columns other than K (is_vnni=False)", "int8", is_vnni=False,
       mat2=torch.zeros(N, K + 4, dtype=torch.int8)),
    _l("mat2", "rows (out features) not a multiple of 32 (here 48)", is_vnni=False,
       mat2=_wide_mat2),
    _l("mat2", "not contiguous", mat2=_noncontig("mat2")),
    _l("mat1", "K above 65536 (int8 sums)", "int8", mat1=torch.zeros(1, 65568, dtype=BF16)),
    _l("scales2", "not float32", "int8", scales2=lambda a: a["scales2"].half()),
    _l("scales2", "numel other than N", "int8", scales2=torch.ones(N + 1)),
    _l("scales2", "not contiguous", "int8", scales2=torch.ones(N, 2)[:, 0]),
    _l("scales2", "shape other than [ceil(N / block_n), ceil(K / block_k)]", "fp8",
       scales2=torch.ones(1, 1)),
    _l("scales2", "not float32", "fp8", scales2=lambda a: a["scales2"].double()),
    _l("block_size", "not 2 values", "fp8", block_size=[32, 32, 32]),
    _l("block_size", "odd block_k", "fp8", block_size=[32, 31]),
    _l("block_size", "not positive", "fp8", block_size=[0, 32]),
    _l("w_scales", "not 3-D [N/32, groups, 32]", "int4",
       w_scales=lambda a: a["w_scales"][..., 0].contiguous()),
    _l("w_scales", "groups that do not divide K (here 3)", "int4",
       w_scales=torch.ones(1, 3, 32), w_zeros=torch.zeros(1, 3, 32, dtype=torch.int8)),
    _l("w_scales", "a group size int4 does not support (here 6)", "int4",
       x=torch.zeros(M, 96, dtype=BF16), w_scales=torch.ones(1, 16, 32),
       w_zeros=torch.zeros(1, 16, 32, dtype=torch.int8)),
    _l("w_scales", "not float32", "int4", w_scales=lambda a: a["w_scales"].half()),
    _l("w_zeros", "not int8", "int4", w_zeros=lambda a: a["w_zeros"].int()),
    _l("w_zeros", "shape other than w_scales'", "int4",
       w_zeros=lambda a: a["w_zeros"][:, :1].contiguous()),
    _l("w", "not uint8", "int4", w=lambda a: a["w"].view(torch.int8)),
    _l("w", "shape other than the packed one", "int4", w=lambda a: a["w"][..., :-1].contiguous()),
    _l("w", "not contiguous", "int4", w=lambda a: _transposed(a["w"])),
    _l("bias", "float64", bias=torch.zeros(N, dtype=torch.float64)),
    _l("bias", "shape other than [N]", "int4", bias=torch.zeros(1, N)),
    _l("mat2", "a meta tensor among CPU tensors", "int8", mat2=_meta("mat2")),
    _l("w_scales", "a meta tensor among CPU tensors", "int4", w_scales=_meta("w_scales")),
    *[Rejected("linear", name, f"not a CPU tensor, reaching the CPU kernel ({LINEAR_OPS[op]})",
               lambda op=op, name=name: call_linear(op, cpu_kernel=True, **{name: _meta(name)}))
      for op, name in [("wpl", "mat1"), ("wpl", "mat2"), ("int8", "scales2"), ("fp8", "scales2"),
                       ("int4", "x"), ("int4", "w"), ("int4", "w_zeros"),
                       ("int4", "w_scales")]],
    Rejected("linear", "bias", "not a CPU tensor, reaching the CPU kernel (weight_packed_linear)",
             lambda: call_linear("wpl", cpu_kernel=True, bias=torch.zeros(N, device="meta"))),
]
CATALOGUE += LINEAR_CATALOGUE


@pytest.mark.parametrize("op", list(LINEAR_OPS))
def test_catalogue_linear_baselines_pass(op):
    """The valid arguments every linear case perturbs are accepted, with and without bias."""
    for cpu_kernel in (False, True):
        assert call_linear(op, cpu_kernel=cpu_kernel).shape == (M, N)
        assert call_linear(op, cpu_kernel=cpu_kernel, bias=torch.zeros(N)).shape == (M, N)


SECTIONS = {  # docs/ERRORS.md table name -> the op each message starts with
    "fused": "fused_experts_cpu", "fused-int8": "fused_experts_cpu",
    "fused-fp8": "fused_experts_cpu", "fused-mxfp4": "fused_experts_cpu",
    "fused-out": "fused_experts_cpu", "shared": "shared_expert_cpu",
    "pack": "convert_weight_packed", "pack-scales": "convert_scale_packed", "devices": "",
    "int4": "",
    "routing": "(" + "|".join(op + "_cpu" for op in ROUTING_OPS) + ")",
    "linear": "(" + "|".join(LINEAR_OPS.values()) + ")",
    "fp32": "fused_experts_fp32_cpu",
    "distributed": r"(cpumoe\.distributed\.fused_experts|shard_experts|expert_range)",
}


def observed_message(case: Rejected) -> str:
    """First line of the message `case` raises (AssertionError if the call is accepted)."""
    try:
        case.call()
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        if type(e) is not case.exc:
            raise AssertionError(f"{case}: expected {case.exc.__name__}, got {e!r}") from e
        return str(e).strip().splitlines()[0]
    raise AssertionError(f"{case}: the op accepted the input")


@pytest.mark.parametrize("method", [0, 1, 2, 3, 4])
def test_catalogue_baselines_pass(method):
    """The valid arguments every catalogue case perturbs are accepted."""
    assert call_fused(method).shape == (M, K)
    assert call_fused(method, cpu_kernel=True).shape == (M, K)
    assert call_fused(method, **WITH_BIAS).shape == (M, K)
    if method < 3:
        assert call_shared(method).shape == (M, K)
        assert call_shared(method, cpu_kernel=True).shape == (M, K)
    elif method == 3:
        assert call_pack_int4()[0].dtype == torch.uint8
        assert call_pack_int4(cpu_kernel=True)[0].dtype == torch.uint8
    else:
        scale = torch.zeros(E, 2 * N, 2, dtype=torch.uint8)
        assert call_pack_scales(scale).shape == scale.shape
        assert call_pack_scales(scale, cpu_kernel=True).shape == scale.shape


@pytest.mark.parametrize("op", ROUTING_OPS)
def test_catalogue_routing_baselines_pass(op):
    for cpu_kernel in (False, True):
        w, ids = call_routing(op, cpu_kernel=cpu_kernel)
        assert w.shape == ids.shape == (M, TOPK)


@pytest.mark.parametrize("case", CATALOGUE, ids=str)
def test_rejected(case):
    """Each case raises its exception type with a message that starts with the op's name
    and names the argument (a whole word: `w1` is not found in `w1_bias`)."""
    msg = observed_message(case)
    op = SECTIONS[case.section] or (r"(fused_experts_cpu|shared_expert_cpu|"
                                    r"convert_weight_packed|convert_weight_packed_scale_zp|"
                                    r"convert_scale_packed|" + SECTIONS["routing"][1:])
    if case.exc is NotImplementedError:  # torch's dispatcher: no kernel for the tensor type
        op = r"Could not run 'cpumoe::(fused_experts_cpu|convert_weight_packed)'"
    assert re.match(rf"{op}: " if case.exc is RuntimeError else op, msg), msg
    if case.arg:
        named = re.search(rf"(?<![\w.]){re.escape(case.arg)}s?\b", msg) is not None
        assert named != case.unnamed, (case.arg, msg, "unnamed" if case.unnamed else "")


def test_catalogue_has_no_duplicates():
    assert len({str(c) for c in CATALOGUE}) == len(CATALOGUE)


# docs/ERRORS.md: each table sits between `<!-- table:NAME -->` and `<!-- end table:NAME -->`.

DOC = Path(__file__).resolve().parent.parent / "docs" / "ERRORS.md"


def doc_table(section: str) -> str:
    rows = ["| argument | rejected input | message |", "|---|---|---|"]
    for case in CATALOGUE:
        if case.section != section:
            continue
        msg = observed_message(case)
        if case.truncate:
            msg = msg.split(". ")[0] + ". …"
        arg = f"`{case.arg}`" if case.arg else "any tensor"
        if case.unnamed:
            arg += " (not named in the message)"
        rows.append(f"| {arg} | {case.what.replace('|', '/')} | `{msg.replace('|', '/')}` |")
    return "\n".join(rows)


def _table_span(text: str, section: str):
    begin, end = f"<!-- table:{section} -->\n", f"\n<!-- end table:{section} -->"
    i = text.find(begin)
    j = text.find(end, i)
    assert i >= 0 and j >= 0, f"docs/ERRORS.md lacks the markers of table {section!r}"
    return i + len(begin), j


def write_doc() -> None:
    text = DOC.read_text()
    for section in SECTIONS:
        i, j = _table_span(text, section)
        text = text[:i] + doc_table(section) + text[j:]
    DOC.write_text(text)


def test_errors_doc():
    """docs/ERRORS.md lists every catalogue case with the message the op gives today."""
    text = DOC.read_text()
    problems = []
    for section in SECTIONS:
        i, j = _table_span(text, section)
        want = doc_table(section)
        if text[i:j] != want:
            problems += difflib.unified_diff(text[i:j].splitlines(), want.splitlines(),
                                             f"docs/ERRORS.md {section}", "the ops today",
                                             lineterm="")
    assert not problems, ("docs/ERRORS.md is out of date (python tests/test_errors.py "
                          "--write-doc rewrites its tables):\n" + "\n".join(problems))


if __name__ == "__main__" and "--write-doc" in sys.argv:
    write_doc()
