"""Smoke tests of the benchmark (cpumoe.bench, ``python -m cpumoe bench`` / ``info``): a tiny
custom shape with the bf16 and int8 schemes, with and without the in-process baselines,
with the capped-ISA baseline subprocess and with thread scaling; checks the JSON document,
the table, the presets and shapes, the int4 pieces and the roofline picture.
Fast: the limit probes are shortened (the figures are not judged, only their sanity)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import types

import pytest
import torch

import cpumoe
from cpumoe import bench
from cpumoe.bench import machine as bench_machine
from cpumoe.bench import timing as bench_timing
from cpumoe_testing import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(REPO, "python")
SHAPE = "custom:8,2,256,128"
ARGS = ["--shape", SHAPE, "--scheme", "bf16,int8", "--m", "1,4", "--iters", "2",
        "--bw-mib", "64", "--threads", "1"]  # 1 thread: insensitive to other load


@pytest.fixture(autouse=True)
def keep_threads():
    """main() calls torch.set_num_threads: give the next test torch's count back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fast_limits(monkeypatch):
    """Shorter FMA / u8*s8 / bf16 / u4*s8 peak probes (0.05 s x 2 runs instead of 0.3 s x 3)."""
    fma, i8 = bench_machine._fma_peak_samples, bench_machine._int8_peak_samples
    bf, i4 = bench_machine._bf16_peak_samples, bench_machine._int4_peak_samples
    monkeypatch.setattr(bench_machine, "_int4_peak_samples", lambda: i4(0.05, 2))
    monkeypatch.setattr(bench_machine, "_fma_peak_samples", lambda: fma(0.05, 2))
    monkeypatch.setattr(bench_machine, "_int8_peak_samples", lambda: i8(0.05, 2))
    monkeypatch.setattr(bench_machine, "_bf16_peak_samples", lambda: bf(0.05, 2))


