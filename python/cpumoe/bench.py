"""Model-shape benchmark of ``fused_experts`` with roofline figures (``python -m cpumoe bench``).

For every (shape, M) case it times ``cpumoe.fused_experts`` on bf16/fp16 weights packed
once with :func:`cpumoe.convert_weight_packed`, and the PyTorch-eager per-expert loop a
user would otherwise run (:func:`baseline_moe`), and reports each against the two
machine limits of DESIGN.md §5, both measured in the same run:

* streaming-read bandwidth: ``_C.probe_read`` over a buffer several times the
  last-level cache (:func:`measure_read_bandwidth`), measured at the start and again
  at the end of the run;
* fp32 FMA peak of the active tier: ``_C.probe_fma``, a register-only loop on each of
  torch's threads (:func:`measure_fma_peak`).

Routing is decode-realistic: every timed call gets a fresh, pre-generated routing
(random distinct experts per token, softmax-normalised fp32 weights, int32 ids), so
expert weights come from DRAM rather than from cache. cpumoe and the baseline see the
same routings. ``benchmarks/README.md`` describes the method and the output fields.

Importable for tests: :func:`main` (returns 0), :func:`measure_read_bandwidth`,
:func:`measure_fma_peak`, :func:`run_case`, :func:`baseline_moe`, :func:`machine_info`.
Smoke run (seconds): ``main(["--shape", "custom:8,2,256,128", "--m", "1,4", "--iters", "2"])``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import _C
from ._progress import Progress
from .ops import convert_weight_packed, fused_experts

# ---- shapes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One MoE layer: E experts, topk per token, hidden size K, expert intermediate size N
    (w1 is [E, 2N, K], w2 is [E, K, N])."""

    name: str
    E: int
    topk: int
    K: int
    N: int

    def expert_bytes(self, bytes_per_weight: int) -> int:
        """Bytes of one expert's weights (w1 and w2)."""
        return 3 * self.N * self.K * bytes_per_weight


SHAPES: Dict[str, Shape] = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", E=128, topk=8, K=2048, N=768),
    "mixtral-8x7b": Shape("mixtral-8x7b", E=8, topk=2, K=4096, N=14336),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", E=64, topk=6, K=2048, N=1408),
}
DEFAULT_SHAPE = "qwen3-30b-a3b"
DEFAULT_M = (1, 4, 16, 64, 256, 512)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_shapes(spec: str) -> List[Shape]:
    """``qwen3-30b-a3b`` | ``mixtral-8x7b`` | ``deepseek-v2-lite`` | ``all`` |
    ``custom:E,topk,K,N``; several may be given separated by ``+``
    (e.g. ``mixtral-8x7b+custom:8,2,256,128``)."""
    shapes: List[Shape] = []
    for part in spec.split("+"):
        part = part.strip().lower()
        if part == "all":
            shapes.extend(SHAPES.values())
        elif part in SHAPES:
            shapes.append(SHAPES[part])
        elif part.startswith("custom:"):
            try:
                E, topk, K, N = (int(v) for v in part[len("custom:"):].split(","))
            except ValueError:
                raise ValueError(f"bad custom shape '{part}': expected custom:E,topk,K,N "
                                 "(four integers)") from None
            shapes.append(_check_shape(Shape(f"custom-{E}x{topk}-{K}x{N}", E, topk, K, N)))
        else:
            raise ValueError(f"unknown shape '{part}': expected one of "
                             f"{', '.join(SHAPES)}, all, or custom:E,topk,K,N")
    return shapes


def _check_shape(s: Shape) -> Shape:
    if min(s.E, s.topk, s.K, s.N) <= 0:
        raise ValueError(f"{s.name}: E, topk, K and N must be positive")
    if s.topk > s.E:
        raise ValueError(f"{s.name}: topk={s.topk} exceeds E={s.E}")
    if s.K % 32 or s.N % 32:
        # convert_weight_packed needs OC % 16 == 0 and IC % 32 == 0 for w1 [2N, K] and w2 [K, N].
        raise ValueError(f"{s.name}: K and N must be multiples of 32 for the packed layout")
    return s


