"""Smoke tests of the benchmark (cpumoe.bench, ``python -m cpumoe bench`` / ``info``): a tiny
custom shape with the bf16 and int8 schemes, with and without the in-process baselines
and with the capped-ISA baseline subprocess; checks the JSON document and the table.
Fast: the limit probes are shortened (the figures are not judged, only their sanity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import cpumoe
from cpumoe import bench
from cpumoe_testing import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(REPO, "python")
SHAPE = "custom:8,2,256,128"
ARGS = ["--shape", SHAPE, "--scheme", "bf16,int8", "--m", "1,4", "--iters", "2",
        "--bw-mib", "64", "--threads", "1"]  # 1 thread: insensitive to other load


@pytest.fixture
def fast_limits(monkeypatch):
    """Shorter FMA / u8*s8 peak probes (0.05 s x 2 runs instead of 0.3 s x 3)."""
    fma, i8 = bench._fma_peak_samples, bench._int8_peak_samples
    monkeypatch.setattr(bench, "_fma_peak_samples", lambda: fma(0.05, 2))
    monkeypatch.setattr(bench, "_int8_peak_samples", lambda: i8(0.05, 2))


def _run(tmp_path, extra):
    path = tmp_path / "bench.json"
    assert bench.main(ARGS + extra + ["--json", str(path)]) == 0
    return json.loads(path.read_text())


def _fraction(v):
    return v is not None and 0 < v < 2


def _check_common(doc):
    m = doc["machine"]
    assert m["read_gbps"] > 0 and m["fma_peak_gflops"] > 0 and m["int8_peak_gops"] > 0
    assert m["tier"] == cpumoe.isa()
    assert doc["settings"]["schemes"] == ["bf16", "int8"]
    cases = doc["cases"]
    assert [(c["scheme"], c["M"]) for c in cases] == [("bf16", 1), ("bf16", 4), ("int8", 1),
                                                      ("int8", 4)]
    for c in cases:
        assert c["dtype"] == "bf16" and c["shape"] == "custom-8x2-256x128"
        assert c["ms"] > 0 and 0 < c["ms_min"] <= c["ms"] and c["iters"] == 2
        assert 1 <= c["distinct_experts"] <= min(8, 2 * c["M"])
        assert c["flops"] == 2.0 * c["M"] * 2 * 3 * 128 * 256
        bpw = 1 if c["scheme"] == "int8" else 2
        per_expert = 3 * 128 * 256 * bpw + (8 * (2 * 128 + 256) if bpw == 1 else 0)
        assert c["weight_bytes"] == pytest.approx(c["distinct_experts"] * per_expert)
        assert c["peak_kind"] == ("u8s8" if c["scheme"] == "int8" else "fp32_fma")
        # this tiny shape's weights (<= 1.5 MB) stay in cache between calls, so its "bandwidth"
        # may exceed the DRAM streaming rate: only the compute fraction is bounded by 1-ish
        assert _fraction(c["peak_fraction"]), ("peak_fraction", c)
        for key in ("bw_fraction", "bound_fraction"):
            assert c[key] is not None and 0 < c[key] < 10, (key, c)
        assert c["bound"] in ("bandwidth", "compute")
        for key in ("others_cpu_fraction", "baseline_others_cpu_fraction",
                    "int8pack_others_cpu_fraction", "capped_others_cpu_fraction"):
            assert c[key] is None or 0 <= c[key] <= 1, (key, c)
    return cases


def test_bench_json_with_baselines(tmp_path, fast_limits, capsys):
    doc = _run(tmp_path, [])
    cases = _check_common(doc)
    int8pack = doc["settings"]["int8pack_unavailable"] is None
    for c in cases:
        assert c["baseline_ms"] > 0 and c["speedup"] > 0 and c["baseline_iters"] == 2
        assert 0 <= c["rel_diff_vs_baseline"] < 5e-2, c  # int8: W8A8 vs dequantized weights
        if c["scheme"] == "int8" and int8pack:
            assert c["int8pack_ms"] > 0 and c["speedup_int8pack"] > 0
            assert 0 <= c["rel_diff_vs_int8pack"] < 5e-2, c
        else:
            assert c["int8pack_ms"] is None and c["speedup_int8pack"] is None
        assert c["eager_capped_ms"] is None and c["speedup_capped"] is None
    out = capsys.readouterr().out
    assert "u8*s8 peak" in out and "speedup" in out
    assert ("vs int8pack" in out) == int8pack


def test_bench_json_no_baseline_capped_isa(tmp_path, fast_limits, capsys):
    doc = _run(tmp_path, ["--no-baseline", "--baseline-isa", "avx2"])
    cases = _check_common(doc)
    cap = doc["machine"]["capped_baseline"]
    assert cap["isa"] == "avx2" and cap["error"] is None and not cap["case_errors"], cap
    assert doc["settings"]["baseline_isa"] == "avx2"
    for c in cases:
        assert c["baseline_ms"] is None and c["speedup"] is None and c["int8pack_ms"] is None
        assert c["eager_capped_ms"] > 0 and c["speedup_capped"] > 0
        assert 0 <= c["rel_diff_vs_capped"] < 5e-2, c  # same inputs in the subprocess
    out = capsys.readouterr().out
    assert "ONEDNN_MAX_CPU_ISA=avx2" in out and "vs capped" in out


def test_info_cli_prints_tier():
    env = subprocess_env()
    res = subprocess.run([sys.executable, "-m", "cpumoe", "info"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("tier in use"))
    assert line.split()[-1] == cpumoe.best_isa(), res.stdout
