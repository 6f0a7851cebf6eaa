"""The overloads for the other libraries' newer schemas:

* ``fused_experts_cpu.out`` (vLLM's out-variant): the same bits as the default overload
  on every scheme and tier, written into ``out`` (which may be, or overlap,
  ``hidden_states``); ``a1_scale`` and a bad ``out`` rejected;
* ``shared_expert_cpu.mxfp4`` (SGLang's DeepSeek-V4 schema): without its new arguments the
  same bits as the default overload; ``alpha``/``limit`` give the clamped swiglu, the same
  bits as fused_experts with one expert (``limit`` alone, the clamped silu:
  test_activation.py); ``use_mxfp4`` goes through the scheme table.

Both under opcheck and torch.compile. (Their SGLang/vLLM namespaces: test_switch.py.)"""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import reference
from cpumoe_testing import (
    DTYPES,
    Int4Weights,
    assert_moe_close,
    make_bias,
    make_mxfp4_weights,
    make_routing,
    make_scheme_weights,
    pack,
    raises,
)

M, E, TOPK, N, K = 5, 8, 2, 32, 64
ALPHA, LIMIT = 1.702, 7.0


def scheme_args(method, dtype=torch.bfloat16, m=M):
    """(hidden_states, packed w1, packed w2, topk_weights, topk_ids, keyword arguments) of
    fused_experts for moe_comp_method `method`."""
    x = torch.randn(m, K).to(dtype)
    tw, ti = make_routing(m, E, TOPK)
    if method == 3:
        w = Int4Weights(E, N, K, 32)
        return x, w.p1[0], w.p2[0], tw, ti, w.op_kwargs()
    if method == 4:
        c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
        return x, pack(c1), pack(c2), tw, ti, dict(
            moe_comp_method=4, w1_scale=cpumoe.convert_scale_packed(s1),
            w2_scale=cpumoe.convert_scale_packed(s2))
    w1, w2, kw = make_scheme_weights(method, E, N, K, dtype)
    return x, pack(w1), pack(w2), tw, ti, kw


# ---------------------------------------------------------------------------------------
# fused_experts_cpu.out