def _perf_tables():
    """benchmarks/perf_tables.py, imported from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "perf_tables", os.path.join(REPO, "benchmarks", "perf_tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, extra):
    path = tmp_path / "bench.json"
    assert bench.main(ARGS + extra + ["--json", str(path)]) == 0
    return json.loads(path.read_text())


def _fraction(v):
    return v is not None and 0 < v < 2


def _check_bound(c, read_gbps, fma_gflops, int8_gops, bf16_gops):
    """The row's bound is the larger of bytes / bandwidth and ops / the row's peak."""
    peak = {"u8s8": int8_gops, "bf16": bf16_gops, "fp32_fma": fma_gflops}[c["peak_kind"]]
    t_bw, t_ops = c["weight_bytes"] / read_gbps / 1e6, c["flops"] / peak / 1e6  # ms
    assert c["bound_ms"] == pytest.approx(max(t_bw, t_ops)), c
    assert c["bound"] == ("bandwidth" if t_bw >= t_ops else "compute"), c
    assert c["bound_fraction"] == pytest.approx(c["bound_ms"] / c["ms"]), c


def _check_common(doc):
    m = doc["machine"]
    assert m["read_gbps"] > 0 and m["fma_peak_gflops"] > 0 and m["int8_peak_gops"] > 0
    assert m["bf16_peak_gops"] > 0 and m["bf16_statistic"] == "best of runs"  # bf16 rows
    assert m["bf16_peak_gops"] == max(m["bf16_samples_gops"])
    assert m["tier"] == cpumoe.isa()
    assert [lim["threads"] for lim in m["limits_by_threads"]] == [1]
    assert m["limits_by_threads"][0]["read_gbps"] == m["read_gbps"]
    assert m["limits_by_threads"][0]["bf16_peak_gops"] == m["bf16_peak_gops"]
    assert m["limits_by_threads"][0]["bf16_samples_gops"] == m["bf16_samples_gops"]
    # the peaks again after the rows, as the bandwidth
    assert m["fma_peak_gflops_end"] == max(m["fma_samples_gflops_end"]) > 0
    assert m["int8_peak_gops_end"] == max(m["int8_samples_gops_end"]) > 0
    assert m["bf16_peak_gops_end"] == max(m["bf16_samples_gops_end"]) > 0
    assert doc["settings"]["schemes"] == ["bf16", "int8"]
    assert doc["settings"]["threads"] == [1] and doc["settings"]["quick"] is False
    cases = doc["cases"]
    assert [(c["scheme"], c["M"]) for c in cases] == [("bf16", 1), ("bf16", 4), ("int8", 1),
                                                      ("int8", 4)]
    for c in cases:
        assert c["dtype"] == "bf16" and c["shape"] == "custom-8x2-256x128"
        assert c["threads"] == 1 and c["tier"] == cpumoe.isa() and c["thread_scaling"] == []
        assert c["moe_comp_method"] == {"bf16": 0, "int8": 1}[c["scheme"]]
        _check_bound(c, m["read_gbps"], m["fma_peak_gflops"], m["int8_peak_gops"],
                     m["bf16_peak_gops"])
        assert c["ms"] > 0 and 0 < c["ms_min"] <= c["ms"] and c["iters"] == 2
        assert 1 <= c["distinct_experts"] <= min(8, 2 * c["M"])
        assert 1 <= c["weight_layers"] <= bench.MAX_WEIGHT_LAYERS
        assert c["flops"] == 2.0 * c["M"] * 2 * 3 * 128 * 256
        bpw = 1 if c["scheme"] == "int8" else 2
        per_expert = 3 * 128 * 256 * bpw + (8 * (2 * 128 + 256) if bpw == 1 else 0)
        assert c["weight_bytes"] == pytest.approx(c["distinct_experts"] * per_expert)
        assert c["peak_kind"] == ("u8s8" if c["scheme"] == "int8" else "bf16")
        # this tiny shape's weights (<= 1.5 MB) stay in cache between calls, so its "bandwidth"
        # may exceed the DRAM streaming rate: only the compute fraction is bounded by 1-ish
        assert _fraction(c["peak_fraction"]), ("peak_fraction", c)
        for key in ("bw_fraction", "bound_fraction"):
            assert c[key] is not None and 0 < c[key] < 10, (key, c)
        assert c["bound"] in ("bandwidth", "compute")
        for key in ("others_cpu_fraction", "baseline_others_cpu_fraction",
                    "int8pack_others_cpu_fraction", "int4pack_others_cpu_fraction",
                    "capped_others_cpu_fraction"):
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
        assert c["int4pack_ms"] is None and c["speedup_int4pack"] is None
    out = capsys.readouterr().out
    assert "u8*s8 peak" in out and "bound ms" in out
    tier = cpumoe.isa()
    bf16_line = next(ln for ln in out.splitlines() if ln.startswith("bf16 peak:"))
    assert f", {bench_machine.peak_loop('bf16', tier)}; median " in bf16_line
    assert bf16_line.endswith("; bound of bf16 rows"), bf16_line
    i8_line = next(ln for ln in out.splitlines() if ln.startswith("u8*s8 peak:"))
    assert f", {bench_machine.peak_loop('u8s8', tier)}; median " in i8_line
    assert i8_line.endswith("; bound of int8 rows"), i8_line
    fma_line = next(ln for ln in out.splitlines() if ln.startswith("fp32 FMA peak:"))
    assert "bound of" not in fma_line  # no fp32-FMA row in this run
    for what in ("streaming read", "fp32 FMA peak", "u8*s8 peak", "bf16 peak"):
        assert sum(ln.startswith(f"{what} at the end: ") for ln in out.splitlines()) == 1, what
    # the header says what each ratio column compares against
    assert "vs eager = the eager per-expert PyTorch loop" in out
    assert ("vs int8pack = a per-expert loop over torch._weight_int8pack_mm" in out) == int8pack


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


def test_bench_thread_scaling(tmp_path, fast_limits, capsys):
    path = tmp_path / "scaling.json"
    args = ["--shape", SHAPE, "--scheme", "bf16", "--m", "4", "--iters", "2", "--bw-mib", "64",
            "--threads", "1,2", "--no-baseline", "--json", str(path)]
    assert bench.main(args) == 0
    doc = json.loads(path.read_text())
    m = doc["machine"]
    assert doc["settings"]["threads"] == [2, 1]  # rows at the largest count
    assert [lim["threads"] for lim in m["limits_by_threads"]] == [2, 1]
    lim1 = m["limits_by_threads"][1]
    (c,) = doc["cases"]
    assert c["threads"] == 2
    (s,) = c["thread_scaling"]
    assert s["threads"] == 1 and s["iters"] == 2 and s["ms"] > 0
    assert s["scaling"] == pytest.approx(s["ms"] / c["ms"])
    assert s["identical_output"] is True  # docs/ARCHITECTURE.md: same bits for any thread count
    t_bw = c["weight_bytes"] / lim1["read_gbps"] / 1e6
    assert c["peak_kind"] == "bf16" and lim1["bf16_peak_gops"] > 0
    t_ops = c["flops"] / lim1["bf16_peak_gops"] / 1e6
    assert s["bound_ms"] == pytest.approx(max(t_bw, t_ops))  # against the 1-thread limits
    assert s["bound_fraction"] == pytest.approx(s["bound_ms"] / s["ms"])
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("shape"))
    assert header.split()[-3:] == ["ms", "1->2t", "others"] and "1t" in header.split()
    assert "at 1 thread:" in out and "bit-identical in every case" in out
    assert "\n  bf16 peak:      " in out  # the bf16 peak at each thread count
    # benchmarks/perf_tables.py (the tables of docs/PERFORMANCE.md) reads the same document
    md = _perf_tables().tables(doc).splitlines()
    assert "| shape | scheme | M=4 |" in md
    at = md.index("**1 -> 2 threads** (cpumoe's time at 1 / its time at 2; `!`: output not "
                  "bit-identical)")
    assert md[at + 4] == f"| custom-8x2-256x128 | bf16 | {s['scaling']:.2f} |"
    assert f"| custom-8x2-256x128 | bf16 | {100 * c['bound_fraction']:.0f}b |" in md \
        or f"| custom-8x2-256x128 | bf16 | {100 * c['bound_fraction']:.0f}c |" in md


def test_quick_preset_and_lists():
    parser = bench.build_parser()

    def parse(argv):
        return bench.resolve_arguments(parser.parse_args(argv))

    n = torch.get_num_threads()
    q = parse(["--quick"])
    assert (q.shape, q.scheme, q.m, q.min_time) == (
        "qwen3-30b-a3b", ["bf16", "int8", "fp8", "int4", "mxfp4"], [1, 64, 512], 0.3)
    assert q.threads == ([n, 1] if n > 1 else [n]) and q.quick
    # explicit options win over the preset
    q = parse(["--quick", "--m", "2", "--threads", "1", "--scheme", "int8", "--min-time", "3"])
    assert (q.shape, q.scheme, q.m, q.threads, q.min_time) == (
        "qwen3-30b-a3b", ["int8"], [2], [1], 3.0)
    d = parse([])
    assert (d.shape, d.scheme, d.m, d.threads, d.min_time) == (
        "qwen3-30b-a3b", ["bf16"], list(bench.DEFAULT_M), [n], 2.0)
    assert parse(["--dtype", "fp16"]).scheme == ["fp16"]
    a = parse(["--m", "all", "--scheme", "all,int8", "--threads", "1,2,2"])
    assert a.m == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert a.scheme == ["bf16", "fp16", "int8", "fp8", "int4", "mxfp4"] and a.threads == [2, 1]
    helptext = " ".join(parser.format_help().split())
    assert "--quick" in helptext and "--scheme bf16,int8,fp8,int4,mxfp4 --m 1,64,512" in helptext
    for bad in (["--m", "0"], ["--threads", "x"], ["--scheme", "int3"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_model_shapes_and_partial_fp8_blocks():
    olmoe, gpt = bench.parse_shapes("olmoe-1b-7b+gpt-oss-20b")
    assert (olmoe.E, olmoe.topk, olmoe.K, olmoe.N) == (64, 8, 2048, 1024)
    assert (gpt.E, gpt.topk, gpt.K, gpt.N) == (32, 4, 2880, 2880)
    assert len(bench.parse_shapes("all")) == 5
    # 2880 is a multiple of 64, not of 128: int4 groups of 64, fp8 partial scale blocks
    assert bench.int4_group_size(2880, 2880) == 64 and bench.int4_group_size(2048, 768) == 128
    # a small shape with the same property: 2N = 192 and K = 160 leave partial 128-blocks
    shape = bench.Shape("partial", E=4, topk=2, K=160, N=96)
    w = bench.ExpertWeights(shape, "bf16", scheme="fp8")
    assert tuple(w.kwargs["w1_scale"].shape) == (4, 2, 2)
    assert tuple(w.kwargs["w2_scale"].shape) == (4, 2, 1)
    rec = bench.run_case(shape, 3, weights=w, iters=1, min_iters=1)
    assert 0 <= rec["rel_diff_vs_baseline"] < 5e-2, rec
    # bytes: fp8 weights + one fp32 scale per (partial) block, per expert
    assert rec["weight_bytes"] == pytest.approx(
        rec["distinct_experts"] * (3 * 96 * 160 + 4 * (2 * 2 + 2 * 1)))


def test_int4pack_baseline_matches_eager():
    reason = bench.int4pack_unavailable("bf16")
    if reason:
        pytest.skip(reason)
    shape = bench.Shape("int4", E=4, topk=2, K=256, N=160)  # N=160: groups of 32
    w = bench.ExpertWeights(shape, "bf16", scheme="int4")
    *_, gs = w.torch_data
    assert gs == 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, shape.K, generator=g).bfloat16()
    r = bench.make_routings(1, 5, shape.E, shape.topk, g)[0]
    ref = bench.baseline_moe(x, w.w1, w.w2, r.topk_weights, r.topk_ids)  # dequantized weights
    out = bench.BASELINES["int4pack"].make_call(w, x)(r)
    assert bench._rel_diff(out, ref) < 2e-2
    assert w.w1.float().std().item() == pytest.approx(1 / 16, rel=0.25)  # ~1/sqrt(K)


def test_int4_scheme(tmp_path, fast_limits, capsys):
    reason = bench.scheme_unavailable("int4", "bf16")
    if reason and reason.startswith("int4 not built yet"):
        pytest.skip(reason)
    assert reason is None  # built, so the test layer must match the eager loop
    path = tmp_path / "int4.json"
    assert bench.main(["--shape", "custom:4,2,256,160", "--scheme", "int4", "--m", "1,3",
                       "--iters", "2", "--bw-mib", "64", "--threads", "1",
                       "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    int4pack = doc["settings"]["int4pack_unavailable"] is None
    m = doc["machine"]  # int4 rows are judged against the INT4 kernels' own loop
    assert m["int4_peak_gops"] == max(m["int4_samples_gops"]) > 0 and m["int8_peak_gops"] is None
    assert m["int4_peak_gops_end"] == max(m["int4_samples_gops_end"]) > 0
    assert m["limits_by_threads"][0]["int4_peak_gops"] == m["int4_peak_gops"]
    for c in doc["cases"]:
        assert c["scheme"] == "int4" and c["peak_kind"] == "u4s8" and c["moe_comp_method"] == 3
        peak = m["int4_peak_gops"]
        assert c["peak_fraction"] == pytest.approx(c["flops"] / peak / 1e6 / c["ms"]), c
        assert 0 <= c["rel_diff_vs_baseline"] < 5e-2, c
        if int4pack:
            assert c["int4pack_ms"] > 0 and 0 <= c["rel_diff_vs_int4pack"] < 5e-2, c
        # groups of 32 (N = 160): 1/2 byte per weight, per group and output row an fp32
        # scale and an int8 zero point; not the blocks' compensation, which decode never reads
        w1 = 2 * 160 * 256 // 2 + 5 * 2 * 160 * (256 // 32)
        w2 = 256 * 160 // 2 + 5 * 256 * (160 // 32)
        assert c["weight_bytes"] == pytest.approx(c["distinct_experts"] * (w1 + w2))
    out = capsys.readouterr().out
    assert ("vs int4pack = a per-expert loop over torch._weight_int4pack_mm_for_cpu" in out) \
        == int4pack


def test_unavailable_scheme_is_skipped(tmp_path, fast_limits, monkeypatch, capsys):
    """A scheme cpumoe cannot run (as int4 before its kernels) is listed, skipped, said why."""
    why = "int4 not built yet: (test)"
    monkeypatch.setitem(bench._INT4_REASON, torch.bfloat16, why)
    path = tmp_path / "skip.json"
    assert bench.main(["--shape", SHAPE, "--scheme", "bf16,int4", "--m", "1", "--iters", "1",
                       "--bw-mib", "64", "--threads", "1", "--no-baseline",
                       "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["schemes"] == ["bf16"]
    assert doc["settings"]["skipped_schemes"] == {"int4": why}
    assert [c["scheme"] for c in doc["cases"]] == ["bf16"]
    assert f"scheme int4 skipped: {why}" in capsys.readouterr().out
    assert bench.main(["--shape", SHAPE, "--scheme", "int4", "--m", "1"]) == 1  # nothing left


def test_plot(tmp_path, fast_limits, capsys):
    pytest.importorskip("matplotlib")
    png, path = tmp_path / "roofline.png", tmp_path / "plot.json"
    assert bench.main(ARGS + ["--no-baseline", "--iters", "1", "--plot", str(png),
                              "--json", str(path)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"roofline picture: {png}" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    fig = bench.write_plot(doc, str(tmp_path / "again.png"))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split()[0] for ax in panels] == ["bf16", "int8"]
    for ax, scheme in zip(panels, ("bf16", "int8")):
        rows = [c for c in doc["cases"] if c["scheme"] == scheme]
        achieved, bound = ax.get_lines()  # no eager line with --no-baseline
        assert list(achieved.get_xdata()) == [c["M"] for c in rows]
        assert list(achieved.get_ydata()) == pytest.approx([c["gflops"] for c in rows])
        assert list(bound.get_ydata()) == pytest.approx(
            [c["flops"] / c["bound_ms"] / 1e6 for c in rows])
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


def test_plot_without_matplotlib(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(SystemExit) as e:
        bench.main(ARGS + ["--plot", "x.png"])
    assert e.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_weight_layers_default(monkeypatch):
    """Enough copies for max(1 GiB, 8 x LLC), at most MAX_WEIGHT_LAYERS and a quarter of the
    available memory, at least one."""
    monkeypatch.setattr(bench_machine, "last_level_cache_bytes", lambda: 300 << 20)
    monkeypatch.setattr(bench_machine, "_mem_available_bytes", lambda: 24 << 30)
    assert bench.default_weight_layers(344_000_000) == 8  # ceil(2400 MiB / 344 MB)
    assert bench.default_weight_layers(1208 << 20) == 2
    assert bench.default_weight_layers(4 << 30) == 1
    assert bench.default_weight_layers(1 << 20) == bench.MAX_WEIGHT_LAYERS
    monkeypatch.setattr(bench_machine, "_mem_available_bytes", lambda: 2 << 30)
    assert bench.default_weight_layers(200 << 20) == 2  # a quarter of 2 GiB
    assert bench.default_weight_layers(1 << 30) == 1
    monkeypatch.setattr(bench_machine, "last_level_cache_bytes", lambda: None)
    monkeypatch.setattr(bench_machine, "_mem_available_bytes", lambda: None)
    assert bench.default_weight_layers(256 << 20) == 4  # 1 GiB


def test_weight_layers_cycle(tmp_path, fast_limits, capsys):
    """--weight-layers N: cpumoe's calls go round N copies (distinct tensors, same values),
    recorded per case and in the settings; the output is the one-copy output."""
    doc = _run(tmp_path, ["--weight-layers", "3", "--no-baseline"])
    assert doc["settings"]["weight_layers"] == 3
    assert all(c["weight_layers"] == 3 for c in doc["cases"])
    w = bench.ExpertWeights(bench.parse_shapes(SHAPE)[0], "bf16", scheme="int8")
    layers = w.layers(3)
    assert len(layers) == 3 and layers[0][0] is w.w1p
    assert layers[1][0].data_ptr() != w.w1p.data_ptr()
    assert torch.equal(layers[2][1], w.w2p)
    assert torch.equal(layers[2][2]["w1_scale"], w.kwargs["w1_scale"])
    r = bench.make_routings(1, 4, 8, 2, torch.Generator().manual_seed(1))[0]
    x = torch.randn(4, 256).bfloat16()
    outs = [cpumoe.fused_experts(x, a, b, r.topk_weights, r.topk_ids, **kw) for a, b, kw in layers]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert len(w.layers(1)) == 1
    one = bench.run_case(SHAPE, 4, scheme="int8", weights=w, iters=2, baseline=False,
                         weight_layers=1)
    three = bench.run_case(SHAPE, 4, scheme="int8", weights=w, iters=3, baseline=False,
                           weight_layers=3)
    assert one["weight_layers"] == 1 and three["weight_layers"] == 3
    with pytest.raises(SystemExit):
        bench.main(ARGS + ["--weight-layers", "0"])
    capsys.readouterr()


def test_parse_pairs():
    assert bench.parse_pairs("bf16/int8, int8/int4,bf16/int8") == [("bf16", "int8"),
                                                                    ("int8", "int4")]
    for bad, match in [("int8", "expected A/B"), ("int8/", "expected A/B"),
                       ("int8/int9", "unknown scheme 'int9'"), ("int8/int8", "twice"),
                       (",", "at least one pair")]:
        with pytest.raises(Exception, match=match):
            bench.parse_pairs(bad)


def test_interleaved_calls_alternate(monkeypatch):
    """run_interleaved: every routing is run by both schemes, which one goes first swaps
    from routing to routing, each scheme goes round its own weight copies, and a scheme
    made slower shows in its median (so the ratio can fail)."""
    import time

    shape = bench.parse_shapes(SHAPE)[0]
    a = bench.ExpertWeights(shape, "bf16", scheme="bf16")
    b = bench.ExpertWeights(shape, "bf16", scheme="int8")
    seen = []
    real = bench_timing.fused_experts

    def spy(x, w1, w2, topk_weights, topk_ids, **kw):
        method = kw.get("moe_comp_method", 0)
        seen.append((method, topk_ids.data_ptr(), w1.data_ptr()))
        if method == 0:
            time.sleep(0.004)  # bf16 made slower: its median must show it
        return real(x, w1, w2, topk_weights, topk_ids, **kw)

    monkeypatch.setattr(bench_timing, "fused_experts", spy)
    rec = bench.run_interleaved(shape, 2, [a, b], iters=6, weight_layers=2)
    timed = seen[-12:]  # after the warm-up calls
    assert [m for m, _, _ in timed] == [0, 1, 1, 0] * 3
    pairs = [timed[i:i + 2] for i in range(0, 12, 2)]
    assert all(p[0][1] == p[1][1] for p in pairs)  # same routing for both schemes
    assert len({p[1] for p in timed}) == 6  # six routings
    for method in (0, 1):
        assert len({w for m, _, w in timed if m == method}) == 2  # two copies each
    assert rec["iters"] == 6 and rec["weight_layers"] == {"bf16": 2, "int8": 2}
    assert rec["ms"]["bf16"] > rec["ms"]["int8"] + 3.0
    with pytest.raises(ValueError, match="two distinct"):
        bench.run_interleaved(shape, 2, [a, a], iters=1)


def test_bench_interleave_cli(tmp_path, fast_limits, monkeypatch, capsys):
    """--interleave: a table after the rows and JSON records with pair and ratio; a pair
    with a scheme that cannot run is skipped and said why."""
    why = "int4 not built yet: (test)"
    monkeypatch.setitem(bench._INT4_REASON, torch.bfloat16, why)
    path = tmp_path / "pairs.json"
    assert bench.main(["--shape", SHAPE, "--scheme", "int8", "--m", "1,3", "--iters", "2",
                       "--bw-mib", "64", "--threads", "1", "--no-baseline",
                       "--interleave", "bf16/int8,int8/int4", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["interleave"] == ["bf16/int8", "int8/int4"]
    recs = doc["interleaved"]
    assert [(r["pair"], r["M"]) for r in recs] == [("bf16/int8", 1), ("bf16/int8", 3)]
    for r in recs:
        assert r["ratio"] == pytest.approx(r["ms"]["bf16"] / r["ms"]["int8"])
        assert r["iters"] == 2
    out = capsys.readouterr().out
    assert "interleaved pairs" in out and "bf16/int8" in out
    assert f"pair int8/int4 skipped: {why}" in out
    md = _perf_tables().tables(doc).splitlines()
    assert "| shape | pair | M=1 | M=3 |" in md
    assert (f"| custom-8x2-256x128 | bf16/int8 | {recs[0]['ratio']:.2f} | "
            f"{recs[1]['ratio']:.2f} |") in md


# ---- the bf16 peak: which rows it bounds, when it is measured, how it is shown ------------------


def test_peak_kind_per_scheme_and_activation_dtype():
    """bf16 rows and fp8/mxfp4 rows with bf16 activations are judged against the bf16 peak;
    fp16 rows and fp8/mxfp4 rows with fp16 activations against the fp32 FMA peak; int8/int4
    int8 against u8*s8 and int4 against its kernels' own loop (u4*s8) whatever the activation
    dtype. bf16/fp16 fix their own activation dtype."""
    expected = {("bf16", "bf16"): "bf16", ("bf16", "fp16"): "bf16",
                ("fp16", "bf16"): "fp32_fma", ("fp16", "fp16"): "fp32_fma",
                ("fp8", "bf16"): "bf16", ("fp8", "fp16"): "fp32_fma",
                ("int8", "bf16"): "u8s8", ("int8", "fp16"): "u8s8",
                ("int4", "bf16"): "u4s8", ("int4", "fp16"): "u4s8",
                ("mxfp4", "bf16"): "bf16", ("mxfp4", "fp16"): "fp32_fma"}
    got = {(name, d): scheme.peak_kind(d) for name, scheme in bench.SCHEMES.items()
           for d in ("bf16", "fp16")}
    assert got == expected
    assert bench.SCHEMES["fp8"].peak_kind(torch.float16) == "fp32_fma"  # a torch dtype too
    lim = bench.Limits(read_gbps=10.0, fma_gflops=100.0, int8_gops=400.0, bf16_gops=3000.0,
                       int4_gops=700.0)
    assert [lim.peak(k) for k in bench_machine.PEAK_KINDS] == [100.0, 3000.0, 400.0, 700.0]
    assert bench.Limits(10.0, 100.0, 400.0).bound(1.0, 6e9, "u4s8") is None  # not measured
    assert lim.bound(0.0, 6e9, "bf16") == ("compute", pytest.approx(2e-3))
    assert bench.Limits(10.0, 100.0).bound(1.0, 6e9, "bf16") is None  # bf16 not measured
    with pytest.raises(ValueError, match="peak kind"):
        lim.peak("fp16")


def _plan(argv):
    from cpumoe.bench.cli import plan_run

    args = bench.resolve_arguments(bench.build_parser().parse_args(argv))
    return plan_run(args, bench.parse_shapes(SHAPE))


def test_plan_measures_the_bf16_peak_only_for_rows_judged_against_it():
    p = _plan(["--scheme", "bf16,fp16,fp8,int8"])
    assert p.used_by == {"bf16": ["bf16", "fp8"], "fp32_fma": ["fp16"], "u8s8": ["int8"]}
    assert p.need_bf16 and p.need_int8
    p = _plan(["--scheme", "fp16,fp8,int8", "--dtype", "fp16"])
    assert p.used_by == {"fp32_fma": ["fp16", "fp8"], "u8s8": ["int8"]} and not p.need_bf16
    p = _plan(["--scheme", "fp8", "--threads", "2,1"])
    assert p.used_by == {"bf16": ["fp8"]} and p.need_bf16 and not p.need_int8
    assert p.units_limits == pytest.approx(0.7 * 2)
    p = _plan(["--scheme", "int8,int4"])
    assert p.used_by == {"u8s8": ["int8"], "u4s8": ["int4"]} and p.need_int8 and p.need_int4
    assert not p.need_bf16 and p.peaks_needed == {"need_bf16": False, "need_int4": True}
    p = _plan(["--scheme", "int4"])
    assert p.used_by == {"u4s8": ["int4"]} and p.need_int4 and not p.need_int8
    assert p.units_limits == pytest.approx(0.7)


def _fake_probe(value):
    return {"samples_gops": [value * 0.9, value], "iterations": 1, "seconds_per_run": 0.3}


def test_measure_limits_runs_the_bf16_probe_only_when_asked(monkeypatch):
    calls = []

    def probe(name, result):
        def run():
            calls.append(name)
            return result
        return run

    monkeypatch.setattr(bench_machine, "_read_bandwidth_samples", lambda size=None: {
        "samples_gbps": [20.0], "buffer_bytes": 1 << 26, "passes": 2, "threads": 1})
    monkeypatch.setattr(bench_machine, "_fma_peak_samples", probe("fma", {
        "samples_gflops": [400.0], "iterations": 1, "seconds_per_run": 0.3}))
    monkeypatch.setattr(bench_machine, "_int8_peak_samples", probe("int8", _fake_probe(13000)))
    monkeypatch.setattr(bench_machine, "_bf16_peak_samples", probe("bf16", _fake_probe(6600)))
    monkeypatch.setattr(bench_machine, "_int4_peak_samples", probe("int4", _fake_probe(900)))
    got = bench.measure_limits(True)
    assert calls == ["fma", "int8"] and got["bf16"] is None and got["int4"] is None
    assert got["limits"] == bench.Limits(20.0, 400.0, 13000.0, None)
    calls.clear()
    got = bench.measure_limits(False, need_int4=True)
    assert calls == ["fma", "int4"] and got["int8"] is None and got["bf16"] is None
    assert got["limits"] == bench.Limits(20.0, 400.0, None, None, 900.0)
    calls.clear()
    got = bench.measure_limits(False, need_bf16=True)
    assert calls == ["fma", "bf16"] and got["int8"] is None
    assert got["bf16"]["samples_gops"] == [6600 * 0.9, 6600]
    assert got["limits"] == bench.Limits(20.0, 400.0, None, 6600.0)


def test_measure_bf16_peak_runs_the_tier_loop():
    bf16 = bench.measure_bf16_peak(0.02, 1)
    assert bf16 > 0
    if cpumoe.isa() == "amx":  # the tile unit: an order of magnitude above the FMAs
        assert bf16 > 4 * bench.measure_fma_peak(0.02, 1)


def test_measure_int4_peak_runs_the_tier_loop():
    """The u4*s8 probe counts 2 ops per multiply-add like the u8*s8 one: 64 per vpmaddubsw
    on avx2 (12 chains x 8 per iteration), the u8*s8 loop's count on the other tiers."""
    from cpumoe import _C

    assert bench.measure_int4_peak(0.02, 1) > 0
    if cpumoe.isa() == "avx2":
        assert _C.probe_int4(10) == 10 * 12 * 8 * 64 * torch.get_num_threads()
    else:
        assert _C.probe_int4(10) == _C.probe_int8(10)


