"""The ops as PyTorch operators: schemas and fake kernels (torch.library.opcheck),
torch.compile(fullgraph=True), and the command-line entry point."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import cpumoe
from cpumoe import reference
from cpumoe_testing import (
    assert_moe_close,
    make_bias,
    make_routing,
    make_weights,
    pack,
    subprocess_env,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(REPO, "python")

M, E, TOPK, N, K = 3, 4, 2, 32, 64


def moe_args(dtype=torch.bfloat16, vnni=True):
    x = torch.randn(M, K).to(dtype)
    w1, w2 = make_weights(E, N, K, dtype)
    if vnni:
        w1, w2 = pack(w1), pack(w2)
    tw, ti = make_routing(M, E, TOPK)
    return x, w1, w2, tw, ti


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_opcheck_fused_experts_default(dtype, vnni):
    x, w1, w2, tw, ti = moe_args(dtype, vnni)
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.default,
                          (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, vnni))


@pytest.mark.parametrize("act", ["swiglu", "silu"])
def test_opcheck_fused_experts_bias(act):
    x, w1, w2, tw, ti = moe_args()
    b1, b2 = make_bias(E, N, K)
    alpha, limit = (1.702, 7.0) if act == "swiglu" else (None, None)
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.bias,
                          (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, b1, b2,
                           alpha, limit, True))


@pytest.mark.parametrize("residual", [True, False], ids=["fused_out", "no_fused_out"])
def test_opcheck_shared_expert(residual):
    x = torch.randn(M, K).to(torch.bfloat16)
    w1 = pack((torch.randn(2 * N, K) / K ** 0.5).to(torch.bfloat16))
    w2 = pack((torch.randn(K, N) / N ** 0.5).to(torch.bfloat16))
    fused, factor = (torch.randn(M, K).to(torch.bfloat16), 16.0) if residual else (None, None)
    torch.library.opcheck(torch.ops.cpumoe.shared_expert_cpu.default,
                          (x, w1, w2, fused, factor, False, False, False, None, None, None, True))


@pytest.mark.parametrize("shape, dtype", [
    ((64, 32), torch.bfloat16), ((2, 48, 64), torch.float16), ((8, 64), torch.bfloat16),
], ids=["2d", "3d", "2d-small-oc"])
def test_opcheck_convert_weight_packed(shape, dtype):
    torch.library.opcheck(torch.ops.cpumoe.convert_weight_packed.default,
                          (torch.randn(*shape).to(dtype),))


def test_fake_kernels_match_real_shapes():
    """Fake (meta) outputs have the real outputs' shape/dtype/strides (opcheck checks this
    too; spelled out here for the packer's small-OC case)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = torch.randn(8, 64).to(torch.bfloat16)
    real = cpumoe.convert_weight_packed(w)
    with FakeTensorMode() as mode:
        fake = cpumoe.convert_weight_packed(mode.from_tensor(w))
    assert fake.shape == real.shape and fake.dtype == real.dtype
    assert fake.stride() == real.stride()


@pytest.mark.parametrize("variant", ["plain", "bias_swiglu"])
def test_compile_fullgraph_matches_eager(variant):
    x, w1, w2, tw, ti = moe_args()
    kw = {}
    if variant == "bias_swiglu":
        b1, b2 = make_bias(E, N, K)
        kw = dict(w1_bias=b1, w2_bias=b2, alpha=1.702, limit=7.0)
    sx = torch.randn(M, K).to(torch.bfloat16)
    sw1 = pack((torch.randn(2 * N, K) / K ** 0.5).to(torch.bfloat16))
    sw2 = pack((torch.randn(K, N) / N ** 0.5).to(torch.bfloat16))

    def layer(x, w1, w2, tw, ti, sx, sw1, sw2):
        routed = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
        out = cpumoe.shared_expert(sx, sw1, sw2, routed, 2.0)
        # return the ops' own outputs, widened, so no bf16 arithmetic of the graph
        # enters the comparison
        return routed.float(), out.float()

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x, w1, w2, tw, ti, sx, sw1, sw2)
    want = layer(x, w1, w2, tw, ti, sx, sw1, sw2)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.equal(g, w)


@pytest.mark.parametrize("op", ["fused_experts", "shared_expert"])
def test_compile_inplace_wrapper_matches_eager(op):
    """inplace=True through the Python wrappers under torch.compile: the write into
    hidden_states is visible to the compiler, so reads of hidden_states before the op
    see the old values and reads after it see the result, as in eager.
    (The raw torch.ops call declares no mutation, like SGLang's schema: compiled, such a
    read may be reordered past the op; the wrappers avoid that, see ops._tracing.)"""
    x, w1, w2, tw, ti = moe_args()
    sw1 = pack((torch.randn(2 * N, K) / K ** 0.5).to(torch.bfloat16))
    sw2 = pack((torch.randn(K, N) / N ** 0.5).to(torch.bfloat16))
    routed = torch.randn(M, K).to(torch.bfloat16)

    def f(h):
        before = h.float() * 2  # must see h before the op
        if op == "fused_experts":
            out = cpumoe.fused_experts(h, w1, w2, tw, ti, inplace=True)
        else:
            out = cpumoe.shared_expert(h, sw1, sw2, routed, 16.0, inplace=True)
        return before, out.float(), h.float()

    xe, xc = x.clone(), x.clone()
    eager = f(xe)
    assert torch.equal(eager[0], x.float() * 2)
    assert not torch.equal(xe, x), "eager inplace did not write hidden_states"
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(xc)
    for name, e, c in zip(("before", "out", "hidden_after"), eager, compiled):
        assert torch.equal(e, c), name
    assert torch.equal(xe, xc)


def test_compile_result_is_correct():
    """Compiled output against the reference (not only against eager)."""
    x = torch.randn(5, K).to(torch.float16)
    w1, w2 = make_weights(E, N, K, torch.float16)
    tw, ti = make_routing(5, E, TOPK)
    pw1, pw2 = pack(w1), pack(w2)

    def f(x, tw, ti):
        return cpumoe.fused_experts(x, pw1, pw2, tw, ti)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, tw, ti)
    assert_moe_close(out, reference.fused_experts(x, w1, w2, tw, ti))


# ---------------------------------------------------------------------------------------
# Subprocesses: CPUMOE_ISA and `python -m cpumoe info`.


def run_python(code_or_args, env_extra=None, timeout=120):
    env = subprocess_env(**(env_extra or {}))
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_cli_info_prints_tier():
    if not os.path.exists(os.path.join(PYTHON_DIR, "cpumoe", "__main__.py")):
        pytest.skip("python/cpumoe/__main__.py does not exist yet (CLI being written)")
    worst = cpumoe.built_isas()[0]
    cases = [(None, cpumoe.best_isa())]
    if cpumoe.best_isa() != worst:
        cases.append((worst, worst))
    for env, tier in cases:
        res = run_python(["-m", "cpumoe", "info"], {"CPUMOE_ISA": env} if env else None)
        assert res.returncode == 0, res.stderr
        # a line saying which tier is in use (e.g. "tier in use  avx512")
        assert re.search(rf"(?im)^.*\b(in use|active)\b.*\b{tier}\b", res.stdout), res.stdout
