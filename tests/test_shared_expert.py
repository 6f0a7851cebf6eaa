"""shared_expert_cpu (bf16/fp16 weights): dense SwiGLU MLP plus
routed_scaling_factor * fused_experts_out, against reference.shared_expert, on every tier."""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import MoeCompMethod, reference
from cpumoe_testing import (
    DTYPES,
    SUPPORTED_ISAS,
    assert_moe_close,
    assert_tiers_agree,
    needs_two_tiers,
    pack,
    use_isa,
)

# (M, N, K): SGLang's test uses M in {2, 121}, N in {32, 128}, K in {32, 64}.
SHAPES = {1: (1, 32, 64), 2: (2, 128, 32), 121: (121, 96, 160)}


def make_inputs(M, N, K, dtype):
    x = torch.randn(M, K).to(dtype)
    w1 = (torch.randn(2 * N, K) / K ** 0.5).to(dtype)
    w2 = (torch.randn(K, N) / N ** 0.5).to(dtype)
    fused = (torch.randn(M, K) * 0.1).to(dtype)  # routed output, O(1) after * 16
    return x, w1, w2, fused


def call(x, w1, w2, fused, factor, *, vnni, inplace=False):
    if vnni:
        w1, w2 = pack(w1), pack(w2)
    return cpumoe.shared_expert(x, w1, w2, fused, factor, inplace=inplace, is_vnni=vnni)


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("residual", [True, False], ids=["fused_out", "no_fused_out"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("M", sorted(SHAPES))
def test_matches_reference(isa, M, dt, residual, vnni):
    dtype = DTYPES[dt]
    M, N, K = SHAPES[M]
    x, w1, w2, fused = make_inputs(M, N, K, dtype)
    fused, factor = (fused, 16.0) if residual else (None, None)
    x_before = x.clone()
    out = call(x, w1, w2, fused, factor, vnni=vnni)
    assert torch.equal(x, x_before), "inplace=False modified hidden_states"
    ref = reference.shared_expert(x, w1, w2, fused, factor)
    assert_moe_close(out, ref)
    if residual:  # the routed term is really added, scaled by 16
        plain = reference.shared_expert(x, w1, w2)
        assert not torch.allclose(out.float(), plain.float(), atol=0.1, rtol=0.1)
        # independent of reference.shared_expert: mlp via the fused reference (E=1, weight 1)
        mlp = reference.fused_experts(x, w1[None], w2[None], torch.ones(M, 1),
                                      torch.zeros(M, 1, dtype=torch.int32))
        # mlp was rounded once more here, so allow one more output ulp
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
        torch.testing.assert_close(out.float(), mlp.float() + 16.0 * fused.float(), **tol)


def test_equals_fused_experts_with_one_expert(isa):
    """Without a residual, shared_expert is fused_experts with E=1 and weight 1: same
    pipeline, same bits."""
    M, N, K = 17, 64, 96
    x, w1, w2, _ = make_inputs(M, N, K, torch.bfloat16)
    shared = call(x, w1, w2, None, None, vnni=True)
    fused = cpumoe.fused_experts(x, pack(w1[None]), pack(w2[None]), torch.ones(M, 1),
                                 torch.zeros(M, 1, dtype=torch.int32))
    assert torch.equal(shared, fused)


@pytest.mark.parametrize("vnni", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("residual", [True, False], ids=["fused_out", "no_fused_out"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_inplace(isa, dt, residual, vnni):
    """DeepSeek's call: inplace=True on hidden_states with the routed output folded in."""
    dtype = DTYPES[dt]
    M, N, K = 33, 64, 96
    x, w1, w2, fused = make_inputs(M, N, K, dtype)
    fused, factor = (fused, 16.0) if residual else (None, None)
    fused_before = None if fused is None else fused.clone()
    ref = reference.shared_expert(x, w1, w2, fused, factor)
    expected = call(x.clone(), w1, w2, fused, factor, vnni=vnni)
    out = call(x, w1, w2, fused, factor, vnni=vnni, inplace=True)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(x, expected)
    assert_moe_close(x, ref)
    if fused is not None:
        assert torch.equal(fused, fused_before), "fused_experts_out was modified"


def test_residual_scale_values(isa):
    """Other factors (1.0, 0.0, -2.5) and a zero fused_experts_out."""
    M, N, K = 9, 32, 64
    x, w1, w2, fused = make_inputs(M, N, K, torch.bfloat16)
    base = call(x, w1, w2, None, None, vnni=True)
    assert torch.equal(call(x, w1, w2, torch.zeros_like(x), 16.0, vnni=True), base)
    assert torch.equal(call(x, w1, w2, fused, 0.0, vnni=True), base)
    for factor in (1.0, -2.5):
        out = call(x, w1, w2, fused, factor, vnni=True)
        assert_moe_close(out, reference.shared_expert(x, w1, w2, fused, factor))


def test_empty_batch():
    N, K = 32, 64
    x = torch.empty(0, K, dtype=torch.float16)
    _, w1, w2, _ = make_inputs(1, N, K, torch.float16)
    out = call(x, w1, w2, torch.empty(0, K, dtype=torch.float16), 16.0, vnni=True)
    assert out.shape == (0, K) and out.dtype == torch.float16


@needs_two_tiers
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_tiers_bit_identical(dt):
    """Every tier equals the first tier of its numerics class bit for bit, and that one
    the worst tier within CROSS_CLASS_TOLERANCE."""
    dtype = DTYPES[dt]
    M, N, K = 29, 96, 160
    x, w1, w2, fused = make_inputs(M, N, K, dtype)
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = call(x, w1, w2, fused, 16.0, vnni=True)
    first = assert_tiers_agree(outs, MoeCompMethod.UNQUANT)
    assert_moe_close(first, reference.shared_expert(x, w1, w2, fused, 16.0))


def test_thread_count_independent(isa):
    M, N, K = 121, 96, 160
    x, w1, w2, fused = make_inputs(M, N, K, torch.bfloat16)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(call(x, w1, w2, fused, 16.0, vnni=True))
    assert torch.equal(outs[0], outs[1])


def test_sglang_case():
    """SGLang's test_shared_expert bf16 data: hidden=randn/k, w1, w2 = randn (unscaled),
    is_vnni=False, inplace on a clone, factor 16; tolerance 1e-2 as there."""
    for m, n, k in [(2, 32, 32), (121, 128, 64)]:
        hidden = torch.randn(m, k, dtype=torch.bfloat16) / k
        w1 = torch.randn(2 * n, k, dtype=torch.bfloat16)
        w2 = torch.randn(k, n, dtype=torch.bfloat16)
        fused = torch.randn(m, k, dtype=torch.bfloat16)
        ref = reference.shared_expert(hidden, w1, w2, fused, 16.0)
        h = hidden.clone()
        out = torch.ops.cpumoe.shared_expert_cpu(h, w1, w2, fused, 16.0, True, False, False,
                                                 None, None, None, False)
        assert out.data_ptr() == h.data_ptr()
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