@pytest.mark.parametrize("variant", ["plain", "bias_swiglu"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("method", [0, 1, 2, 3, 4])
def test_out_equals_default(isa, method, dt, variant):
    x, w1, w2, tw, ti, kw = scheme_args(method, DTYPES[dt])
    if variant == "bias_swiglu":
        b1, b2 = make_bias(E, N, K)
        kw.update(w1_bias=b1, w2_bias=b2, alpha=ALPHA, limit=LIMIT)
    want = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
    out = torch.full_like(x, float("nan"))
    x_before = x.clone()
    assert cpumoe.fused_experts_into(out, x, w1, w2, tw, ti, **kw) is None
    assert torch.equal(out, want)
    assert torch.equal(x, x_before), "the out-variant modified hidden_states"


@pytest.mark.parametrize("method", [0, 1, 2, 3, 4])
def test_out_is_hidden_states(isa, method):
    """out = hidden_states: the inplace call, the same bits."""
    x, w1, w2, tw, ti, kw = scheme_args(method)
    want = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
    cpumoe.fused_experts_into(x, x, w1, w2, tw, ti, **kw)
    assert torch.equal(x, want)


def test_out_overlaps_hidden_states():
    """out and hidden_states share rows (one buffer, shifted by a row): the result is the
    one of the untouched hidden_states."""
    x, w1, w2, tw, ti, kw = scheme_args(0)
    buf = torch.empty(M + 1, K, dtype=x.dtype)
    buf[:M] = x
    want = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
    cpumoe.fused_experts_into(buf[1:], buf[:M], w1, w2, tw, ti, **kw)
    assert torch.equal(buf[1:], want)


def test_out_positional_vllm_call():
    """vLLM's call (cpu_moe.py): out, hidden_states, w1, w2, topk_weights, topk_ids, method,
    w1_scale, w2_scale, w1_zero, w2_zero, a1_scale, block_size, w1_bias, w2_bias, alpha,
    limit, is_vnni; resolves to .out among the overloads."""
    x, w1, w2, tw, ti, kw = scheme_args(2)
    want = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
    out = torch.empty_like(x)
    result = torch.ops.cpumoe.fused_experts_cpu(out, x, w1, w2, tw, ti, 2, kw["w1_scale"],
                                                kw["w2_scale"], None, None, None,
                                                kw["block_size"], None, None, None, None, True)
    assert result is None
    assert torch.equal(out, want)


def test_out_thread_count_independent():
    x, w1, w2, tw, ti, kw = scheme_args(1, m=67)
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        out = torch.empty_like(x)
        cpumoe.fused_experts_into(out, x, w1, w2, tw, ti, **kw)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_out_empty_batch():
    x, w1, w2, tw, ti, kw = scheme_args(0, m=0)
    out = torch.empty_like(x)
    cpumoe.fused_experts_into(out, x, w1, w2, tw, ti, **kw)
    assert out.shape == (0, K)


def test_out_matches_reference():
    x = torch.randn(M, K).to(torch.bfloat16)
    w1, w2, kw = make_scheme_weights(0, E, N, K)
    tw, ti = make_routing(M, E, TOPK)
    out = torch.empty_like(x)
    cpumoe.fused_experts_into(out, x, pack(w1), pack(w2), tw, ti)
    assert_moe_close(out, reference.fused_experts(x, w1, w2, tw, ti))


@pytest.mark.parametrize("variant", ["plain", "bias_swiglu"])
def test_out_opcheck(variant):
    x, w1, w2, tw, ti, _ = scheme_args(0)
    b1, b2 = make_bias(E, N, K) if variant == "bias_swiglu" else (None, None)
    alpha, limit = (ALPHA, LIMIT) if variant == "bias_swiglu" else (None, None)
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.out,
                          (torch.empty_like(x), x, w1, w2, tw, ti, 0, None, None, None, None,
                           None, None, b1, b2, alpha, limit, True))


def test_out_compile_fullgraph_matches_eager():
    x, w1, w2, tw, ti, _ = scheme_args(0)

    def layer(x, w1, w2, tw, ti):
        out = torch.empty_like(x)
        cpumoe.fused_experts_into(out, x, w1, w2, tw, ti)
        return out.float()

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, w1, w2, tw, ti)
    assert torch.equal(got, layer(x, w1, w2, tw, ti))


def call_out(**over):
    x, w1, w2, tw, ti, _ = scheme_args(0)
    args = dict(out=torch.empty_like(x), hidden_states=x, a1_scale=None)
    args.update(over)
    torch.ops.cpumoe.fused_experts_cpu.out(args["out"], args["hidden_states"], w1, w2, tw, ti,
                                           0, None, None, None, None, args["a1_scale"], None,
                                           None, None, None, None, True)
    return args["out"]


def test_out_rejects_a1_scale():
    with raises(r"fused_experts_cpu: a1_scale must be None"):
        call_out(a1_scale=torch.ones(M, 1))


@pytest.mark.parametrize("bad, pattern", [
    (lambda x: x.half(), r"out must have the dtype of hidden_states \(BFloat16\), got Half"),
    (lambda x: x[:-1], r"out must have the shape of hidden_states \[5, 64\], got \[4, 64\]"),
    (lambda x: x.t().contiguous().t(), r"out must be contiguous"),
    (lambda x: x[None], r"out must be a 2-D tensor"),
], ids=["dtype", "shape", "noncontiguous", "3d"])
def test_out_rejects_bad_out(bad, pattern):
    x = torch.empty(M, K, dtype=torch.bfloat16)
    with raises(pattern):
        call_out(out=bad(x))


