"""The eager baseline under a capped oneDNN ISA (``--baseline-isa``): oneDNN reads
``ONEDNN_MAX_CPU_ISA`` once, when torch loads it, so the loop runs in a subprocess
(``python -m cpumoe.bench --_baseline-worker JOB``) that regenerates the same inputs and
routings and times them as :func:`cpumoe.bench.timing.run_case` does."""

from __future__ import annotations

import collections
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .baselines import baseline_moe
from .schemes import ExpertWeights
from .shapes import DTYPES, Routing, Shape, _check_shape, make_routings
from .timing import _case_inputs, _iterations, _ticker, _time_calls, _warm_up

_WORKER_FLAG = "--_baseline-worker"
_PROGRESS_TAG = "@cpumoe-progress "


def run_capped_baseline(isa: str, shapes: Sequence[Shape], schemes: Sequence[str],
                        ms: Sequence[int], *, dtype: str = "bf16", seed: int = 0,
                        iters: Optional[int] = None, min_time: float = 1.0,
                        min_iters: int = 3, max_iters: int = 200,
                        threads: Optional[int] = None,
                        progress: Optional[Callable[[float, str], None]] = None) -> dict:
    """Times the eager baseline (:func:`baseline_moe`) of every (shape, scheme, M) in a
    subprocess (``python -m cpumoe.bench --_baseline-worker JOB``) started with
    ``ONEDNN_MAX_CPU_ISA=isa`` (and ``DNNL_MAX_CPU_ISA``), which oneDNN reads once when
    torch loads it. The subprocess regenerates the weights, hidden states and routings from
    ``seed`` exactly as :func:`run_case` does, so it times the same calls.

    Returns ``{"isa", "onednn_isa", "matmul_impl": {dtype: oneDNN implementation of the
    first GEMM, or None when torch did not call oneDNN}, "error", "seconds", "cases":
    {(shape name, scheme, M): {"ms", "ms_min", "iters", "others_cpu_fraction", "out"
    (first output, for the difference against cpumoe), "error"}}}``. Never raises for a
    failing subprocess: ``error`` says why (and ``cases`` holds what finished).
    """
    report = progress or (lambda frac, text: None)
    result: dict = {"isa": isa, "onednn_isa": None, "matmul_impl": {}, "error": None,
                    "seconds": None, "cases": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cpumoe-bench-") as tmp:
        job = {
            "shapes": [[s.name, s.E, s.topk, s.K, s.N] for s in shapes],
            "schemes": list(schemes), "m": list(ms), "dtype": dtype, "seed": seed,
            "iters": iters, "min_time": min_time, "min_iters": min_iters,
            "max_iters": max_iters, "threads": threads or torch.get_num_threads(),
            "dir": tmp,
        }
        job_path = os.path.join(tmp, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        stdout_path = os.path.join(tmp, "stdout.txt")
        cmd = [sys.executable, "-m", "cpumoe.bench", _WORKER_FLAG, job_path]
        try:
            rc, tail = _run_worker(cmd, _worker_env(isa), stdout_path, report)
        except OSError as e:
            result["error"] = f"cannot start {' '.join(cmd)}: {e}"
            return result
        try:
            with open(stdout_path) as f:
                _parse_onednn_verbose(f, result)
        except OSError:
            pass
        _collect_cases(tmp, rc, tail, result)
    result["seconds"] = time.perf_counter() - t0
    return result


def _worker_env(isa: str) -> dict:
    """The worker's environment: oneDNN capped at ``isa``, its verbose mode left to the
    worker, and this process's cpumoe first on the path."""
    # the directory holding the cpumoe package (this file is cpumoe/bench/capped.py), so the
    # subprocess imports the same cpumoe as this process
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["ONEDNN_MAX_CPU_ISA"] = isa
    env["DNNL_MAX_CPU_ISA"] = isa  # the name before oneDNN 2.x
    env.pop("ONEDNN_VERBOSE", None)
    env.pop("DNNL_VERBOSE", None)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"]
                                      if env.get("PYTHONPATH") else "")
    return env


def _run_worker(cmd: List[str], env: dict, stdout_path: str,
                report: Callable[[float, str], None]):
    """Runs the worker to its end, its stdout (oneDNN's verbose lines) into
    ``stdout_path``, its progress lines passed to ``report``; returns its exit status and
    the last lines of its other stderr output (for the error message). Kills it if this
    process is interrupted; OSError when it cannot start."""
    tail: collections.deque = collections.deque(maxlen=15)
    with open(stdout_path, "w") as so:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=so,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            for line in proc.stderr:
                if line.startswith(_PROGRESS_TAG):
                    frac, _, text = line[len(_PROGRESS_TAG):].rstrip("\n").partition(" ")
                    try:
                        report(float(frac), text)
                    except ValueError:
                        pass
                elif line.strip():
                    tail.append(line.rstrip())
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return rc, tail


def _collect_cases(tmp: str, rc: int, tail, result: dict) -> None:
    """Reads the worker's ``result.json`` and first outputs from ``tmp`` into
    ``result["cases"]``; sets ``result["error"]`` when the worker failed."""
    try:
        with open(os.path.join(tmp, "result.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = None
    if rc != 0 or doc is None:
        why = "\n    ".join(tail) or "(no output)"
        result["error"] = f"subprocess exited with status {rc}:\n    {why}"
    for c in (doc or {}).get("cases", []):
        out = None
        if c.get("out"):
            try:
                out = torch.load(c["out"], weights_only=True)
            except Exception:  # a missing output only costs the difference check
                out = None
        c["out"] = out
        result["cases"][(c["shape"], c["scheme"], c["M"])] = c


def _parse_onednn_verbose(lines, result: dict) -> None:
    """oneDNN's verbose lines (``onednn_verbose,v1,info,cpu,isa:...`` and
    ``...,primitive,exec,cpu,matmul,IMPL,...,src:bf16:...``) -> result's ``onednn_isa`` and
    ``matmul_impl[dtype]``."""
    names = {"bf16": "bf16", "f16": "fp16", "f32": "fp32"}
    for line in lines:
        parts = line.strip().split(",")
        if not parts or not parts[0].endswith("_verbose"):
            continue
        for p in parts:
            if p.startswith("isa:") and result["onednn_isa"] is None:
                result["onednn_isa"] = p[4:]
        if "exec" in parts and "matmul" in parts:  # (the conv's line is not a matmul)
            i = parts.index("matmul")
            impl = parts[i + 1] if i + 1 < len(parts) else "?"
            src = next((p for p in parts if "src:" in p), "")
            dt = src.split("src:", 1)[1].split(":", 1)[0] if src else "?"
            result["matmul_impl"].setdefault(names.get(dt, dt), impl)


def _baseline_worker(argv: Sequence[str]) -> int:
    """Subprocess side of :func:`run_capped_baseline`: reads the job JSON, runs a probe
    GEMM per activation dtype under oneDNN verbose (stdout: which ISA and implementation
    oneDNN uses), then times :func:`baseline_moe` on every case like :func:`run_case`;
    writes ``result.json`` (after every case, so a crash keeps what finished) and each
    case's first output next to the job. Progress lines go to stderr."""
    if len(argv) != 1:
        print(f"usage: python -m cpumoe.bench {_WORKER_FLAG} JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    torch.set_num_threads(int(job["threads"]))
    shapes = [_check_shape(Shape(name, E, topk, K, N)) for name, E, topk, K, N in job["shapes"]]
    schemes, ms, seed = job["schemes"], job["m"], int(job["seed"])
    dtypes = sorted({s if s in DTYPES else job["dtype"] for s in schemes})
    total = len(shapes) * len(schemes) * len(ms)

    def tick(done: float, text: str) -> None:
        sys.stderr.write(f"{_PROGRESS_TAG}{done / max(total, 1):.4f} {text}\n")
        sys.stderr.flush()

    _report_onednn_choice(shapes[0], dtypes)

    cases: List[dict] = []

    def save() -> None:
        tmp = os.path.join(job["dir"], "result.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"cases": cases, "torch_version": torch.__version__}, f)
        os.replace(tmp, os.path.join(job["dir"], "result.json"))

    save()
    done = 0
    for shape in shapes:
        for scheme in schemes:
            dname = scheme if scheme in DTYPES else job["dtype"]
            tick(done, f"{shape.name} {scheme}: generating weights")
            weights = ExpertWeights(shape, dname, seed, pack=False, scheme=scheme)
            for M in ms:
                label = f"{shape.name} {scheme} M={M}: capped eager baseline"
                rec = {"shape": shape.name, "scheme": scheme, "M": M, "error": None}
                try:
                    timed, out = _time_baseline_case(shape, M, weights, seed, job, label,
                                                     lambda f, text, d=done: tick(d + f, text))
                    rec.update(timed)
                    rec["out"] = os.path.join(job["dir"], f"out-{len(cases)}.pt")
                    torch.save(out, rec["out"])
                except Exception as e:  # report it and go on with the next case
                    rec["error"] = f"{type(e).__name__}: {e}"
                cases.append(rec)
                save()
                done += 1
            del weights
            gc.collect()
    tick(total, "done")
    return 0


def _report_onednn_choice(shape: Shape, dtypes: Sequence[str]) -> None:
    """Prints oneDNN's verbose lines to stdout for an fp32 convolution (which always runs in
    oneDNN: its ISA) and one first-layer GEMM of ``shape`` per activation dtype (its
    implementation); the parent reads them (:func:`_parse_onednn_verbose`)."""
    try:
        with torch.no_grad(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            _ = F.conv2d(torch.randn(1, 32, 32, 32), torch.randn(32, 32, 3, 3))
            for d in dtypes:
                a = torch.randn(64, shape.K).to(DTYPES[d])
                _ = a @ torch.randn(2 * shape.N, shape.K).to(DTYPES[d]).T
    except Exception as e:  # only costs the ISA report
        print(f"oneDNN verbose probe failed: {e}", file=sys.stderr)
    sys.stdout.flush()


def _time_baseline_case(shape: Shape, M: int, weights: ExpertWeights, seed: int, job: dict,
                        label: str, report: Callable[[float, str], None]) -> dict:
    g, x, warm = _case_inputs(shape, M, weights.dtype, seed)

    def call_baseline(r: Routing) -> torch.Tensor:
        return baseline_moe(x, weights.w1, weights.w2, r.topk_weights, r.topk_ids)

    with torch.inference_mode():
        gc.collect()
        report(0.0, f"{label} warm-up")
        nb = _iterations(_warm_up(call_baseline, warm), job["iters"], job["min_time"],
                         job["min_iters"], job["max_iters"])
        routings = make_routings(nb, M, shape.E, shape.topk, g)
        times, out, load = _time_calls(call_baseline, routings,
                                       _ticker(report, 0.0, 1.0, nb, label))
    return ({"ms": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3,
             "iters": len(times), "others_cpu_fraction": load.fraction}, out)

