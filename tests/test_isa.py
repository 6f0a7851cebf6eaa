"""ISA tier selection: cpumoe.isa()/set_isa()/best_isa()/built_isas()/isa_reason() and the
CPUMOE_ISA environment variable (read once at load, so tested in subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cpumoe
import cpumoe_testing
from cpumoe_testing import (
    BEST_ISA,
    BUILT_ISAS,
    SUPPORTED_ISAS,
    subprocess_env,
    tier_supported,
    use_isa,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = "import cpumoe; print(cpumoe.isa()); print(cpumoe.isa_reason())"


def run_with_env(value):
    env = subprocess_env()
    if value is not None:
        env["CPUMOE_ISA"] = value
    return subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def test_built_isas_and_best():
    assert BUILT_ISAS[0] == "scalar"
    assert set(BUILT_ISAS) >= {"scalar", "avx2", "avx512"}
    assert BEST_ISA in BUILT_ISAS
    feats = set(cpumoe.cpu_features())
    # the avx2 tier's requirements (docs/ARCHITECTURE.md, tier in the file name)
    if {"avx2", "fma", "f16c"} <= feats:
        assert "avx2" in SUPPORTED_ISAS
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"} <= feats:
        assert "avx512" in SUPPORTED_ISAS
    if {"avx2", "fma", "f16c", "avx-vnni"} <= feats:
        assert "avx2vnni" in SUPPORTED_ISAS
    if "avx2" not in feats:
        assert BEST_ISA == "scalar"


def test_skip_reason_names_the_tier_and_why(monkeypatch):
    """A test that needs a tier this CPU cannot run skips, and the reason names that tier,
    the CPU's best tier and the features cpuid found (here on a pretend CPU whose best
    tier is the worst built one)."""
    if len(BUILT_ISAS) < 2:
        pytest.skip(f"this build has only the {BUILT_ISAS[0]} tier")
    monkeypatch.setattr(cpumoe_testing, "BEST_ISA", BUILT_ISAS[0])
    monkeypatch.setattr(cpumoe_testing, "_CPU_ISAS", BUILT_ISAS[:1])
    top = BUILT_ISAS[-1]
    assert not cpumoe_testing.tier_supported(top)
    with pytest.raises(pytest.skip.Exception) as skipped:
        cpumoe_testing.skip_unless_supported(top)
    reason = str(skipped.value)
    assert f"cannot run the {top} tier" in reason, reason
    assert f"best tier is {BUILT_ISAS[0]}" in reason, reason
    assert "CPU features found:" in reason, reason
    [param] = cpumoe_testing.isa_params([top])
    assert [m.kwargs["reason"] for m in param.marks] == [cpumoe_testing.unsupported_reason(top)]


def test_set_isa_roundtrip():
    start = cpumoe.isa()
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            assert cpumoe.isa() == tier
            assert tier in cpumoe.isa_reason()
    assert cpumoe.isa() == start


def test_set_isa_above_best_falls_back():
    above = [t for t in BUILT_ISAS if t not in SUPPORTED_ISAS]
    if not above:
        pytest.skip(f"this CPU runs every built tier ({BUILT_ISAS})")
    start = cpumoe.isa()
    try:
        cpumoe.set_isa(above[-1])
        assert cpumoe.isa() == BEST_ISA
        assert "cannot run" in cpumoe.isa_reason()
    finally:
        cpumoe.set_isa(start)


def test_set_isa_falls_back_to_nearest_ancestor():
    """A cap at a tier this CPU cannot run takes its nearest ancestor that runs: avx2vnni's
    is avx2 (on a CPU with AVX-512 but no AVX-VNNI, not the better avx512)."""
    if "avx2vnni" not in BUILT_ISAS or tier_supported("avx2vnni") or not tier_supported("avx2"):
        pytest.skip("needs a CPU with AVX2 but without AVX-VNNI")
    start = cpumoe.isa()
    try:
        cpumoe.set_isa("avx2vnni")
        assert cpumoe.isa() == "avx2"
        assert "cannot run" in cpumoe.isa_reason()
    finally:
        cpumoe.set_isa(start)


def test_supported_isas():
    """supported_isas() is the built tiers the CPU runs, in rank order, the best last."""
    supported = cpumoe.supported_isas()
    assert supported == [t for t in BUILT_ISAS if t in supported]
    assert supported[-1] == BEST_ISA and supported[0] == "scalar"
    for tier in supported:
        with use_isa(tier):
            assert cpumoe.isa() == tier


def test_set_isa_unknown_name_raises():
    start = cpumoe.isa()
    with pytest.raises(RuntimeError, match=r"unknown tier 'avx9000'"):
        cpumoe.set_isa("avx9000")
    assert cpumoe.isa() == start


def test_env_var_caps_tier():
    """CPUMOE_ISA=<tier> caps the tier at load; an unknown name is ignored and the
    reason says so; unset gives the best tier."""
    values = {None: BEST_ISA, "bogus": BEST_ISA}
    for tier in BUILT_ISAS:
        values[tier] = tier if tier in SUPPORTED_ISAS else BEST_ISA
    procs = {v: run_with_env(v) for v in values}  # in parallel: each imports torch
    for value, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (value, err)
        active, reason = out.strip().splitlines()
        assert active == values[value], (value, out)
        if value == "bogus":
            assert "CPUMOE_ISA=bogus" in reason and "ignored" in reason, reason
        elif value is not None and value != BEST_ISA and value in SUPPORTED_ISAS:
            assert "capped by CPUMOE_ISA=" + value in reason, reason