def test_out_rejected_call_writes_nothing():
    x, w1, w2, tw, ti, _ = scheme_args(0)
    out = torch.full_like(x, 3.0)
    with raises(r"topk_ids"):
        cpumoe.fused_experts_into(out, x, w1, w2, tw, ti.float())
    assert (out == 3.0).all()


# ---------------------------------------------------------------------------------------
# shared_expert_cpu.mxfp4


def shared_args(scheme, dtype=torch.bfloat16, m=M):
    """(hidden_states, w1 [2N, K], w2 [K, N] unpacked, keyword arguments of
    cpumoe.shared_expert and reference.shared_expert) for "bf16", "int8" or "fp8"."""
    x = torch.randn(m, K).to(dtype)
    f1, f2 = torch.randn(2 * N, K) / K ** 0.5, torch.randn(K, N) / N ** 0.5
    if scheme == "bf16":
        return x, f1.to(dtype), f2.to(dtype), {}
    if scheme == "int8":
        (w1, s1), (w2, s2) = (cpumoe.quant.quantize_int8_per_channel(f) for f in (f1, f2))
        return x, w1, w2, dict(use_int8_w8a8=True, w1_scale=s1, w2_scale=s2)
    (w1, s1), (w2, s2) = (cpumoe.quant.quantize_fp8_blockwise(f, (32, 32)) for f in (f1, f2))
    return x, w1, w2, dict(use_fp8_w8a16=True, w1_scale=s1, w2_scale=s2, block_size=[32, 32])


def shared_mxfp4_op(x, w1, w2, fused=None, factor=None, *, use_int8_w8a8=False,
                    use_fp8_w8a16=False, use_mxfp4=False, w1_scale=None, w2_scale=None,
                    block_size=None, alpha=None, limit=None, inplace=False):
    """The .mxfp4 overload called positionally, as SGLang's DeepSeek-V4 path calls it."""
    return torch.ops.cpumoe.shared_expert_cpu.mxfp4(
        x, w1, w2, fused, factor, inplace, use_int8_w8a8, use_fp8_w8a16, use_mxfp4, w1_scale,
        w2_scale, block_size, alpha, limit, True)


