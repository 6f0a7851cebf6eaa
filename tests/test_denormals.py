"""Denormals: where the bf16 dot-product tiers part from fp32-chain (docs/NUMERICS.md).

vdpbf16ps (the avx512bf16 and amx tiers' kernels for blocks of few rows) and tdpbf16ps (amx,
larger blocks) treat
denormal inputs as zero and flush denormal results; the fp32-chain tiers keep them. The
other tests' data make no denormals, so there fp32-chain-daz must give fp32-chain's bits;
here denormals occur:

* among O(1) activations (what a model could feed), every tier stays within the
  cross-class tolerance of the portable tier;
* where a denormal activation meets a huge weight, its product is far from negligible:
  the fp32-chain tiers keep it and the flushing tiers drop it, the one documented
  difference, and nothing else moves;
* the same for MXFP4's denormal weights (scales 0 and 1 decode to bf16 denormals) against a
  huge activation.
"""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import MoeCompMethod
from cpumoe_testing import (
    CROSS_CLASS_TOLERANCE,
    SUPPORTED_ISAS,
    assert_elementwise_close,
    assert_row_close,
    make_fp8_weights,
    make_mxfp4_weights,
    make_routing,
    make_weights,
    needs_two_tiers,
    run_fused,
    run_fused_fp8,
    run_fused_mxfp4,
    use_isa,
)

BF16_DENORMAL_BITS = (0x0001, 0x0040, 0x007F, 0x8001, 0x8055)  # bf16 exponent field 0


