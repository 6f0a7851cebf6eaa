"""Numerics classes: cpumoe.numerics_class names each tier's class, and the tests' one
comparison of tiers (cpumoe_testing.assert_tiers_agree / assert_matches_exact) holds tiers
of one class to bit-identity and tiers of different classes to CROSS_CLASS_TOLERANCE.

Every tier built today is of one class, so the cross-class path runs here only on fake
class maps (cpumoe.numerics_class monkeypatched): both paths must pass what they should
and fail on a mismatch."""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import MoeCompMethod
from cpumoe_testing import (
    BUILT_ISAS,
    CROSS_CLASS_TOLERANCE,
    assert_matches_exact,
    assert_tiers_agree,
    use_isa,
)
from exact_reference import EXACT_NUMERICS_CLASS


def test_every_built_tier_has_a_class():
    for tier in BUILT_ISAS:
        assert cpumoe.numerics_class(tier), tier
    with pytest.raises(RuntimeError, match="unknown tier"):
        cpumoe.numerics_class("no-such-tier")


def test_exact_reference_models_the_worst_tiers_class():
    """exact_reference.py repeats the class of the portable tier, the one every CPU runs."""
    assert cpumoe.numerics_class(BUILT_ISAS[0]) == EXACT_NUMERICS_CLASS


def test_every_scheme_has_a_cross_class_tolerance():
    assert set(CROSS_CLASS_TOLERANCE) == set(MoeCompMethod)
    for scheme, table in CROSS_CLASS_TOLERANCE.items():
        assert set(table) == {torch.bfloat16, torch.float16}, scheme


@pytest.fixture
def fake_classes(monkeypatch):
    """Replaces cpumoe.numerics_class with a lookup in the dict this fixture returns."""
    classes: dict = {}
    monkeypatch.setattr(cpumoe, "numerics_class", lambda tier: classes[tier])
    return classes


def _output(dtype=torch.bfloat16) -> torch.Tensor:
    """A [4, 64] output with values of both signs and magnitude ~1."""
    return (torch.randn(4, 64) + torch.sign(torch.randn(4, 64))).to(dtype)


def _next_up(t: torch.Tensor) -> torch.Tensor:
    """t with its first element moved one ulp of t's dtype away from zero (the smallest
    change, which only bit-identity catches)."""
    out = t.clone()
    bits = out.view(torch.int16)
    bits.view(-1)[0] += 1
    assert not torch.equal(out, t)
    return out


SCHEMES = [MoeCompMethod.UNQUANT, MoeCompMethod.INT8_W8A8, MoeCompMethod.FP8_W8A16,
           MoeCompMethod.INT4_W4A8, MoeCompMethod.MXFP4]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_class_demands_bit_identity(fake_classes, scheme, dt):
    fake_classes.update(t0="chain", t1="chain", t2="chain")
    out = _output(dt)
    assert assert_tiers_agree({"t0": out, "t1": out.clone(), "t2": out.clone()},
                              scheme) is not None
    with pytest.raises(AssertionError, match="1 of 256 elements differ"):
        assert_tiers_agree({"t0": out, "t1": out.clone(), "t2": _next_up(out)}, scheme)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_classes_differ_within_tolerance(fake_classes, scheme, dt):
    """Across classes one ulp passes, 10% fails; within the second class bit-identity
    still holds (t3 against t2, both of class "other", though t3 is close to t0)."""
    fake_classes.update(t0="chain", t1="chain", t2="other", t3="other")
    out = _output(dt)
    ulp = _next_up(out)
    first = assert_tiers_agree({"t0": out, "t1": out.clone(), "t2": ulp, "t3": ulp.clone()},
                               scheme)
    assert first is out  # the worst tier's output, which the tests compare with references
    off = out.clone()
    off[1] = (off[1].float() * 1.1).to(dt)
    with pytest.raises(AssertionError):
        assert_tiers_agree({"t0": out, "t1": out.clone(), "t2": off, "t3": off.clone()},
                           scheme)
    with pytest.raises(AssertionError, match="both of numerics class other"):
        assert_tiers_agree({"t0": out, "t1": out.clone(), "t2": ulp, "t3": out.clone()},
                           scheme)


def test_a_class_must_agree_with_itself_after_another(fake_classes):
    """Tiers of one class are compared with each other even when a tier of another class
    sits between them in the list."""
    fake_classes.update(t0="chain", t1="other", t2="chain")
    out = _output()
    with pytest.raises(AssertionError, match="t2 vs t0"):
        assert_tiers_agree({"t0": out, "t1": out.clone(), "t2": _next_up(out)},
                           MoeCompMethod.UNQUANT)


def test_exact_model_comparison_follows_the_active_tiers_class(fake_classes):
    """assert_matches_exact is bit for bit on a tier of EXACT_NUMERICS_CLASS and within
    tolerance on a tier of another class."""
    tier = BUILT_ISAS[0]
    out = _output()
    ulp = _next_up(out)
    with use_isa(tier):
        fake_classes[tier] = EXACT_NUMERICS_CLASS
        assert_matches_exact(out, out.clone(), MoeCompMethod.INT8_W8A8)
        with pytest.raises(AssertionError, match="1 of 256 elements differ"):
            assert_matches_exact(ulp, out, MoeCompMethod.INT8_W8A8)
        fake_classes[tier] = "other"
        assert_matches_exact(ulp, out, MoeCompMethod.INT8_W8A8)
        with pytest.raises(AssertionError):
            assert_matches_exact(out * 2, out, MoeCompMethod.INT8_W8A8)