def _fake_limits(with_bf16=True, with_int8=True):
    bw = {"samples_gbps": [24.0, 25.0], "buffer_bytes": 1 << 30, "passes": 2, "threads": 2}
    fma = {"samples_gflops": [420.0, 430.0], "iterations": 1, "seconds_per_run": 0.3}
    return {"threads": 2, "read": bw, "fma": fma,
            "int8": _fake_probe(13000) if with_int8 else None,
            "bf16": {"samples_gops": [6500.0, 6595.0, 6560.0], "iterations": 1,
                     "seconds_per_run": 0.3} if with_bf16 else None}


def test_limit_lines_name_the_bf16_peak_and_its_loop():
    from cpumoe.bench.report import _limit_lines

    used_by = {"bf16": ["bf16", "fp8"], "u8s8": ["int8", "int4"]}
    lines = _limit_lines(_fake_limits(), used_by, "amx")
    assert lines[0].startswith("streaming read: 25.0 GB/s")
    assert lines[1].startswith("fp32 FMA peak:  430 GFLOP/s") and "bound of" not in lines[1]
    assert lines[2] == ("bf16 peak:      6595 GOP/s (best of 3 runs of ~0.3 s, AMX tdpbf16ps; "
                        "median 6560); bound of bf16, fp8 rows")
    assert lines[3] == ("u8*s8 peak:     13000 GOP/s (best of 2 runs of ~0.3 s, AMX tdpbusd; "
                        "median 12350); bound of int8, int4 rows")
    lines = _limit_lines(_fake_limits(), used_by, "avx512")
    assert ", fp32 FMA; median" in lines[2] and ", VNNI vpdpbusd; median" in lines[3]
    lines = _limit_lines(_fake_limits(with_bf16=False), {"fp32_fma": ["fp16"]}, "amx")
    assert len(lines) == 3 and lines[1].endswith("; bound of fp16 rows")
    assert not any(ln.startswith("bf16 peak") for ln in lines)
    assert bench_machine.peak_loop("bf16", "avx512bf16") == "fp32 FMA"
    assert bench_machine.peak_loop("u8s8", "amx") == "AMX tdpbusd"
    limits = dict(_fake_limits(with_bf16=False), int4=_fake_probe(900))
    lines = _limit_lines(limits, {"u8s8": ["int8"], "u4s8": ["int4"]}, "avx2")
    assert lines[2].endswith(", AVX2 vpmaddwd; median 12350); bound of int8 rows"), lines[2]
    assert lines[3] == ("u4*s8 peak:     900 GOP/s (best of 2 runs of ~0.3 s, AVX2 vpmaddubsw; "
                        "median 855); bound of int4 rows")
    # the tiers whose INT4 kernels run INT8's instruction judge int4 against the same loop
    for tier in ("amx", "avx512bf16", "avx512", "avx2vnni", "scalar"):
        assert bench_machine.peak_loop("u4s8", tier) == bench_machine.peak_loop("u8s8", tier)