@pytest.mark.parametrize("residual", [True, False], ids=["fused_out", "no_fused_out"])
@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8"])
def test_shared_mxfp4_overload_equals_default(isa, scheme, residual):
    x, w1, w2, kw = shared_args(scheme)
    fused, factor = (torch.randn(M, K).to(x.dtype), 2.5) if residual else (None, None)
    want = cpumoe.shared_expert(x, pack(w1), pack(w2), fused, factor, **kw)
    got = shared_mxfp4_op(x, pack(w1), pack(w2), fused, factor, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8"])
def test_shared_swiglu_equals_one_expert(isa, scheme, dt):
    """alpha/limit: the clamped swiglu, the same bits as fused_experts with E = 1 and
    weight 1 (x scaled past the clamp)."""
    x, w1, w2, kw = shared_args(scheme, DTYPES[dt])
    x = (x.float() * 3).to(x.dtype)
    got = cpumoe.shared_expert(x, pack(w1), pack(w2), alpha=ALPHA, limit=LIMIT, **kw)
    fkw = {k: (v[None] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()
           if k not in ("use_int8_w8a8", "use_fp8_w8a16")}
    method = 1 if kw.get("use_int8_w8a8") else 2 if kw.get("use_fp8_w8a16") else 0
    want = cpumoe.fused_experts(x, pack(w1[None]), pack(w2[None]), torch.ones(M, 1),
                                torch.zeros(M, 1, dtype=torch.int32), moe_comp_method=method,
                                alpha=ALPHA, limit=LIMIT, **fkw)
    assert torch.equal(got, want)
    plain = cpumoe.shared_expert(x, pack(w1), pack(w2), **kw)
    assert not torch.equal(got, plain), "alpha/limit changed nothing"


def test_shared_swiglu_matches_reference(isa):
    x, w1, w2, _ = shared_args("bf16")
    x = (x.float() * 3).to(x.dtype)
    fused = torch.randn(M, K).to(x.dtype)
    got = shared_mxfp4_op(x, pack(w1), pack(w2), fused, 2.5, alpha=ALPHA, limit=LIMIT)
    assert_moe_close(got, reference.shared_expert(x, w1, w2, fused, 2.5, alpha=ALPHA,
                                                  limit=LIMIT))


def test_shared_swiglu_inplace():
    x, w1, w2, _ = shared_args("bf16")
    want = cpumoe.shared_expert(x, pack(w1), pack(w2), alpha=ALPHA, limit=LIMIT)
    out = shared_mxfp4_op(x, pack(w1), pack(w2), alpha=ALPHA, limit=LIMIT, inplace=True)
    assert out.data_ptr() == x.data_ptr() and torch.equal(x, want)


def test_shared_mxfp4_positional_resolution():
    """15 positional arguments resolve to .mxfp4, 12 to the default overload."""
    x, w1, w2, _ = shared_args("bf16")
    p1, p2 = pack(w1), pack(w2)
    op = torch.ops.cpumoe.shared_expert_cpu
    twelve = op(x, p1, p2, None, None, False, False, False, None, None, None, True)
    fifteen = op(x, p1, p2, None, None, False, False, False, False, None, None, None, ALPHA,
                 LIMIT, True)
    assert torch.equal(twelve, cpumoe.shared_expert(x, p1, p2))
    assert torch.equal(fifteen, cpumoe.shared_expert(x, p1, p2, alpha=ALPHA, limit=LIMIT))


@pytest.mark.skipif(hasattr(torch.ops.cpumoe, "convert_scale_packed"),
                    reason="this build has the MXFP4 scheme (its tests cover use_mxfp4)")
def test_shared_use_mxfp4_without_the_scheme():
    x, w1, w2, _ = shared_args("bf16")
    with raises(r"shared_expert_cpu: use_mxfp4=True selects the mxfp4 weight scheme, which is "
                r"not available in this build of cpumoe"):
        shared_mxfp4_op(x, pack(w1), pack(w2), use_mxfp4=True)


@pytest.mark.parametrize("flags, names", [
    (dict(use_int8_w8a8=True, use_mxfp4=True), "use_int8_w8a8 and use_mxfp4 cannot both"),
    (dict(use_int8_w8a8=True, use_fp8_w8a16=True, use_mxfp4=True),
     "use_int8_w8a8, use_fp8_w8a16 and use_mxfp4 cannot all"),
])
def test_shared_rejects_several_flags(flags, names):
    x, w1, w2, _ = shared_args("bf16")
    with raises(rf"shared_expert_cpu: {names} be True"):
        shared_mxfp4_op(x, pack(w1), pack(w2), **flags)


def test_shared_alpha_needs_limit():
    """alpha alone is an error (limit alone is the clamped silu: test_activation.py)."""
    x, w1, w2, _ = shared_args("bf16")
    with raises(r"shared_expert_cpu: alpha needs limit .*got only alpha"):
        shared_mxfp4_op(x, pack(w1), pack(w2), alpha=1.0)


@pytest.mark.parametrize("act", ["swiglu", "silu"])
def test_shared_mxfp4_opcheck(act):
    x, w1, w2, _ = shared_args("bf16")
    alpha, limit = (ALPHA, LIMIT) if act == "swiglu" else (None, None)
    torch.library.opcheck(torch.ops.cpumoe.shared_expert_cpu.mxfp4,
                          (x, pack(w1), pack(w2), torch.randn(M, K).to(x.dtype), 2.5, False,
                           False, False, False, None, None, None, alpha, limit, True))


def test_shared_swiglu_compile_fullgraph_matches_eager():
    x, w1, w2, _ = shared_args("bf16")
    p1, p2 = pack(w1), pack(w2)

    def layer(x):
        return cpumoe.shared_expert(x, p1, p2, alpha=ALPHA, limit=LIMIT).float()

    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))
