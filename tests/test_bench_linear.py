"""python -m cpumoe bench linear (cpumoe.bench.linear): it runs every scheme and peer on a
tiny shape in a child process (vLLM's library, when it loads, registers torch.ops._C there,
not in the test process), prints a row per (shape, scheme, M) and writes the JSON; cpumoe's
output agrees with reference.py and each peer either agrees with it within its tolerance
and is timed, or is skipped with its reason. Timings are not checked."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from cpumoe.bench import linear
from cpumoe_testing import subprocess_env


# capped to avx2 (--peer-isa), vLLM's loader picks its AVX2 build, which has no linear ops
@pytest.mark.parametrize("dtype, peer_isa", [("bf16", None), ("fp16", None), ("bf16", "avx2")])
def test_bench_linear_runs(tmp_path, dtype, peer_isa):
    out = tmp_path / "linear.json"
    cmd = [sys.executable, "-m", "cpumoe", "bench", "linear", "--shape", "custom:128,96",
           "--scheme", "all", "--m", "1,33", "--min-time", "0.01", "--copies", "2",
           "--bw-mib", "64", "--threads", "2", "--dtype", dtype, "--json", str(out)]
    cmd += ["--peer-isa", peer_isa] if peer_isa else []
    res = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(),
                         timeout=600)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["scheme"], r["M"]) for r in rows] == [
        (s, m) for s in linear.LINEAR_SCHEMES for m in (1, 33)]
    assert set(doc["peers"]) == set(linear.PEERS)
    assert doc["peer_isa"] == peer_isa
    for r in rows:
        assert r["ms"] > 0 and r["percent_read_bandwidth"] > 0 and r["percent_peak"] > 0
        assert r["rel_diff_vs_reference"] <= (0 if r["scheme"] in ("int8", "int4") else 1e-2)
        assert r["shape"] in res.stdout
        for key, p in r["peers"].items():
            if "ms" in p:
                assert p["rel_diff"] <= linear.PEERS[key].tolerance(r["scheme"])
                assert p["speedup"] == pytest.approx(p["ms"] / r["ms"])
            else:
                assert "disagrees" not in p, (key, r["scheme"], p)
                assert p["skipped"]
    end = doc["limits_end"]  # the limits again after the rows, and how far they moved
    assert end["read_gbps"] > 0 and set(end["peaks"]) == set(doc["limits"]["peaks"])
    assert "streaming read at the end: " in res.stdout
    for kind in doc["limits"]["peaks"]:
        assert f"{kind} peak at the end: " in res.stdout
    timed = {k for r in rows for k, p in r["peers"].items() if "ms" in p}
    assert "eager" in timed
    if peer_isa:
        assert "vllm" not in timed
    assert "WARNING" not in res.stdout


def test_bench_linear_help_and_shapes():
    assert linear.parse_shapes("all") == linear.SHAPES
    assert linear.parse_shapes("custom:64,96+qwen3-30b-a3b-o") == {
        "custom:64,96": (64, 96), "qwen3-30b-a3b-o": (4096, 2048)}
    for bad in ("custom:64", "custom:48,96", "nope", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            linear.parse_shapes(bad)
    with pytest.raises(SystemExit):
        linear.build_parser().parse_args(["--peers", "nope"])
    assert linear.build_parser().parse_args(["--peers", "none"]).peers == []


def test_int4pack_peer_agrees_with_reference():
    """torch's int4 matmul on the scale/zero form the bench makes of the same weights."""
    if linear.int4pack_unavailable(torch.bfloat16):
        pytest.skip(linear.int4pack_unavailable(torch.bfloat16))
    w = linear.make_weights("int4", torch.bfloat16, 256, 64, 1, seed=1)
    x = torch.randn(3, 256).to(torch.bfloat16)
    got = linear.PEERS["int4pack"].make(w, 1)(x, 0)
    assert linear._rel_diff(got, w.ref(x)) <= 0.08