def test_drift_lines_flag_limits_that_moved():
    from cpumoe.bench.report import summary_lines

    assert bench_machine.drift_line("bf16 peak", 2000.0, 2150.0, "GOP/s") == (
        "bf16 peak at the end: 2150 GOP/s (start 2000, +8%)")
    assert bench_machine.drift_line("streaming read", 25.0, 20.0, "GB/s", 1) == (
        "streaming read at the end: 20.0 GB/s (start 25.0, -20%)  -- the machine was noisy")
    plan = argparse.Namespace(scaling=[])
    limits = bench_machine.Limits(read_gbps=25.0, fma_gflops=430.0, int8_gops=13000.0)
    end = bench_machine.best_limits(
        {"samples_gbps": [24.0, 25.5]},
        {"fma": {"samples_gflops": [300.0, 310.0]}, "int8": _fake_probe(13000), "bf16": None})
    lines = summary_lines(plan, [], limits, end, None, None, 1.0)
    assert lines[:3] == [
        "streaming read at the end: 25.5 GB/s (start 25.0, +2%)",
        "fp32 FMA peak at the end: 310 GFLOP/s (start 430, -28%)  -- the machine was noisy",
        "u8*s8 peak at the end: 13000 GOP/s (start 13000, +0%)"]
    assert not any(ln.startswith("bf16 peak") for ln in lines)  # neither start nor end