def _with_denormals(x: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """x (bf16) with `fraction` of its elements replaced by bf16 denormals."""
    gen = torch.Generator().manual_seed(seed)
    bits = x.view(torch.int16).clone()
    where = torch.rand(x.shape, generator=gen) < fraction
    pick = torch.randint(0, len(BF16_DENORMAL_BITS), x.shape, generator=gen)
    denormals = torch.tensor(BF16_DENORMAL_BITS, dtype=torch.int32)[pick].to(torch.int16)
    bits[where] = denormals[where]
    return bits.view(torch.bfloat16)


def _run(scheme: str, x, weights, tw, ti):
    if scheme == "bf16":
        w1, w2 = weights
        return run_fused(x, w1, w2, tw, ti, is_vnni=True)
    if scheme == "mxfp4":
        return run_fused_mxfp4(x, *weights, tw, ti)
    w1, s1, w2, s2, block = weights
    return run_fused_fp8(x, w1, s1, w2, s2, tw, ti, block, is_vnni=True)


# M = 40 and E = 4 give blocks of more than 8 rows (the amx tier's tile kernels) and, with
# M = 3, blocks of few rows (its vector kernels).
@needs_two_tiers
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("M", [3, 40])
def test_denormal_activations_within_tolerance(scheme, M):
    torch.manual_seed(7)
    E, topk, N, K = 4, 2, 64, 128
    x = _with_denormals(torch.randn(M, K).to(torch.bfloat16), 0.3, seed=M)
    tw, ti = make_routing(M, E, topk)
    if scheme == "bf16":
        weights = make_weights(E, N, K, torch.bfloat16)
        method = MoeCompMethod.UNQUANT
    elif scheme == "mxfp4":
        weights = make_mxfp4_weights(E, N, K)
        method = MoeCompMethod.MXFP4
    else:
        block = (32, 64)
        weights = (*make_fp8_weights(E, N, K, block), block)
        method = MoeCompMethod.FP8_W8A16
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = _run(scheme, x, weights, tw, ti)
    first = SUPPORTED_ISAS[0]
    for tier, out in outs.items():
        assert torch.isfinite(out.float()).all(), tier
        where = f"({tier} vs {first}, denormal activations)"
        if method == MoeCompMethod.UNQUANT:
            assert_elementwise_close(out, outs[first], CROSS_CLASS_TOLERANCE[method], where)
        else:
            assert_row_close(out, outs[first], CROSS_CLASS_TOLERANCE[method], where,
                             max_mismatch=None)


# Which calls flush: the kernels that take a block decide. fp32-chain-daz (avx512bf16) runs
# vdpbf16ps on blocks of up to 2 rows only (FMA kernels on larger ones: vdpbf16ps is half
# their rate there); amx-bf16 runs vdpbf16ps on those and tdpbf16ps on larger ones.
FLUSHES = {("fp32-chain-daz", 1): True, ("fp32-chain-daz", 40): False,
           ("amx-bf16", 1): True, ("amx-bf16", 40): True}


@pytest.mark.parametrize("M", [1, 40])
def test_flushing_is_the_difference(M):
    """Activation column 0 holds the denormal 2^-130 in every row, and w1's column 0 holds
    2^120 for every output (every other weight of w1 small): the product 2^-10 is the only
    sizeable term of each gate/up value. Tiers that keep denormals see it; where a tier
    flushes, its output equals that of the same call with column 0 zeroed. E = 2, topk = 1:
    M = 1 makes one block of one row, M = 40 blocks of about 20."""
    E, topk, N, K = 2, 1, 32, 64
    torch.manual_seed(3)
    x = torch.randn(M, K).to(torch.bfloat16) * 2.0 ** -20
    x[:, 0] = 2.0 ** -130  # a bf16 denormal
    x_flushed = x.clone()
    x_flushed[:, 0] = 0.0
    w1, w2 = make_weights(E, N, K, torch.bfloat16)
    w1[:, :, 0] = 2.0 ** 120
    tw, ti = make_routing(M, E, topk)
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            out = run_fused(x, w1, w2, tw, ti, is_vnni=True)
            flushed = run_fused(x_flushed, w1, w2, tw, ti, is_vnni=True)
        cls = cpumoe.numerics_class(tier)
        if FLUSHES.get((cls, M), False):
            assert torch.equal(out, flushed), f"{tier} ({cls}) kept a denormal activation"
        else:
            assert not torch.equal(out, flushed), f"{tier} ({cls}) dropped a denormal"
            assert out.float().abs().max() > 100 * flushed.float().abs().max(), tier


@pytest.mark.parametrize("M", [1, 40])
def test_flushing_of_mxfp4_denormal_weights(M):
    """MXFP4 weights of scales 0 and 1 are bf16 denormals: w1's k = 0 holds code 1 with scale
    0 (2^-128) in every row, the rest of that group zero codes, and activation column 0 is
    2^118: the product 2^-10 is the only sizeable term of each gate/up value beside the tiny
    rest. Where a tier flushes (the same calls as for bf16 weights: FLUSHES; MXFP4 on amx
    runs every block on the tile unit), the output equals that of the same call with that
    code zeroed; elsewhere the denormal weight counts."""
    E, topk, N, K = 2, 1, 32, 64
    torch.manual_seed(5)
    c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
    s1[:, :, 0] = 0
    c1[:, :, :16] = 0
    c1[:, :, 0] = 0x01  # k = 0: code 1 (0.5 * 2^-127), k = 1: code 0
    c1_flushed = c1.clone()
    c1_flushed[:, :, 0] = 0
    x = torch.randn(M, K).to(torch.bfloat16) * 2.0 ** -20
    x[:, 0] = 2.0 ** 118
    tw, ti = make_routing(M, E, topk)
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            out = run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti)
            flushed = run_fused_mxfp4(x, c1_flushed, s1, c2, s2, tw, ti)
        cls = cpumoe.numerics_class(tier)
        if FLUSHES.get((cls, M), False):
            assert torch.equal(out, flushed), f"{tier} ({cls}) kept a denormal weight"
        else:
            assert not torch.equal(out, flushed), f"{tier} ({cls}) dropped a denormal weight"
            assert out.float().abs().max() > 100 * flushed.float().abs().max(), tier