def _as_shape(shape) -> Shape:
    if isinstance(shape, Shape):
        return _check_shape(shape)
    if isinstance(shape, str):
        shapes = parse_shapes(shape)
        if len(shapes) != 1:
            raise ValueError(f"run_case needs exactly one shape, got '{shape}'")
        return shapes[0]
    E, topk, K, N = shape  # a 4-tuple
    return _check_shape(Shape(f"custom-{E}x{topk}-{K}x{N}", E, topk, K, N))


def _parse_m(text: str) -> List[int]:
    try:
        ms = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--m expects a comma list of integers, got '{text}'")
    if not ms or any(m <= 0 for m in ms):
        raise argparse.ArgumentTypeError(f"--m expects positive integers, got '{text}'")
    return ms


# ---- machine information -----------------------------------------------------------------


def cpu_model_name() -> str:
    """CPU model from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def last_level_cache_bytes() -> Optional[int]:
    """Size of the highest cache level of cpu0 from sysfs (Linux), or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        for entry in os.listdir(base):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(base, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, entry, "size")) as f:
                size = _parse_size(f.read().strip())
            if size and (best is None or level > best[0] or (level == best[0] and size > best[1])):
                best = (level, size)
    except (OSError, ValueError):
        return None
    return best[1] if best else None


def _parse_size(text: str) -> Optional[int]:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in mult:
        return int(text[:-1]) * mult[text[-1].upper()]
    return int(text) if text.isdigit() else None


def _mem_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_busy_fraction(interval: float = 0.25) -> Optional[float]:
    """Fraction of all CPUs' time spent busy over ``interval`` seconds, from /proc/stat
    (Linux), or None. Called while the benchmark itself is idle, it measures the load
    of *other* processes competing for the cores."""

    def snap():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals[:8]), idle

    try:
        t0, i0 = snap()
        time.sleep(interval)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return None if t1 == t0 else max(0.0, 1.0 - (i1 - i0) / (t1 - t0))


class OthersLoad:
    """Context manager: the share of all CPUs' capacity used by *other* processes (and
    stolen by the hypervisor) while the block runs: (busy jiffies of all CPUs from
    /proc/stat + steal - this process's CPU time) / (CPUs x wall time). ``fraction`` is
    None where /proc/stat is unavailable. On a 2-core machine anything above ~0.1 means
    the block's timings are disturbed."""

    def __init__(self):
        self.fraction: Optional[float] = None

    @staticmethod
    def _busy_seconds() -> Optional[float]:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        v += [0] * (8 - len(v))
        user, nice, system, _idle, _iowait, irq, softirq, steal = v
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> "OthersLoad":
        self._busy0 = self._busy_seconds()
        t = os.times()
        self._own0 = t.user + t.system
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy1 = self._busy_seconds()
        t = os.times()
        own = t.user + t.system - self._own0
        wall = time.perf_counter() - self._wall0
        if busy1 is None or self._busy0 is None or wall <= 0:
            return
        ncpu = os.cpu_count() or 1
        # jiffies are coarse (10 ms): clamp small negative noise to 0
        self.fraction = max(0.0, (busy1 - self._busy0 - own) / (ncpu * wall))