def test_bench_without_bf16_rows_leaves_the_bf16_peak_out(tmp_path, fast_limits, capsys):
    """fp16 activations: fp8 rows are judged against the fp32 FMA peak, and no bf16 peak is
    measured (null in the JSON document, no header line)."""
    path = tmp_path / "fp16.json"
    assert bench.main(["--shape", SHAPE, "--scheme", "fp8", "--dtype", "fp16", "--m", "2",
                       "--iters", "1", "--bw-mib", "64", "--threads", "1", "--no-baseline",
                       "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    m = doc["machine"]
    assert m["bf16_peak_gops"] is None and m["bf16_samples_gops"] is None
    assert m["bf16_statistic"] is None and m["limits_by_threads"][0]["bf16_peak_gops"] is None
    (c,) = doc["cases"]
    assert c["dtype"] == "fp16" and c["peak_kind"] == "fp32_fma"
    _check_bound(c, m["read_gbps"], m["fma_peak_gflops"], None, None)
    out = capsys.readouterr().out
    assert "bf16 peak:" not in out
    assert next(ln for ln in out.splitlines()
                if ln.startswith("fp32 FMA peak:")).endswith("; bound of fp8 rows")


def test_run_case_judges_bf16_rows_against_the_bf16_peak():
    """run_case's peak arguments: a bf16 row's bound uses bf16_peak_gops, an fp8 row with
    fp16 activations fma_peak_gflops (peaks chosen so that compute bounds every row)."""
    peaks = {"read_gbps": 1e6, "fma_peak_gflops": 0.5, "int8_peak_gops": 2.0,
             "bf16_peak_gops": 1.0}
    for scheme, dtype, kind, peak in (("bf16", "bf16", "bf16", 1.0),
                                      ("fp8", "bf16", "bf16", 1.0),
                                      ("fp8", "fp16", "fp32_fma", 0.5)):
        rec = bench.run_case(SHAPE, 2, scheme=scheme, dtype=dtype, iters=1, baseline=False,
                             weight_layers=1, **peaks)
        assert rec["peak_kind"] == kind and rec["bound"] == "compute", (scheme, dtype)
        assert rec["bound_ms"] == pytest.approx(rec["flops"] / peak / 1e6)


def test_old_document_without_the_bf16_peak_loads_compares_and_plots_its_labels(tmp_path,
                                                                                capsys):
    """benchmarks/results/*.json predate the bf16 peak: they still load and compare, their
    limits are shown without it, and their bf16 rows' panels say fp32 FMA."""
    from cpumoe.bench.compare import describe_limits
    from cpumoe.bench.report import limits_text, panel_title

    path = os.path.join(REPO, "benchmarks", "results", "qwen3-targets-62.json")
    if not os.path.exists(path):
        pytest.skip(f"{path} is not in this checkout")
    old = bench.load_document(path)
    assert "bf16_peak_gops" not in old["machine"]
    assert "bf16" not in limits_text(old["machine"])
    assert describe_limits(old).startswith("   limits: read ")
    bf16_cases = [c for c in old["cases"] if c["scheme"] == "bf16"]
    assert panel_title("bf16", bf16_cases) == "bf16 (bound: read bandwidth, fp32 FMA peak)"
    # the same run as if measured now on amx: bf16 rows against the bf16 peak
    new = json.loads(json.dumps(old))
    new["machine"].update({"tier": "amx", "bf16_peak_gops": 6595.4, "int8_peak_gops": 13020.0})
    for c in new["cases"]:
        if c["peak_kind"] == "fp32_fma":
            c["peak_kind"] = "bf16"
    assert limits_text(new["machine"]).endswith(
        ", bf16 6595 GOP/s (AMX tdpbf16ps), u8*s8 13020 GOP/s (AMX tdpbusd)")
    assert panel_title("bf16", [c for c in new["cases"] if c["scheme"] == "bf16"]) == \
        "bf16 (bound: read bandwidth, bf16 peak)"
    new_path = _write(tmp_path, "new.json", new)
    assert bench.main(["compare", path, new_path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == describe_limits(old) and "bf16" not in out[1]
    assert out[3] == describe_limits(new) and "bf16 6595 GOP/s (AMX tdpbf16ps)" in out[3]
    assert "geometric mean of B/A: 1.000x" in "\n".join(out)


# ---- what the package was built from, and the CPU, in every JSON document -------------------

FAKE_BUILD = {"GIT_COMMIT": "0123456789abcdef0123456789abcdef01234567", "DIRTY": True,
              "COMPILER": "cc (Test) 1.2.3", "CC": "cc"}


def _fake_build_info(monkeypatch, values):
    """Makes ``from cpumoe import _build_info`` see a module holding ``values`` (None: no
    such module, as in a source tree)."""
    module = None
    if values is not None:
        module = types.ModuleType("cpumoe._build_info")
        for k, v in values.items():
            setattr(module, k, v)
    monkeypatch.delattr(cpumoe, "_build_info", raising=False)
    monkeypatch.setitem(sys.modules, "cpumoe._build_info", module)


def _cpuinfo_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.lower().startswith("model name")), None)
    except OSError:
        return None


def test_bench_json_records_build_and_cpu(tmp_path, fast_limits, monkeypatch, capsys):
    _fake_build_info(monkeypatch, FAKE_BUILD)
    path = tmp_path / "build.json"
    assert bench.main(["--shape", SHAPE, "--scheme", "bf16", "--m", "1", "--iters", "1",
                       "--bw-mib", "64", "--threads", "1", "--no-baseline",
                       "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["build"] == {"git_commit": FAKE_BUILD["GIT_COMMIT"], "dirty": True,
                            "compiler": "cc (Test) 1.2.3", "cc": "cc"}
    m = doc["machine"]
    model = _cpuinfo_model()
    if model is not None:
        assert m["cpu_model"] == model
    assert m["cpu_model"] and m["cpu_features"] == cpumoe.cpu_features()
    capsys.readouterr()


def test_build_info_unknown_without_the_generated_module(monkeypatch):
    _fake_build_info(monkeypatch, None)
    assert bench.build_info() == {"git_commit": "unknown", "dirty": "unknown",
                                  "compiler": "unknown", "cc": "unknown"}
    _fake_build_info(monkeypatch, {**FAKE_BUILD, "DIRTY": False})
    assert bench.build_info()["dirty"] is False


def test_info_json_has_build(monkeypatch, capsys):
    from cpumoe.__main__ import info_main

    _fake_build_info(monkeypatch, FAKE_BUILD)
    assert info_main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["build"]["git_commit"] == FAKE_BUILD["GIT_COMMIT"]
    assert info_main([]) == 0
    out = capsys.readouterr().out
    assert f"commit {FAKE_BUILD['GIT_COMMIT']} (tree had changes)" in out
    assert "cc (Test) 1.2.3" in out


def _git(*args):
    res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def test_setup_build_py_writes_build_info(tmp_path):
    """setup.py's build_py writes cpumoe/_build_info.py into the build output (not into the
    source tree) with this checkout's commit, its state and the compiler."""
    head = shutil.which("git") and _git("rev-parse", "HEAD")
    if not head:
        pytest.skip("not a git checkout (or no git)")
    status_before = _git("status", "--porcelain")
    out = tmp_path / "lib"
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    recorded = {}
    exec((out / "cpumoe" / "_build_info.py").read_text(), recorded)
    assert recorded["GIT_COMMIT"] == head.strip()
    assert recorded["DIRTY"] is bool(status_before.strip())
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True)
    assert recorded["COMPILER"] == (version.stdout.splitlines()[0].strip()
                                    if version.returncode == 0 else "unknown")
    assert recorded["CC"] == cc
    assert not os.path.exists(os.path.join(PYTHON_DIR, "cpumoe", "_build_info.py"))
    assert (out / "cpumoe" / "bench" / "__init__.py").exists()  # the subpackage is built too


# ---- python -m cpumoe bench compare A.json B.json ----------------------------------------------


def _case(scheme, M, ms, threads=2, baseline_ms=None, scaling=()):
    return {"shape": "qwen3-30b-a3b", "scheme": scheme, "dtype": "bf16", "M": M,
            "threads": threads, "ms": ms, "baseline_ms": baseline_ms, "int8pack_ms": None,
            "int4pack_ms": None, "eager_capped_ms": None,
            "thread_scaling": [{"threads": t, "ms": v} for t, v in scaling]}


def _doc(cases, commit="unknown"):
    return {"machine": {"tier": "avx512", "threads": 2, "cpu_model": "Test CPU"},
            "build": {"git_commit": commit, "dirty": False, "compiler": "cc", "cc": "cc"},
            "settings": {"threads": [2], "dtype": "bf16"}, "cases": cases,
            "interleaved": [], "timestamp": "2026-11-25T00:00:00+0000"}


def _write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_compare_matches_cases_and_computes_ratios(tmp_path, capsys):
    a = _doc([_case("bf16", 1, 2.0, baseline_ms=10.0, scaling=[(1, 3.0)]),
              _case("int8", 1, 1.0), _case("int8", 64, 5.0)], commit="a" * 40)
    b = _doc([_case("int8", 1, 0.5), _case("bf16", 1, 3.0, baseline_ms=10.0,
                                           scaling=[(1, 3.0)]),
              _case("fp8", 1, 1.5)])
    result = bench.compare_documents(a, b)
    got = {r["key"]: (r["a_ms"], r["b_ms"], r["ratio"]) for r in result["rows"]}
    head = ("qwen3-30b-a3b", "bf16", "bf16", 1)
    assert got == {head + (2, "cpumoe"): (2.0, 3.0, 1.5),
                   head + (2, "eager"): (10.0, 10.0, 1.0),
                   head + (1, "cpumoe"): (3.0, 3.0, 1.0),  # the thread_scaling entry
                   ("qwen3-30b-a3b", "int8", "bf16", 1, 2, "cpumoe"): (1.0, 0.5, 0.5)}
    assert result["geomean"] == pytest.approx((1.5 * 1.0 * 1.0 * 0.5) ** 0.25)
    assert result["geomean_by_impl"]["eager"] == (pytest.approx(1.0), 1)
    assert result["geomean_by_impl"]["cpumoe"][1] == 3
    assert result["only_a"] == [("qwen3-30b-a3b", "int8", "bf16", 64, 2, "cpumoe")]
    assert result["only_b"] == [("qwen3-30b-a3b", "fp8", "bf16", 1, 2, "cpumoe")]

    pa, pb = _write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)
    assert bench.main(["compare", pa, pb]) == 0
    out = capsys.readouterr().out
    assert f"A: {pa}: commit {'a' * 12}," in out and f"B: {pb}: commit unknown," in out
    row = next(ln for ln in out.splitlines() if ln.startswith("qwen3-30b-a3b")
               and "int8" in ln)
    assert row.split()[-3:] == ["1.000", "0.500", "0.50x"]
    assert f"geometric mean of B/A: {(0.75) ** 0.25:.3f}x over 4 timing(s)" in out
    assert "only in A: 1 timing(s):\n  qwen3-30b-a3b int8 (bf16) M=64 2t cpumoe" in out
    assert "only in B: 1 timing(s):\n  qwen3-30b-a3b fp8 (bf16) M=1 2t cpumoe" in out


def test_compare_a_saved_run_with_itself_through_python_m_cpumoe(capsys):
    """A recorded run (every baseline, thread scaling, no interleaving) against itself:
    every timing matched, every ratio 1; dispatched as python -m cpumoe bench compare."""
    from cpumoe.__main__ import main as cpumoe_main

    path = os.path.join(REPO, "benchmarks", "results", "quick.json")
    if not os.path.exists(path):
        pytest.skip(f"{path} is not in this checkout")
    doc = bench.load_document(path)
    result = bench.compare_documents(doc, doc)
    expected = sum(1 + len(c["thread_scaling"])
                   + sum(c.get(f"{k}_ms") is not None for k in bench.BASELINES)
                   + (c.get("eager_capped_ms") is not None) for c in doc["cases"])
    assert len(result["rows"]) == expected > len(doc["cases"])
    assert all(r["ratio"] == 1.0 for r in result["rows"])
    assert result["only_a"] == result["only_b"] == []
    assert cpumoe_main(["bench", "compare", path, path]) == 0
    assert "geometric mean of B/A: 1.000x" in capsys.readouterr().out


def test_compare_interleaved_records(tmp_path):
    a, b = _doc([]), _doc([])
    for doc, (ms_a, ms_b) in ((a, (4.0, 2.0)), (b, (3.0, 2.0))):
        doc["interleaved"] = [{"shape": "qwen3-30b-a3b", "M": 1, "pair": "bf16/int8",
                               "schemes": ["bf16", "int8"],
                               "ms": {"bf16": ms_a, "int8": ms_b}}]
    rows = {r["key"]: r["ratio"] for r in bench.compare_documents(a, b)["rows"]}
    assert rows == {("qwen3-30b-a3b", "bf16", "bf16", 1, 2, "cpumoe in bf16/int8"): 0.75,
                    ("qwen3-30b-a3b", "int8", "bf16", 1, 2, "cpumoe in bf16/int8"): 1.0}


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    ("[1, 2]", "not a 'python -m cpumoe bench --json' document (no list of cases)"),
    (json.dumps({"cases": [{"shape": "s", "scheme": "bf16", "dtype": "bf16", "M": 1,
                            "threads": 1}]}), "case 0 lacks ms"),
    (json.dumps({"cases": [], "interleaved": [{"shape": "s"}]}), "malformed document"),
])
def test_compare_fails_cleanly_on_bad_files(tmp_path, capsys, content, message):
    good = _write(tmp_path, "good.json", _doc([_case("bf16", 1, 2.0)]))
    bad = str(tmp_path / "missing.json") if content is None else _write(tmp_path, "bad.json",
                                                                        content)
    for argv in ([good, bad], [bad, good]):
        assert bench.main(["compare", *argv]) == 1
        captured = capsys.readouterr()
        assert captured.err.startswith(f"cpumoe bench compare: {bad}: {message}"), captured.err
        assert "Traceback" not in captured.err and captured.out == ""


