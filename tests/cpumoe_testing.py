"""Helpers shared by the cpumoe tests (imported as ``from cpumoe_testing import ...``;
the fixtures live in conftest.py).

* ``use_isa`` / ``isa_params``: run on a given ISA tier; tiers above
  ``cpumoe.best_isa()`` are skipped with a reason.
* ``make_routing`` / ``make_weights`` / ``make_hidden``: inputs like SGLang's tests
  (softmax scores + topk), scaled so that every intermediate and the output are O(1).
* ``TOL`` / ``assert_moe_close``: tolerance per activation dtype against the fp32-math
  reference (reasoning below).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import cpumoe

BUILT_ISAS = cpumoe.built_isas()  # worst first
BEST_ISA = cpumoe.best_isa()


def tier_supported(tier: str) -> bool:
    """True when this CPU can run `tier` (tiers are ordered, worst first)."""
    return BUILT_ISAS.index(tier) <= BUILT_ISAS.index(BEST_ISA)


SUPPORTED_ISAS = [t for t in BUILT_ISAS if tier_supported(t)]


def skip_unless_supported(tier: str) -> None:
    if not tier_supported(tier):
        pytest.skip(f"CPU cannot run the {tier} tier (best supported: {BEST_ISA}; "
                    f"{cpumoe.isa_reason()})")


@contextlib.contextmanager
def use_isa(tier: str):
    """Runs the block on `tier`, then restores the previous tier."""
    prev = cpumoe.isa()
    cpumoe.set_isa(tier)
    try:
        assert cpumoe.isa() == tier, (tier, cpumoe.isa_reason())
        yield tier
    finally:
        cpumoe.set_isa(prev)


def isa_params(tiers=None):
    """pytest params over `tiers` (default: every built tier); unsupported ones are skipped."""
    tiers = BUILT_ISAS if tiers is None else tiers
    return [
        pytest.param(t, id=t, marks=() if tier_supported(t) else pytest.mark.skip(
            reason=f"CPU cannot run the {t} tier (best supported: {BEST_ISA})"))
        for t in tiers
    ]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Tolerances of the op against reference.py (atol = rtol, as in SGLang's tests).
# Both sides compute in fp32 from the same 16-bit inputs, and a product of two 16-bit
# values is exact in fp32. What differs:
#   * summation order inside the fp32 dot products (relative error ~ sqrt(K) * 2^-24,
#     i.e. ~1e-6 for K = 512) and the fp32 exp() inside silu/sigmoid (a few fp32 ulp);
#   * those tiny differences can flip the rounding of an intermediate activation to the
#     neighbouring 16-bit value; each flip moves the output by about w2 * ulp16(a),
#     i.e. ~2^-8 / sqrt(N) relative for bf16: far below the output ulp;
#   * the final rounding to 16 bits can then land on the neighbouring value: at most one
#     output ulp, i.e. <= 2^-7 |v| (0.78%) for bf16 and <= 2^-10 |v| (0.1%) for fp16.
# So atol = rtol = 1e-2 (bf16) and 2e-3 (fp16) allow one output ulp at every magnitude
# (atol covers values near zero) and nothing like a real error (a wrong expert, a dropped
# bias, a swapped gate/up, a missing slot all move outputs by O(10%) or more).
TOL = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_moe_close(out: torch.Tensor, ref: torch.Tensor, msg: str = "") -> None:
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), f"non-finite output {msg}"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[ref.dtype], msg=lambda m: f"{msg}\n{m}")


def make_routing(M: int, E: int, topk: int, *, renormalize: bool = False,
                 ids_dtype: torch.dtype = torch.int32,
                 weights_dtype: torch.dtype = torch.float32,
                 drop_prob: float = 0.0):
    """SGLang's make_routing: softmax scores, topk, optional renormalization.
    drop_prob turns that fraction of slots into -1 ("expert on another rank")."""
    scores = torch.softmax(torch.randn(M, E), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(scores, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if drop_prob > 0:
        ids[torch.rand(M, topk) < drop_prob] = -1
    return weights.to(weights_dtype), ids.to(ids_dtype)


def make_hidden(M: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(M, K).to(dtype)


def make_weights(E: int, N: int, K: int, dtype: torch.dtype):
    """Unpacked w1 [E, 2N, K], w2 [E, K, N], scaled by 1/sqrt(fan-in) so that with
    x ~ N(0, 1) the gate/up values are ~N(0, 1) and the outputs O(1)."""
    w1 = (torch.randn(E, 2 * N, K) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, K, N) / N ** 0.5).to(dtype)
    return w1, w2


def make_bias(E: int, N: int, K: int):
    """fp32 biases [E, 2N] and [E, K], large enough that dropping one is visible."""
    return torch.randn(E, 2 * N) * 0.5, torch.randn(E, K) * 0.5


def pack(w: torch.Tensor) -> torch.Tensor:
    return cpumoe.convert_weight_packed(w)


def run_fused(x, w1, w2, tw, ti, *, is_vnni: bool, **kw) -> torch.Tensor:
    """Calls the op with unpacked weights w1/w2: packs them first when is_vnni, else
    lets the op pack them per call."""
    if is_vnni:
        return cpumoe.fused_experts(x, pack(w1), pack(w2), tw, ti, is_vnni=True, **kw)
    return cpumoe.fused_experts(x, w1, w2, tw, ti, is_vnni=False, **kw)