def machine_info() -> dict:
    """What ``python -m cpumoe info`` prints, as a dict (also the JSON ``machine`` block)."""
    from . import __version__

    return {
        "cpu_model": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "cpu_features": _C.cpu_features().split(),
        "built_isas": list(_C.built_isas()),
        "best_isa": _C.best_isa(),
        "tier": _C.active_isa(),
        "isa_reason": _C.isa_reason(),
        "cpumoe_isa_env": os.environ.get("CPUMOE_ISA"),
        "cpumoe_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


# ---- machine limits ------------------------------------------------------------------------

_GiB = 1 << 30


def default_read_buffer_bytes() -> int:
    """Buffer for the bandwidth probe: max(1 GiB, 4 x last-level cache), at most a quarter
    of the available memory (and at least 64 MiB)."""
    llc = last_level_cache_bytes() or 0
    size = max(_GiB, 4 * llc)
    avail = _mem_available_bytes()
    if avail:
        size = min(size, max(avail // 4, 64 << 20))
    return size


def _read_bandwidth_samples(buffer_bytes: Optional[int] = None, runs: int = 5,
                            passes: int = 2) -> dict:
    """Streams a buffer of ones with ``_C.probe_read`` on torch's threads: one untimed
    warm-up pass, then ``runs`` timed runs of ``passes`` passes each. Returns the per-run
    GB/s (1e9 bytes/s) and the buffer size."""
    size = int(buffer_bytes) if buffer_bytes else default_read_buffer_bytes()
    workers = min(torch.get_num_threads(), 256)
    per_worker = (size // workers) & ~511  # what cpumoe_probe_read actually streams
    if per_worker <= 0:
        raise ValueError(f"read buffer of {size} bytes is too small for {workers} threads")
    streamed = per_worker * workers * passes
    buf = torch.ones(size, dtype=torch.uint8)
    try:
        _C.probe_read(buf, 1)  # warm-up: TLB, page tables, clock ramp
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            _C.probe_read(buf, passes)
            dt = time.perf_counter() - t0
            samples.append(streamed / dt / 1e9)
    finally:
        del buf
    return {"samples_gbps": samples, "buffer_bytes": size, "passes": passes, "threads": workers}


def measure_read_bandwidth(buffer_bytes: Optional[int] = None, runs: int = 5, passes: int = 2,
                           stat: str = "best") -> float:
    """Streaming-read bandwidth in GB/s (1e9 bytes/s) on torch's current threads.

    ``buffer_bytes`` defaults to :func:`default_read_buffer_bytes` (well above the
    last-level cache, so reads come from DRAM). ``stat`` is ``"best"`` (the default:
    what the machine can do when the shared host is quiet) or ``"median"``.
    """
    s = _read_bandwidth_samples(buffer_bytes, runs, passes)["samples_gbps"]
    return _stat(s, stat)


def _fma_peak_samples(target_seconds: float = 0.3, runs: int = 3) -> dict:
    """Runs ``_C.probe_fma`` (the active tier's register-only fp32 FMA loop, on each of
    torch's threads): a short calibration, then ``runs`` runs of ~``target_seconds``."""
    iters = 1 << 18
    _C.probe_fma(iters)  # wake the threads / vector units up
    while True:
        t0 = time.perf_counter()
        _C.probe_fma(iters)
        dt = time.perf_counter() - t0
        if dt >= 0.02 or iters >= 1 << 40:
            break
        iters *= 4
    iters = max(int(iters * target_seconds / max(dt, 1e-6)), 1)
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        flops = _C.probe_fma(iters)
        dt = time.perf_counter() - t0
        samples.append(flops / dt / 1e9)
    return {"samples_gflops": samples, "iterations": iters, "seconds_per_run": target_seconds}


def measure_fma_peak(target_seconds: float = 0.3, runs: int = 3, stat: str = "best") -> float:
    """fp32 FMA peak of the active tier in GFLOP/s on torch's current threads
    (best of ``runs`` runs of ~``target_seconds`` by default)."""
    return _stat(_fma_peak_samples(target_seconds, runs)["samples_gflops"], stat)


def _stat(samples: Sequence[float], stat: str) -> float:
    if stat == "best":
        return max(samples)
    if stat == "median":
        return statistics.median(samples)
    raise ValueError(f"stat must be 'best' or 'median', got '{stat}'")


# ---- weights, routing, baseline ------------------------------------------------------------


class ExpertWeights:
    """Random expert weights of one shape: unpacked ``w1 [E, 2N, K]``, ``w2 [E, K, N]``
    (for the baseline) and their packed copies ``w1p``, ``w2p`` (for cpumoe).

    Values are normal with std 1/sqrt(K) (w1) and 1/sqrt(N) (w2), so activations stay
    O(1) and fp16 does not overflow. For speed they are copied from a 16 Mi-value random
    pool at random offsets; values do not affect timing.
    """

    def __init__(self, shape: Shape, dtype: str = "bf16", seed: int = 0, pack: bool = True):
        self.shape = shape
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        g = torch.Generator().manual_seed(seed)
        E, K, N = shape.E, shape.K, shape.N
        self.w1 = torch.empty(E, 2 * N, K, dtype=self.dtype)
        self.w2 = torch.empty(E, K, N, dtype=self.dtype)
        _fill_random(self.w1, 1.0 / math.sqrt(K), g)
        _fill_random(self.w2, 1.0 / math.sqrt(N), g)
        self.w1p = convert_weight_packed(self.w1) if pack else None
        self.w2p = convert_weight_packed(self.w2) if pack else None

    @property
    def bytes_per_weight(self) -> int:
        return self.w1.element_size()


def _fill_random(t: torch.Tensor, std: float, g: torch.Generator, pool_elems: int = 1 << 24) -> None:
    flat = t.view(-1)
    n = flat.numel()
    pool = torch.empty(min(pool_elems, n), dtype=t.dtype).normal_(0.0, std, generator=g)
    P = pool.numel()
    pos = 0
    while pos < n:
        off = int(torch.randint(P, (1,), generator=g))
        take = min(P - off, n - pos)
        flat[pos:pos + take].copy_(pool[off:off + take])
        pos += take


@dataclass
class Routing:
    topk_weights: torch.Tensor  # [M, topk] float32, softmax-normalised
    topk_ids: torch.Tensor  # [M, topk] int32, distinct experts per token


def make_routings(count: int, M: int, E: int, topk: int, generator: torch.Generator) -> List[Routing]:
    """``count`` independent decode-style routings: per token, ``topk`` distinct random
    experts (topk of uniform random scores) with softmax-normalised fp32 weights."""
    out = []
    for _ in range(count):
        ids = torch.rand(M, E, generator=generator).topk(topk, dim=1).indices.to(torch.int32)
        w = torch.randn(M, topk, generator=generator).softmax(dim=1)
        out.append(Routing(w.contiguous(), ids.contiguous()))
    return out


def baseline_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """What a user runs in PyTorch eager without cpumoe (HF transformers' Mixtral /
    Qwen-MoE block): a loop over the experts that received tokens, in the activation
    dtype, with unpacked weights ``w1 [E, 2N, K]``, ``w2 [E, K, N]``."""
    N = w2.shape[2]
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token, slot = torch.where(ids == e)
        h = x[token] @ w1[e].T  # [T, 2N]
        a = F.silu(h[:, :N]) * h[:, N:]
        y = a @ w2[e].T  # [T, K]
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


# ---- one case ----------------------------------------------------------------------------------


def _timed(fn: Callable, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _iterations(t_est: float, iters: Optional[int], min_time: float, min_iters: int,
                max_iters: int) -> int:
    """``iters`` if given; else enough calls for ``min_time`` seconds, at least ``min_iters``
    unless that would take over 4 x ``min_time`` (very slow calls, e.g. the eager baseline on
    a contended machine: then as many as fit, at least 1), at most ``max_iters``."""
    if iters:
        return int(iters)
    t = max(t_est, 1e-9)
    n = math.ceil(min_time / t)
    if min_iters * t <= 4 * min_time:
        n = max(n, min_iters)
    else:
        n = max(1, math.floor(4 * min_time / t))
    return int(min(n, max_iters))


def run_case(
    shape,
    M: int,
    *,
    dtype: str = "bf16",
    weights: Optional[ExpertWeights] = None,
    iters: Optional[int] = None,
    min_time: float = 1.0,
    min_iters: int = 3,
    max_iters: int = 200,
    baseline: bool = True,
    read_gbps: Optional[float] = None,
    fma_peak_gflops: Optional[float] = None,
    seed: int = 0,
    progress: Optional[Callable[[float, str], None]] = None,
) -> dict:
    """Times one (shape, M) case and returns its JSON record.

    ``shape`` is a :class:`Shape`, a name accepted by :func:`parse_shapes` or a tuple
    ``(E, topk, K, N)``. ``weights`` (an :class:`ExpertWeights` of that shape and dtype)
    is created if not given. Each call gets a fresh pre-generated routing; the number of
    timed calls is ``iters`` if given, else enough for ``min_time`` seconds, clamped to
    ``[min_iters, max_iters]`` (estimated from the warm-up). The baseline uses the same
    routings (a prefix, when it is slower). ``ms`` is the median. Fractions and the
    bound are filled in when ``read_gbps`` / ``fma_peak_gflops`` are given, else None.
    ``progress(fraction_of_case, text)`` is called as the case advances.
    """
    shape = _as_shape(shape)
    if M <= 0:
        raise ValueError(f"M must be positive, got {M}")
    if weights is None:
        weights = ExpertWeights(shape, dtype, seed)
    tdtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[tdtype]
    if weights.dtype != tdtype or weights.w1.shape != (shape.E, 2 * shape.N, shape.K):
        raise ValueError("weights do not match the case's shape and dtype")
    E, topk, K, N = shape.E, shape.topk, shape.K, shape.N
    report = progress or (lambda frac, text: None)
    label = f"{shape.name} M={M}"

    g = torch.Generator().manual_seed(seed * 1_000_003 + M)
    x = torch.randn(M, K, generator=g).to(tdtype)
    warm = make_routings(3, M, E, topk, g)

    def call_cpumoe(r: Routing) -> torch.Tensor:
        return fused_experts(x, weights.w1p, weights.w2p, r.topk_weights, r.topk_ids, is_vnni=True)

    def call_baseline(r: Routing) -> torch.Tensor:
        return baseline_moe(x, weights.w1, weights.w2, r.topk_weights, r.topk_ids)

    def warm_up(fn) -> float:
        # Untimed calls on their own routings: allocations, page faults, oneDNN's JIT for
        # the baseline's GEMM shapes. Up to 3 calls while they total under 0.5 s; the last
        # one estimates the per-call time.
        spent = 0.0
        for r in warm:
            t, _ = _timed(fn, r)
            spent += t
            if spent >= 0.5:
                break
        return t

    share = 0.5 if baseline else 1.0
    with torch.inference_mode():
        gc.collect()
        report(0.0, f"{label}: cpumoe warm-up")
        n = _iterations(warm_up(call_cpumoe), iters, min_time, min_iters, max_iters)
        routings = make_routings(n, M, E, topk, g)
        times: List[float] = []
        out_c = None
        with OthersLoad() as load_c:
            for i, r in enumerate(routings):
                t, out = _timed(call_cpumoe, r)
                times.append(t)
                if i == 0:
                    out_c = out
                report(share * (i + 1) / n, f"{label}: cpumoe {i + 1}/{n}")

        base_times: List[float] = []
        rel_diff = None
        load_b = OthersLoad()
        if baseline:
            report(share, f"{label}: eager baseline warm-up")
            nb = min(_iterations(warm_up(call_baseline), iters, min_time, min_iters, max_iters), n)
            out_b = None
            with OthersLoad() as load_b:
                for i, r in enumerate(routings[:nb]):
                    t, out = _timed(call_baseline, r)
                    base_times.append(t)
                    if i == 0:
                        out_b = out
                    report(share + share * (i + 1) / nb,
                           f"{label}: eager baseline {i + 1}/{nb}")
            ref = out_b.float()
            rel_diff = float((out_c.float() - ref).norm() / ref.norm().clamp_min(1e-30))

    distinct = statistics.fmean(int(torch.unique(r.topk_ids).numel()) for r in routings)
    weight_bytes = distinct * shape.expert_bytes(weights.bytes_per_weight)
    flops = 2.0 * M * topk * 3 * N * K
    sec = statistics.median(times)
    rec = {
        "shape": shape.name, "E": E, "topk": topk, "K": K, "N": N, "M": M, "dtype": dname,
        "ms": sec * 1e3,
        "ms_min": min(times) * 1e3,
        "iters": len(times),
        "distinct_experts": distinct,
        "weight_bytes": weight_bytes,
        "gbps": weight_bytes / sec / 1e9,
        "bw_fraction": None,
        "flops": flops,
        "gflops": flops / sec / 1e9,
        "peak_fraction": None,
        "bound": None,
        "bound_fraction": None,
        "baseline_ms": statistics.median(base_times) * 1e3 if base_times else None,
        "baseline_iters": len(base_times) if base_times else None,
        "speedup": (statistics.median(base_times) / sec) if base_times else None,
        "rel_diff_vs_baseline": rel_diff,
        "others_cpu_fraction": load_c.fraction,
        "baseline_others_cpu_fraction": load_b.fraction,
    }
    if read_gbps:
        rec["bw_fraction"] = rec["gbps"] / read_gbps
    if fma_peak_gflops:
        rec["peak_fraction"] = rec["gflops"] / fma_peak_gflops
    if read_gbps and fma_peak_gflops:
        t_bw = weight_bytes / (read_gbps * 1e9)
        t_fl = flops / (fma_peak_gflops * 1e9)
        rec["bound"] = "bandwidth" if t_bw >= t_fl else "compute"
        rec["bound_fraction"] = max(t_bw, t_fl) / sec
    return rec


# ---- output --------------------------------------------------------------------------------

_COLUMNS = [
    # header, width, formatter(record)
    ("shape", 17, lambda r: r["shape"]),
    ("M", 5, lambda r: str(r["M"])),
    ("ms", 9, lambda r: f"{r['ms']:.2f}"),
    ("wt MB", 8, lambda r: f"{r['weight_bytes'] / 1e6:.0f}"),
    ("GB/s", 7, lambda r: f"{r['gbps']:.1f}"),
    ("%bw", 5, lambda r: _pct(r["bw_fraction"])),
    ("GFLOP/s", 8, lambda r: f"{r['gflops']:.1f}"),
    ("%peak", 6, lambda r: _pct(r["peak_fraction"])),
    ("bound", 6, lambda r: {"bandwidth": "bw", "compute": "flop"}.get(r["bound"], "-")),
    ("%bound", 7, lambda r: _pct(r["bound_fraction"])),
    ("eager ms", 10, lambda r: "-" if r["baseline_ms"] is None else f"{r['baseline_ms']:.2f}"),
    ("speedup", 8, lambda r: "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"),
    ("others", 7, lambda r: _others(r)),
]

NOISY = 0.10  # others' share of the CPUs above which a row is flagged


def case_others_fraction(rec: dict) -> Optional[float]:
    """Largest share of the CPUs used by other processes while the case was timed."""
    vals = [v for v in (rec.get("others_cpu_fraction"), rec.get("baseline_others_cpu_fraction"))
            if v is not None]
    return max(vals) if vals else None


def _others(rec: dict) -> str:
    v = case_others_fraction(rec)
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" + ("*" if v > NOISY else "")


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def format_header_row() -> str:
    cells = [h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w, _) in enumerate(_COLUMNS)]
    return " ".join(cells)


def format_row(rec: dict) -> str:
    cells = [f(rec).ljust(w) if i == 0 else f(rec).rjust(w) for i, (_, w, f) in enumerate(_COLUMNS)]
    return " ".join(cells)


def _fmt_bytes(n: float) -> str:
    return f"{n / _GiB:.2f} GiB" if n >= _GiB else f"{n / (1 << 20):.0f} MiB"


# ---- CLI -----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shape", default=DEFAULT_SHAPE,
                   help="qwen3-30b-a3b (default), mixtral-8x7b, deepseek-v2-lite, all, or "
                        "custom:E,topk,K,N; join several with '+'")
    p.add_argument("--m", type=_parse_m, default=list(DEFAULT_M), metavar="M,M,...",
                   help="token counts (default: %s)" % ",".join(map(str, DEFAULT_M)))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="activation and weight dtype (default bf16)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N) first (default: keep torch's, %d here)"
                        % torch.get_num_threads())
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per case (default: enough for --min-time)")
    p.add_argument("--min-time", type=float, default=2.0, metavar="SEC",
                   help="seconds of timed calls per case and implementation when --iters is "
                        "not given; at least 3 calls (fewer if they would take over 4x this), "
                        "at most 200 (default 2.0)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the PyTorch eager per-expert baseline")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write a JSON document to PATH ('-' = stdout; the table then "
                        "goes to stderr)")
    p.add_argument("--progress", action="store_true",
                   help="show the progress bar even if stderr is not a terminal")
    p.add_argument("--bw-mib", type=int, default=None, metavar="MiB",
                   help="buffer of the bandwidth probe (default max(1 GiB, 4 x LLC))")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and routings")
    return p


def build_parser(prog: str = "python -m cpumoe bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Time cpumoe.fused_experts on MoE model shapes against the machine's "
                    "measured streaming-read bandwidth and fp32 FMA peak, and against the "
                    "PyTorch eager per-expert loop.")
    return add_arguments(p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m cpumoe bench``; returns 0 on success."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        shapes = parse_shapes(args.shape)
    except ValueError as e:
        parser.error(str(e))
    if args.iters is not None and args.iters <= 0:
        parser.error("--iters must be positive")
    if args.threads is not None:
        if args.threads <= 0:
            parser.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    return run(args, shapes)


def run(args: argparse.Namespace, shapes: List[Shape]) -> int:
    t_start = time.perf_counter()
    json_stdout = args.json == "-"
    out = sys.stderr if json_stdout else sys.stdout  # the human-readable table
    show_bar = args.progress or (not json_stdout and sys.stderr.isatty())
    total_cases = len(shapes) * len(args.m)
    # budget: 1 unit per case, plus 0.5 for the limits at the start and 0.25 at the end
    bar = Progress(total_cases + 0.75, enabled=show_bar)

    def emit(line: str = "") -> None:
        bar.write(line, out)

    info = machine_info()
    busy0 = cpu_busy_fraction()
    bw_bytes = args.bw_mib << 20 if args.bw_mib else None
    try:
        bar.update(0.0, "measuring streaming-read bandwidth", force=True)
        bw0 = _read_bandwidth_samples(bw_bytes)
        bar.update(0.3, "measuring fp32 FMA peak", force=True)
        fma = _fma_peak_samples()
        read_gbps = max(bw0["samples_gbps"])
        peak = max(fma["samples_gflops"])
        bar.update(0.5, "limits measured")

        emit(f"cpumoe {info['cpumoe_version']} bench: tier {info['tier']}, {info['threads']} "
             f"threads, {args.dtype}, torch {info['torch_version']}")
        emit(f"CPU: {info['cpu_model']} ({info['logical_cpus']} logical CPUs"
             + (f", LLC {_fmt_bytes(info['last_level_cache_bytes'])}"
                if info["last_level_cache_bytes"] else "") + ")")
        emit(f"tier: {info['isa_reason']}")
        emit(f"streaming read: {read_gbps:.1f} GB/s (best of {len(bw0['samples_gbps'])} runs x "
             f"{bw0['passes']} passes over {_fmt_bytes(bw0['buffer_bytes'])}; median "
             f"{statistics.median(bw0['samples_gbps']):.1f})")
        emit(f"fp32 FMA peak:  {peak:.0f} GFLOP/s (best of {len(fma['samples_gflops'])} runs "
             f"of ~{fma['seconds_per_run']} s; median "
             f"{statistics.median(fma['samples_gflops']):.0f})")
        if busy0 is not None and busy0 > 0.1:
            emit(f"WARNING: other processes kept the CPUs {100 * busy0:.0f}% busy just before "
                 "the run; figures will be noisy")
        emit("fresh random routing on every call (weights come from DRAM); ms = median; "
             "%bw, %peak, %bound vs the limits above;")
        emit("others = share of the CPUs used by other processes while the case was timed")
        emit()
        emit(format_header_row())

        cases: List[dict] = []
        done = 0
        for shape in shapes:
            bar.update(0.5 + done, f"{shape.name}: generating and packing weights", force=True)
            weights = ExpertWeights(shape, args.dtype, args.seed)
            for M in args.m:
                rec = run_case(
                    shape, M, dtype=args.dtype, weights=weights, iters=args.iters,
                    min_time=args.min_time, baseline=not args.no_baseline,
                    read_gbps=read_gbps, fma_peak_gflops=peak, seed=args.seed,
                    progress=lambda f, text, d=done: bar.update(0.5 + d + f, text))
                cases.append(rec)
                emit(format_row(rec))
                done += 1
                bar.update(0.5 + done)
            del weights
            gc.collect()

        bar.update(0.5 + done, "re-measuring streaming-read bandwidth", force=True)
        bw1 = _read_bandwidth_samples(bw_bytes)
        read_end = max(bw1["samples_gbps"])
        busy1 = cpu_busy_fraction()
        bar.update(0.75 + done)
        wall = time.perf_counter() - t_start
        emit()
        drift = (read_end - read_gbps) / read_gbps
        emit(f"streaming read at the end: {read_end:.1f} GB/s (start {read_gbps:.1f}, "
             f"{100 * drift:+.0f}%){'  -- the machine was noisy' if abs(drift) > 0.1 else ''}")
        noisy = [c for c in cases if (case_others_fraction(c) or 0) > NOISY]
        if noisy:
            emit(f"* {len(noisy)} case(s) ran while other processes used more than "
                 f"{100 * NOISY:.0f}% of the CPUs (column 'others'); rerun them on a quiet machine")
        diffs = [c["rel_diff_vs_baseline"] for c in cases if c["rel_diff_vs_baseline"] is not None]
        if diffs:
            emit(f"cpumoe vs eager baseline: max relative L2 difference {max(diffs):.1e}"
                 + ("  -- LARGER THAN EXPECTED" if max(diffs) > 5e-2 else ""))
        if busy1 is not None and busy1 > 0.1:
            emit(f"WARNING: other processes kept the CPUs {100 * busy1:.0f}% busy at the end "
                 "of the run; figures may be noisy")
        emit(f"total wall time: {wall:.1f} s")
    except KeyboardInterrupt:
        bar.close()
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        bar.close()

    machine = dict(info)
    machine.update({
        "read_gbps": read_gbps,
        "read_gbps_end": read_end,
        "read_statistic": "best of runs",
        "read_samples_gbps": bw0["samples_gbps"],
        "read_samples_gbps_end": bw1["samples_gbps"],
        "read_buffer_bytes": bw0["buffer_bytes"],
        "read_passes_per_run": bw0["passes"],
        "cpu_busy_before": busy0,
        "cpu_busy_after": busy1,
        "fma_peak_gflops": peak,
        "fma_statistic": "best of runs",
        "fma_samples_gflops": fma["samples_gflops"],
    })
    doc = {
        "machine": machine,
        "settings": {
            "shapes": [s.name for s in shapes], "m": args.m, "dtype": args.dtype,
            "iters": args.iters, "min_time": args.min_time, "baseline": not args.no_baseline,
            "seed": args.seed, "timing": "median of per-call wall time, fresh routing per call",
        },
        "cases": cases,
        "wall_seconds": wall,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.json:
        text = json.dumps(doc, indent=2)
        if json_stdout:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