def test_compare_without_common_timings_fails(tmp_path, capsys):
    a = _write(tmp_path, "a.json", _doc([_case("bf16", 1, 2.0)]))
    b = _write(tmp_path, "b.json", _doc([_case("int8", 1, 2.0)]))
    assert bench.main(["compare", a, b]) == 1
    captured = capsys.readouterr()
    assert "no timing in common" in captured.err
    assert "only in A: 1 timing(s)" in captured.out and "only in B: 1 timing(s)" in captured.out
    with pytest.raises(SystemExit):  # one file is a usage error
        bench.main(["compare", a])
    capsys.readouterr()


def test_parse_peers():
    from cpumoe.bench.cli import parse_peers

    assert parse_peers("sglang") == ["sglang"]
    assert parse_peers("all") == list(bench.baselines.PEERS)
    assert parse_peers("ggml,vllm") == ["ggml", "ggml_q4k", "vllm"]  # a library: its rows
    assert parse_peers("kt_gptq,kt") == ["kt_gptq", "kt"]
    with pytest.raises(Exception, match="unknown peer nope"):
        parse_peers("sglang,nope")


def test_peer_unavailable_is_reported_not_run(tmp_path, fast_limits, monkeypatch, capsys):
    """A peer that cannot run here (not installed, or a CPU without its ISA) is named in the
    header with the reason, and no case has its timings."""
    from cpumoe.bench import baselines
    from cpumoe.bench.peers import sglang

    monkeypatch.setattr(sglang, "sglang_library", lambda: (None, "pretend: not installed"))
    row = baselines.BASELINES["sglang"]
    monkeypatch.setitem(baselines.BASELINES, "sglang", dataclasses.replace(
        row, unavailable=sglang.sglang_unavailable))
    doc = _run(tmp_path, ["--peers", "sglang"])
    assert "sglang" not in doc["settings"]["baselines"]
    assert all(c["sglang_ms"] is None for c in doc["cases"])
    assert "sglang peer skipped: pretend: not installed" in capsys.readouterr().out


def _fake_peer(factor, delay=0.0):
    """A peer call maker whose output is the eager loop's times ``factor``, after sleeping
    ``delay`` seconds."""
    def make(w, x):
        def call(r):
            time.sleep(delay)
            return bench.baseline_moe(x, w.w1, w.w2, r.topk_weights, r.topk_ids) * factor
        return call
    return make


def _fake_format(tolerance):
    from cpumoe.bench.peers import PeerFormat

    return lambda w: PeerFormat("fake", 1.5, tolerance, "a test double")


def test_disagreeing_peer_is_not_timed(tmp_path, fast_limits, monkeypatch, capsys):
    """A peer whose output differs from cpumoe's by more than its format's tolerance (e.g.
    called with the wrong layout) gets an error in its record instead of a time; one that
    agrees is timed on the same routings, with its format and bytes per weight."""
    from cpumoe.bench import baselines

    row = baselines.BASELINES["sglang"]
    for factor, agrees in ((1.0, True), (3.0, False)):
        monkeypatch.setitem(baselines.BASELINES, "sglang", dataclasses.replace(
            row, unavailable=lambda dt: None, make_call=_fake_peer(factor),
            format=_fake_format(0.05)))
        doc = _run(tmp_path, ["--peers", "sglang"])
        for c in doc["cases"]:
            assert c["sglang_format"] == "fake" and c["sglang_bytes_per_weight"] == 1.5
            assert c["sglang_tolerance"] == 0.05 and c["sglang_skipped"] is None
            assert c["bytes_per_weight"] == pytest.approx(
                {"bf16": 2.0, "int8": 1 + 8 * (2 * 128 + 256) / (3 * 128 * 256)}[c["scheme"]])
            if agrees:
                assert c["sglang_ms"] > 0 and c["rel_diff_vs_sglang"] <= 0.05
                assert c["sglang_error"] is None
            else:
                assert c["sglang_ms"] is None and c["rel_diff_vs_sglang"] > 0.05
                assert "not timed" in c["sglang_error"]
        out = capsys.readouterr().out
        if not agrees:
            assert "sglang on custom-8x2-256x128 bf16 M=1: sglang: output differs" in out


def test_peer_settings_report_the_fastest(tmp_path, fast_limits, monkeypatch):
    """A peer timed in several settings (KTransformers: 1 worker thread and all) reports the
    fastest setting's time and every setting's median; a setting that disagrees is left out,
    and the peer is an error only when no setting agrees."""
    from cpumoe.bench import baselines

    def make(w, x):
        return {"slow": _fake_peer(1.0, 0.02)(w, x), "fast": _fake_peer(1.0)(w, x),
                "wrong": _fake_peer(3.0)(w, x)}

    # a row no other peer shares a --peers name with (kt would also run the real kt_gptq)
    row = baselines.BASELINES["sglang"]
    monkeypatch.setitem(baselines.BASELINES, "sglang", dataclasses.replace(
        row, unavailable=lambda dt: None, make_call=make, format=_fake_format(0.05)))
    doc = _run(tmp_path, ["--peers", "sglang"])
    for c in doc["cases"]:
        assert c["sglang_setting"] == "fast"
        assert set(c["sglang_settings_ms"]) == {"slow", "fast"}
        assert c["sglang_ms"] == c["sglang_settings_ms"]["fast"] < c["sglang_settings_ms"]["slow"]
        assert c["sglang_error"] is None


def test_peer_without_a_format_for_the_row_is_skipped_with_the_reason(tmp_path, fast_limits,
                                                                       monkeypatch, capsys):
    from cpumoe.bench import baselines

    row = baselines.BASELINES["vllm"]
    monkeypatch.setitem(baselines.BASELINES, "vllm", dataclasses.replace(
        row, unavailable=lambda dt: None, make_call=_fake_peer(1.0),
        format=lambda w: _fake_format(0.05)(w) if w.scheme == "bf16" else "bf16 rows only"))
    doc = _run(tmp_path, ["--peers", "vllm"])
    for c in doc["cases"]:
        if c["scheme"] == "bf16":
            assert c["vllm_ms"] > 0 and c["vllm_skipped"] is None
        else:
            assert c["vllm_ms"] is None and c["vllm_skipped"] == "bf16 rows only"
    assert "vllm not run on int8 rows: bf16 rows only" in capsys.readouterr().out


def test_bench_routing(tmp_path, monkeypatch, capsys):
    """python -m cpumoe bench routing: the table and the JSON; its eager versions pick the
    experts cpumoe picks (fp32 logits, so no ties)."""
    from cpumoe.bench import routing

    monkeypatch.setattr(routing, "measure_read_bandwidth", lambda: 20.0)
    path = tmp_path / "routing.json"
    argv = ["routing", "--case", "qwen3,dsv3-shared,dsv2", "--m", "1,3", "--min-time", "0.01",
            "--threads", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b topk_softmax" in out and "% layer" in out
    doc = json.loads(path.read_text())
    assert doc["read_bandwidth_gbps"] == 20.0 and doc["threads"] == 1
    assert [(r["case"], r["M"]) for r in doc["rows"]] == [
        ("qwen3", 1), ("qwen3", 3), ("dsv3-shared", 1), ("dsv3-shared", 3), ("dsv2", 1),
        ("dsv2", 3)]
    for r in doc["rows"]:
        assert 0 < r["us_best"] <= r["us_median"] and r["eager_us_median"] > 0
        case = routing.CASES[r["case"]]
        assert r["layer_ms_estimate"] == pytest.approx(case.layer_bytes(r["M"]) / 20e9 * 1e3)
        assert r["percent_of_layer"] == pytest.approx(
            100 * r["us_median"] / (r["layer_ms_estimate"] * 1e3))
    # M = 1 touches topk experts (plus the shared one): 3 N K bytes each
    assert routing.CASES["qwen3"].layer_bytes(1) == pytest.approx(8 * 3 * 768 * 2048 * 2)
    assert routing.CASES["dsv3-shared"].layer_bytes(1) == pytest.approx(9 * 3 * 2048 * 7168)
    for key, case in routing.CASES.items():
        logits, ours, eager = routing._calls(case, 5, 1, seed=3)
        lg = logits[0].float()
        got, want = ours(lg), eager(lg)
        assert torch.equal(got[1].sort(-1).values, want[1].sort(-1).values), key
        order_got, order_want = got[1].argsort(-1), want[1].argsort(-1)
        torch.testing.assert_close(got[0].gather(1, order_got), want[0].gather(1, order_want),
                                   rtol=1e-5, atol=1e-6)


def test_ab_builds_tool():
    """tools/ab_builds.py pairs two builds; here the same one twice (an A/A run) on a tiny
    shape: both workers start in both spawn orders, every round prints, the summary's ratio
    is near 1. Rounds of 20 calls: with 2, one slow call in a round swung its ratio from
    0.03 to 40 and the median of 3 rounds past 5 (seen once)."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(cpumoe.__file__)))
    tool = os.path.join(REPO, "tools", "ab_builds.py")
    res = subprocess.run(
        [sys.executable, tool, pkg_parent, pkg_parent, "--scheme", "int8", "--m", "3",
         "--shape", SHAPE, "--rounds", "5", "--calls", "20"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[:5]] == [f"round {k}" for k in range(5)]
    # two sittings of fresh workers, one per spawn order (3 rounds, then 2)
    assert ["new spawned first" in ln for ln in lines[:5]] == [False] * 3 + [True] * 2, lines
    summary = lines[-1]
    assert summary.startswith("custom") and "int8 M=3" in summary, summary
    assert "old spawned first " in summary and "new spawned first " in summary, summary
    ratio = float(summary.split("new/old median ")[1].split()[0])
    assert 0.2 < ratio < 5, summary  # the same build: timing noise only, never a crash or 0
    linear = subprocess.run(
        [sys.executable, tool, pkg_parent, pkg_parent, "--scheme", "bf16", "--m", "3",
         "--linear", "custom:64,96", "--rounds", "2", "--calls", "5"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert linear.returncode == 0, linear.stderr
    summary = linear.stdout.strip().splitlines()[-1]
    assert summary.startswith("linear custom:64,96 bf16 M=3: old "), summary
    missing = subprocess.run([sys.executable, tool, pkg_parent], env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "old and the new build" in missing.stderr
    no_rounds = subprocess.run([sys.executable, tool, pkg_parent, pkg_parent, "--rounds", "0"],
                               env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert no_rounds.returncode == 2 and "at least one round" in no_rounds.stderr


def test_ab_switch_tool():
    """tools/ab_switch.py times values of an environment variable in one process; here one
    the build never reads (every value an A/A pair): a line per value, in order, the first
    exactly 1 against itself, the others timing noise only."""
    tool = os.path.join(REPO, "tools", "ab_switch.py")
    res = subprocess.run(
        [sys.executable, tool, "--env", "CPUMOE_AB_SWITCH_TEST", "--values", "a,a,b",
         "--scheme", "int8", "--m", "3", "--shape", SHAPE, "--rounds", "3", "--calls", "10"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert [ln.split(": ")[0] for ln in lines] == [
        f"custom:8,2,256,128 int8 M=3 CPUMOE_AB_SWITCH_TEST={v}" for v in "aab"], lines
    assert "median 1.000 (quartiles 1.000-1.000)" in lines[0], lines[0]
    for ln in lines[1:]:
        assert 0.2 < float(ln.split("median ")[1].split()[0]) < 5, ln
    linear = subprocess.run(
        [sys.executable, tool, "--env", "CPUMOE_AB_SWITCH_TEST", "--values", "0,1",
         "--scheme", "bf16", "--m", "3", "--linear", "custom:64,96", "--rounds", "1",
         "--calls", "3"],
        env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert linear.returncode == 0, linear.stderr
    assert linear.stdout.startswith("linear custom:64,96 bf16 M=3 CPUMOE_AB_SWITCH_TEST=0: ")
    one = subprocess.run([sys.executable, tool, "--env", "X", "--values", "0"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert one.returncode == 2 and "at least two values" in one.stderr
