"""Model-shape benchmark of ``fused_experts`` with roofline figures (``python -m cpumoe bench``).

For every (shape, weight scheme, M) case it times ``cpumoe.fused_experts`` on weights
packed once with :func:`cpumoe.convert_weight_packed`, and the PyTorch code a user would
otherwise run, and reports each against the machine limits of DESIGN.md §5, all measured
in the same run:

* streaming-read bandwidth: ``_C.probe_read`` over a buffer several times the
  last-level cache (:func:`measure_read_bandwidth`), measured at the start and again
  at the end of the run;
* fp32 FMA peak of the active tier: ``_C.probe_fma``, a register-only loop on each of
  torch's threads (:func:`measure_fma_peak`); the ceiling of the bf16/fp16 schemes;
* u8*s8 peak of the active tier: ``_C.probe_int8``, the same kind of loop of u8*s8 dot
  products (VNNI where the tier has it) (:func:`measure_int8_peak`); the ceiling of the
  int8 scheme (INT8 W8A8, ``moe_comp_method=1``), measured only when it is benchmarked.

Weight schemes (``--scheme``): ``bf16`` / ``fp16`` (weights and activations in that
dtype) and ``int8`` (weights from :func:`cpumoe.quant.quantize_int8_per_channel` of the
random float weights, activations in ``--dtype``).

Baselines: the eager per-expert loop in the activation dtype (:func:`baseline_moe`; for
int8 over the dequantized weights); for int8 also a per-expert loop over
``torch._weight_int8pack_mm`` (:func:`baseline_int8pack_moe`) where torch has it; and,
with ``--baseline-isa NAME``, the eager loop again in a subprocess started with
``ONEDNN_MAX_CPU_ISA=NAME`` (:func:`run_capped_baseline`), e.g. ``avx512_core_vnni`` to see
what the eager code does on a CPU without AVX512-BF16 and AMX.

Routing is decode-realistic: every timed call gets a fresh, pre-generated routing
(random distinct experts per token, softmax-normalised fp32 weights, int32 ids), so
expert weights come from DRAM rather than from cache. cpumoe and the baselines see the
same routings (the subprocess regenerates them from the seed). ``benchmarks/README.md``
describes the method and the output fields.

Importable for tests: :func:`main` (returns 0), :func:`measure_read_bandwidth`,
:func:`measure_fma_peak`, :func:`measure_int8_peak`, :func:`run_case`,
:func:`baseline_moe`, :func:`baseline_int8pack_moe`, :func:`run_capped_baseline`,
:func:`machine_info`. Smoke run (seconds):
``main(["--shape", "custom:8,2,256,128", "--scheme", "bf16,int8", "--m", "1,4", "--iters", "2"])``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import _C
from ._progress import Progress
from .ops import MoeCompMethod, convert_weight_packed, fused_experts
from .quant import quantize_fp8_blockwise, quantize_int8_per_channel

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
SCHEMES = ("bf16", "fp16", "int8", "fp8")  # float weights in a dtype, INT8 W8A8, FP8 W8A16
FP8_BLOCK = (128, 128)  # DeepSeek-V3 style weight_block_size of the fp8 scheme


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        return dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


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


def parse_schemes(text: str) -> List[str]:
    """Comma list of weight schemes (``bf16``, ``fp16``, ``int8``), duplicates dropped."""
    out: List[str] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part not in SCHEMES:
            raise argparse.ArgumentTypeError(
                f"unknown scheme '{part}': expected a comma list of {', '.join(SCHEMES)}")
        if part not in out:
            out.append(part)
    if not out:
        raise argparse.ArgumentTypeError("--scheme expects at least one scheme")
    return out


def _parse_m(text: str) -> List[int]:
    try:
        ms = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--m expects a comma list of integers, got '{text}'") from None
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
    None where /proc/stat is unavailable or the block took under ``MIN_WALL`` seconds (the
    counters tick every 10 ms, too coarse for shorter blocks). On a 2-core machine anything
    above ~0.1 means the block's timings are disturbed."""

    MIN_WALL = 0.2

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
        if busy1 is None or self._busy0 is None or wall < self.MIN_WALL:
            return
        ncpu = os.cpu_count() or 1
        # jiffies are coarse (10 ms): clamp the noise into [0, 1]
        self.fraction = min(1.0, max(0.0, (busy1 - self._busy0 - own) / (ncpu * wall)))


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


def _probe_rate_samples(probe: Callable[[int], float], target_seconds: float,
                        runs: int) -> dict:
    """Times a register-only probe ``probe(iterations) -> operations done in total`` (on each
    of torch's threads): a short calibration, then ``runs`` runs of ~``target_seconds``.
    Returns the per-run rates in 1e9 operations/s."""
    iters = 1 << 18
    probe(iters)  # wake the threads / vector units up
    while True:
        t0 = time.perf_counter()
        probe(iters)
        dt = time.perf_counter() - t0
        if dt >= 0.02 or iters >= 1 << 40:
            break
        iters *= 4
    iters = max(int(iters * target_seconds / max(dt, 1e-6)), 1)
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        ops = probe(iters)
        dt = time.perf_counter() - t0
        samples.append(ops / dt / 1e9)
    return {"samples": samples, "iterations": iters, "seconds_per_run": target_seconds}


def _fma_peak_samples(target_seconds: float = 0.3, runs: int = 3) -> dict:
    """Runs ``_C.probe_fma`` (the active tier's register-only fp32 FMA loop, on each of
    torch's threads): a short calibration, then ``runs`` runs of ~``target_seconds``."""
    r = _probe_rate_samples(_C.probe_fma, target_seconds, runs)
    return {"samples_gflops": r["samples"], "iterations": r["iterations"],
            "seconds_per_run": target_seconds}


def _int8_peak_samples(target_seconds: float = 0.3, runs: int = 3) -> dict:
    """Runs ``_C.probe_int8`` (the active tier's register-only loop of u8*s8 dot products,
    VNNI where the tier has it, 2 ops per multiply-add, on each of torch's threads) like
    :func:`_fma_peak_samples`."""
    r = _probe_rate_samples(_C.probe_int8, target_seconds, runs)
    return {"samples_gops": r["samples"], "iterations": r["iterations"],
            "seconds_per_run": target_seconds}


def measure_fma_peak(target_seconds: float = 0.3, runs: int = 3, stat: str = "best") -> float:
    """fp32 FMA peak of the active tier in GFLOP/s on torch's current threads
    (best of ``runs`` runs of ~``target_seconds`` by default)."""
    return _stat(_fma_peak_samples(target_seconds, runs)["samples_gflops"], stat)


def measure_int8_peak(target_seconds: float = 0.3, runs: int = 3, stat: str = "best") -> float:
    """u8*s8 multiply-add peak of the active tier in GOP/s (2 ops per multiply-add) on
    torch's current threads (best of ``runs`` runs of ~``target_seconds`` by default)."""
    return _stat(_int8_peak_samples(target_seconds, runs)["samples_gops"], stat)


def _stat(samples: Sequence[float], stat: str) -> float:
    if stat == "best":
        return max(samples)
    if stat == "median":
        return statistics.median(samples)
    raise ValueError(f"stat must be 'best' or 'median', got '{stat}'")


# ---- weights, routing, baseline ------------------------------------------------------------


class ExpertWeights:
    """Random expert weights of one shape and weight scheme: unpacked ``w1 [E, 2N, K]``,
    ``w2 [E, K, N]`` in the activation dtype (for the eager baseline) and the packed
    copies ``w1p``, ``w2p`` cpumoe reads.

    Values are normal with std 1/sqrt(K) (w1) and 1/sqrt(N) (w2), so activations stay
    O(1) and fp16 does not overflow. For speed they are copied from a 16 Mi-value random
    pool at random offsets; values do not affect timing.

    ``scheme`` is ``"bf16"`` / ``"fp16"`` (weights in that dtype, which is then also the
    activation dtype; the default is ``dtype``'s) or ``"int8"``: the float weights in
    ``dtype`` are quantized per expert with :func:`cpumoe.quant.quantize_int8_per_channel`
    into ``q1``, ``q2`` (int8, unpacked) and ``s1 [E, 2N, 1]``, ``s2 [E, K, 1]`` (fp32);
    ``w1``/``w2`` then hold the dequantized weights ``q * s`` in ``dtype`` and ``w1p``/
    ``w2p`` the packed int8 weights (``[E, OC, IC + 4]``).
    """

    def __init__(self, shape: Shape, dtype: str = "bf16", seed: int = 0, pack: bool = True,
                 scheme: Optional[str] = None):
        self.shape = shape
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.scheme = scheme or _dtype_name(self.dtype)
        if self.scheme in DTYPES:
            self.dtype = DTYPES[self.scheme]
        elif self.scheme not in ("int8", "fp8"):
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got '{scheme}'")
        g = torch.Generator().manual_seed(seed)
        E, K, N = shape.E, shape.K, shape.N
        self.w1 = torch.empty(E, 2 * N, K, dtype=self.dtype)
        self.w2 = torch.empty(E, K, N, dtype=self.dtype)
        _fill_random(self.w1, 1.0 / math.sqrt(K), g)
        _fill_random(self.w2, 1.0 / math.sqrt(N), g)
        self.q1 = self.q2 = self.s1 = self.s2 = None
        if self.scheme == "int8":
            self.q1, self.s1 = _quantize_experts(self.w1)
            self.q2, self.s2 = _quantize_experts(self.w2)
            packed = (self.q1, self.q2)
        elif self.scheme == "fp8":
            self.q1, self.s1 = _quantize_experts(self.w1, fp8=True)
            self.q2, self.s2 = _quantize_experts(self.w2, fp8=True)
            packed = (self.q1, self.q2)
        else:
            packed = (self.w1, self.w2)
        self.w1p = convert_weight_packed(packed[0]) if pack else None
        self.w2p = convert_weight_packed(packed[1]) if pack else None

    @property
    def is_int8(self) -> bool:
        return self.scheme == "int8"

    @property
    def is_fp8(self) -> bool:
        return self.scheme == "fp8"

    @property
    def bytes_per_weight(self) -> int:
        return 1 if self.is_int8 or self.is_fp8 else self.w1.element_size()

    def expert_bytes(self) -> int:
        """Bytes cpumoe reads per expert touched: 3·N·K weights, plus for int8 an fp32
        scale per output channel and the packed layout's 4-byte compensation per row
        (2N + K rows of w1 and w2)."""
        n = self.shape.expert_bytes(self.bytes_per_weight)
        if self.is_int8:
            n += (4 + 4) * (2 * self.shape.N + self.shape.K)
        if self.is_fp8:  # one fp32 scale per 128 x 128 block
            n += 4 * (self.s1[0].numel() + self.s2[0].numel())
        return n


def _quantize_experts(w: torch.Tensor, fp8: bool = False):
    """Per expert: int8 weights and fp32 scales [E, OC, 1] of ``w [E, OC, IC]`` (or, with
    ``fp8``, float8_e4m3fn weights and fp32 block scales [E, OC/128, IC/128]); ``w`` is
    overwritten with its dequantized values (rounded to its dtype). One expert at a time,
    so the fp32 temporaries stay small."""
    E, OC, IC = w.shape
    if fp8:
        bn, bk = FP8_BLOCK
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(E, -(-OC // bn), -(-IC // bk), dtype=torch.float32)
    else:
        q = torch.empty(w.shape, dtype=torch.int8)
        s = torch.empty(E, OC, 1, dtype=torch.float32)
    for e in range(E):
        qe, se = quantize_fp8_blockwise(w[e], FP8_BLOCK) if fp8 else quantize_int8_per_channel(w[e])
        q[e].copy_(qe)
        s[e].copy_(se)
        full = se.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[:OC, :IC] if fp8 else se
        w[e].copy_(qe.float() * full)
    return q, s


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


def _per_expert_loop(x: torch.Tensor, N: int, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, mm1, mm2) -> torch.Tensor:
    """The eager MoE loop over the experts that received tokens (HF transformers' Mixtral /
    Qwen-MoE block): ``h = mm1(e, rows)``, ``y = mm2(e, silu(gate) * up)``, weighted, summed."""
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token, slot = torch.where(ids == e)
        h = mm1(e, x[token])  # [T, 2N]
        y = mm2(e, F.silu(h[:, :N]) * h[:, N:])  # [T, K]
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def baseline_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """What a user runs in PyTorch eager without cpumoe: the per-expert loop in the
    activation dtype, with unpacked weights ``w1 [E, 2N, K]``, ``w2 [E, K, N]``."""
    return _per_expert_loop(x, w2.shape[2], topk_weights, topk_ids,
                            lambda e, a: a @ w1[e].T, lambda e, a: a @ w2[e].T)


def baseline_int8pack_moe(x: torch.Tensor, q1: torch.Tensor, s1: torch.Tensor,
                          q2: torch.Tensor, s2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """The same per-expert loop as :func:`baseline_moe` with both GEMMs done by
    ``torch._weight_int8pack_mm(A [T, K], B int8 [OC, K], scales [OC])`` (torch's
    weight-only int8 matmul; activations stay in ``x``'s dtype): ``q1 [E, 2N, K]``,
    ``q2 [E, K, N]`` int8, ``s1 [E, 2N]``, ``s2 [E, K]`` in ``x``'s dtype."""
    return _per_expert_loop(x, q2.shape[2], topk_weights, topk_ids,
                            lambda e, a: torch._weight_int8pack_mm(a, q1[e], s1[e]),
                            lambda e, a: torch._weight_int8pack_mm(a, q2[e], s2[e]))


_INT8PACK_REASON: Dict[torch.dtype, Optional[str]] = {}


def int8pack_unavailable(dtype) -> Optional[str]:
    """None when ``torch._weight_int8pack_mm`` works here for activations of ``dtype``
    (checked once on a tiny product), else why not."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if dtype not in _INT8PACK_REASON:
        reason = None
        try:
            fn = getattr(torch, "_weight_int8pack_mm", None)
            if fn is None:
                reason = f"torch {torch.__version__} has no torch._weight_int8pack_mm"
            else:
                a = torch.ones(2, 64, dtype=dtype)
                b = torch.full((32, 64), 2, dtype=torch.int8)
                y = fn(a, b, torch.full((32,), 0.5, dtype=dtype))
                if tuple(y.shape) != (2, 32) or not bool((y.float() == 64).all()):
                    reason = "torch._weight_int8pack_mm gave a wrong result on a test product"
        except Exception as e:  # any failure means "not usable here"
            reason = f"torch._weight_int8pack_mm: {type(e).__name__}: {str(e).splitlines()[0]}"
        _INT8PACK_REASON[dtype] = reason
    return _INT8PACK_REASON[dtype]


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


def _case_inputs(shape: Shape, M: int, dtype: torch.dtype, seed: int):
    """The case's hidden states ``x [M, K]``, its 3 warm-up routings and the generator,
    positioned where the timed routings start (``make_routings(n, ..., g)``; the first
    ``nb`` of them do not depend on ``n``). Depends only on (seed, M, shape, dtype): every
    scheme and the capped-baseline subprocess see the same inputs and routings."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + M)
    x = torch.randn(M, shape.K, generator=g).to(dtype)
    warm = make_routings(3, M, shape.E, shape.topk, g)
    return g, x, warm


def _warm_up(fn: Callable, warm: List[Routing]) -> float:
    """Untimed calls on their own routings: allocations, page faults, oneDNN's JIT for the
    baseline's GEMM shapes. Up to 3 calls while they total under 0.5 s; returns the last
    one's time (the per-call estimate)."""
    spent = 0.0
    for r in warm:
        t, _ = _timed(fn, r)
        spent += t
        if spent >= 0.5:
            break
    return t


def _time_calls(fn: Callable, routings: List[Routing], tick: Callable[[int], None]):
    """Times ``fn`` alone on each routing; returns (seconds per call, the first output,
    the :class:`OthersLoad` of the loop). ``tick(i)`` after call ``i``."""
    times: List[float] = []
    first = None
    with OthersLoad() as load:
        for i, r in enumerate(routings):
            t, out = _timed(fn, r)
            times.append(t)
            if i == 0:
                first = out
            tick(i)
    return times, first, load


def _ticker(report: Callable[[float, str], None], lo: float, width: float, n: int,
            text: str) -> Callable[[int], None]:
    return lambda i: report(lo + width * (i + 1) / n, f"{text} {i + 1}/{n}")


def _rel_diff(out: torch.Tensor, ref: Optional[torch.Tensor]) -> Optional[float]:
    if ref is None:
        return None
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run_case(
    shape,
    M: int,
    *,
    dtype: str = "bf16",
    scheme: Optional[str] = None,
    weights: Optional[ExpertWeights] = None,
    iters: Optional[int] = None,
    min_time: float = 1.0,
    min_iters: int = 3,
    max_iters: int = 200,
    baseline: bool = True,
    int8pack: bool = True,
    capped: Optional[dict] = None,
    read_gbps: Optional[float] = None,
    fma_peak_gflops: Optional[float] = None,
    int8_peak_gops: Optional[float] = None,
    seed: int = 0,
    progress: Optional[Callable[[float, str], None]] = None,
) -> dict:
    """Times one (shape, scheme, M) case and returns its JSON record.

    ``shape`` is a :class:`Shape`, a name accepted by :func:`parse_shapes` or a tuple
    ``(E, topk, K, N)``. ``scheme`` is ``"bf16"``/``"fp16"`` (weights and activations in
    that dtype; overrides ``dtype``) or ``"int8"`` (INT8 W8A8, ``moe_comp_method=1``,
    activations in ``dtype``); default: ``weights.scheme``, else ``dtype``. ``weights``
    (an :class:`ExpertWeights` of that shape, scheme and dtype) is created if not given.
    Each call gets a fresh pre-generated routing; the number of timed calls is ``iters``
    if given, else enough for ``min_time`` seconds, clamped to ``[min_iters, max_iters]``
    (estimated from the warm-up). The baselines (``baseline``: the eager loop; for int8
    and ``int8pack`` also the ``torch._weight_int8pack_mm`` loop where torch has it) use
    the same routings (a prefix, when slower). ``capped`` is this case's result from
    :func:`run_capped_baseline`, if any. ``ms`` is the median. Fractions and the bound
    are filled in when ``read_gbps`` and the scheme's peak (``fma_peak_gflops`` for
    bf16/fp16, ``int8_peak_gops`` for int8) are given, else None.
    ``progress(fraction_of_case, text)`` is called as the case advances.
    """
    shape = _as_shape(shape)
    if M <= 0:
        raise ValueError(f"M must be positive, got {M}")
    if scheme is None:
        scheme = weights.scheme if weights is not None else _dtype_name(dtype)
    if scheme in DTYPES:
        dtype = scheme
    elif scheme not in ("int8", "fp8"):
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got '{scheme}'")
    dname = _dtype_name(dtype)
    tdtype = DTYPES[dname]
    if weights is None:
        weights = ExpertWeights(shape, dname, seed, scheme=scheme)
    if (weights.scheme != scheme or weights.dtype != tdtype
            or weights.w1.shape != (shape.E, 2 * shape.N, shape.K)):
        raise ValueError("weights do not match the case's shape, scheme and dtype")
    E, topk, K, N = shape.E, shape.topk, shape.K, shape.N
    report = progress or (lambda frac, text: None)
    label = f"{shape.name} {scheme} M={M}"

    g, x, warm = _case_inputs(shape, M, tdtype, seed)

    if weights.is_int8:
        def call_cpumoe(r: Routing) -> torch.Tensor:
            return fused_experts(x, weights.w1p, weights.w2p, r.topk_weights, r.topk_ids,
                                 moe_comp_method=MoeCompMethod.INT8_W8A8, w1_scale=weights.s1,
                                 w2_scale=weights.s2, is_vnni=True)
    elif weights.is_fp8:
        def call_cpumoe(r: Routing) -> torch.Tensor:
            return fused_experts(x, weights.w1p, weights.w2p, r.topk_weights, r.topk_ids,
                                 moe_comp_method=MoeCompMethod.FP8_W8A16, w1_scale=weights.s1,
                                 w2_scale=weights.s2, block_size=list(FP8_BLOCK), is_vnni=True)
    else:
        def call_cpumoe(r: Routing) -> torch.Tensor:
            return fused_experts(x, weights.w1p, weights.w2p, r.topk_weights, r.topk_ids,
                                 is_vnni=True)

    def call_baseline(r: Routing) -> torch.Tensor:
        return baseline_moe(x, weights.w1, weights.w2, r.topk_weights, r.topk_ids)

    impls = []  # in-process baselines: (record key, label, fn)
    if baseline:
        impls.append(("baseline", "eager baseline", call_baseline))
    if baseline and int8pack and weights.is_int8 and int8pack_unavailable(tdtype) is None:
        s1 = weights.s1.squeeze(-1).to(tdtype)  # _weight_int8pack_mm wants [OC] in A's dtype
        s2 = weights.s2.squeeze(-1).to(tdtype)

        def call_int8pack(r: Routing) -> torch.Tensor:
            return baseline_int8pack_moe(x, weights.q1, s1, weights.q2, s2, r.topk_weights,
                                         r.topk_ids)

        impls.append(("int8pack", "int8pack baseline", call_int8pack))

    share = 1.0 / (1 + len(impls))
    found: Dict[str, tuple] = {}
    with torch.inference_mode():
        gc.collect()
        report(0.0, f"{label}: cpumoe warm-up")
        n = _iterations(_warm_up(call_cpumoe, warm), iters, min_time, min_iters, max_iters)
        routings = make_routings(n, M, E, topk, g)
        times, out_c, load_c = _time_calls(call_cpumoe, routings,
                                           _ticker(report, 0.0, share, n, f"{label}: cpumoe"))
        for k, (key, name, fn) in enumerate(impls):
            lo = share * (k + 1)
            report(lo, f"{label}: {name} warm-up")
            nb = min(_iterations(_warm_up(fn, warm), iters, min_time, min_iters, max_iters), n)
            bt, out_b, load_b = _time_calls(fn, routings[:nb],
                                            _ticker(report, lo, share, nb, f"{label}: {name}"))
            found[key] = (bt, _rel_diff(out_c, out_b), load_b.fraction)

    distinct = statistics.fmean(int(torch.unique(r.topk_ids).numel()) for r in routings)
    weight_bytes = distinct * weights.expert_bytes()
    flops = 2.0 * M * topk * 3 * N * K
    sec = statistics.median(times)
    peak = int8_peak_gops if weights.is_int8 else fma_peak_gflops
    rec = {
        "shape": shape.name, "scheme": scheme, "E": E, "topk": topk, "K": K, "N": N, "M": M,
        "dtype": dname,
        "ms": sec * 1e3,
        "ms_min": min(times) * 1e3,
        "iters": len(times),
        "distinct_experts": distinct,
        "weight_bytes": weight_bytes,
        "gbps": weight_bytes / sec / 1e9,
        "bw_fraction": None,
        "flops": flops,
        "gflops": flops / sec / 1e9,
        "peak_kind": "u8s8" if weights.is_int8 else "fp32_fma",
        "peak_fraction": None,
        "bound": None,
        "bound_fraction": None,
    }
    for key, prefix in (("baseline", "baseline"), ("int8pack", "int8pack")):
        bt, diff, others = found.get(key, (None, None, None))
        med = statistics.median(bt) if bt else None
        rec.update({
            f"{prefix}_ms": med * 1e3 if med else None,
            f"{prefix}_iters": len(bt) if bt else None,
            "speedup" if key == "baseline" else "speedup_int8pack": med / sec if med else None,
            f"rel_diff_vs_{key}": diff,
        })
    cap = capped if capped and capped.get("ms") else None
    rec.update({
        "eager_capped_ms": cap["ms"] if cap else None,
        "eager_capped_iters": cap["iters"] if cap else None,
        "speedup_capped": cap["ms"] / (sec * 1e3) if cap else None,
        "rel_diff_vs_capped": _rel_diff(out_c, cap.get("out")) if cap else None,
        "others_cpu_fraction": load_c.fraction,
        "baseline_others_cpu_fraction": found.get("baseline", (None,) * 3)[2],
        "int8pack_others_cpu_fraction": found.get("int8pack", (None,) * 3)[2],
        "capped_others_cpu_fraction": cap.get("others_cpu_fraction") if cap else None,
    })
    if read_gbps:
        rec["bw_fraction"] = rec["gbps"] / read_gbps
    if peak:
        rec["peak_fraction"] = rec["gflops"] / peak
    if read_gbps and peak:
        t_bw = weight_bytes / (read_gbps * 1e9)
        t_fl = flops / (peak * 1e9)
        rec["bound"] = "bandwidth" if t_bw >= t_fl else "compute"
        rec["bound_fraction"] = max(t_bw, t_fl) / sec
    return rec


# ---- eager baseline under a capped oneDNN ISA (subprocess) ---------------------------------

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
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["ONEDNN_MAX_CPU_ISA"] = isa
    env["DNNL_MAX_CPU_ISA"] = isa  # the name before oneDNN 2.x
    env.pop("ONEDNN_VERBOSE", None)
    env.pop("DNNL_VERBOSE", None)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"]
                                      if env.get("PYTHONPATH") else "")
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
        tail: collections.deque = collections.deque(maxlen=15)
        cmd = [sys.executable, "-m", "cpumoe.bench", _WORKER_FLAG, job_path]
        try:
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
        except OSError as e:
            result["error"] = f"cannot start {' '.join(cmd)}: {e}"
            return result
        try:
            with open(stdout_path) as f:
                _parse_onednn_verbose(f, result)
        except OSError:
            pass
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
    result["seconds"] = time.perf_counter() - t0
    return result


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

    s0 = shapes[0]
    try:  # oneDNN's ISA (an fp32 conv always runs in oneDNN), then its first-GEMM choice
        with torch.no_grad(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            _ = F.conv2d(torch.randn(1, 32, 32, 32), torch.randn(32, 32, 3, 3))
            for d in dtypes:
                _ = torch.randn(64, s0.K).to(DTYPES[d]) @ torch.randn(2 * s0.N, s0.K).to(DTYPES[d]).T
    except Exception as e:  # only costs the ISA report
        print(f"oneDNN verbose probe failed: {e}", file=sys.stderr)
    sys.stdout.flush()

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


# ---- output --------------------------------------------------------------------------------

_COLUMNS = [
    # header, width, formatter(record)
    ("shape", 17, lambda r: r["shape"]),
    ("scheme", 6, lambda r: r.get("scheme") or r["dtype"]),
    ("M", 5, lambda r: str(r["M"])),
    ("ms", 9, lambda r: f"{r['ms']:.2f}"),
    ("wt MB", 8, lambda r: f"{r['weight_bytes'] / 1e6:.0f}"),
    ("GB/s", 7, lambda r: f"{r['gbps']:.1f}"),
    ("%bw", 5, lambda r: _pct(r["bw_fraction"])),
    ("GFLOP/s", 8, lambda r: f"{r['gflops']:.1f}"),
    ("%peak", 6, lambda r: _pct(r["peak_fraction"])),
    ("bound", 6, lambda r: {"bandwidth": "bw", "compute": "flop"}.get(r["bound"], "-")),
    ("%bound", 7, lambda r: _pct(r["bound_fraction"])),
    ("eager ms", 10, lambda r: _ms(r["baseline_ms"])),
    ("speedup", 8, lambda r: _ratio(r["speedup"])),
    ("others", 7, lambda r: _others(r)),
]
# extra columns, before "others": the int8pack baseline (int8 runs) and the capped baseline
_INT8PACK_COLUMNS = [
    ("int8pack ms", 11, lambda r: _ms(r.get("int8pack_ms"))),
    ("vs int8pack", 11, lambda r: _ratio(r.get("speedup_int8pack"))),
]
_CAPPED_COLUMNS = [
    ("capped ms", 10, lambda r: _ms(r.get("eager_capped_ms"))),
    ("vs capped", 9, lambda r: _ratio(r.get("speedup_capped"))),
]


def table_columns(int8pack: bool = False, capped: bool = False) -> list:
    """The table's columns: the base ones, plus the int8pack and/or capped baseline's."""
    extra = (_INT8PACK_COLUMNS if int8pack else []) + (_CAPPED_COLUMNS if capped else [])
    return _COLUMNS[:-1] + extra + _COLUMNS[-1:]

NOISY = 0.10  # others' share of the CPUs above which a row is flagged


def case_others_fraction(rec: dict) -> Optional[float]:
    """Largest share of the CPUs used by other processes while the case was timed."""
    keys = ("others_cpu_fraction", "baseline_others_cpu_fraction",
            "int8pack_others_cpu_fraction", "capped_others_cpu_fraction")
    vals = [rec[k] for k in keys if rec.get(k) is not None]
    return max(vals) if vals else None


def _others(rec: dict) -> str:
    v = case_others_fraction(rec)
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" + ("*" if v > NOISY else "")


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_header_row(columns: Optional[list] = None) -> str:
    cols = _COLUMNS if columns is None else columns
    cells = [h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w, _) in enumerate(cols)]
    return " ".join(cells)


def format_row(rec: dict, columns: Optional[list] = None) -> str:
    cols = _COLUMNS if columns is None else columns
    cells = [f(rec).ljust(w) if i == 0 else f(rec).rjust(w) for i, (_, w, f) in enumerate(cols)]
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
    p.add_argument("--scheme", type=parse_schemes, default=None, metavar="S,S,...",
                   help="weight schemes, comma list of bf16, fp16 (weights and activations in "
                        "that dtype) and int8 (INT8 W8A8, moe_comp_method=1: per-channel int8 "
                        "weights, activations in --dtype) (default: --dtype, i.e. bf16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="activation and weight dtype when --scheme is not given; the "
                        "activation dtype of int8 rows (default bf16)")
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
                   help="skip the in-process baselines (the PyTorch eager per-expert loop and, "
                        "for int8, the torch._weight_int8pack_mm loop)")
    p.add_argument("--baseline-isa", metavar="NAME", default=None,
                   help="also time the eager baseline in a subprocess started with "
                        "ONEDNN_MAX_CPU_ISA=NAME, e.g. avx512_core_vnni (a Cascade Lake class "
                        "CPU: no AVX512-BF16, no AMX) or avx2 (columns 'capped ms', "
                        "'vs capped'); independent of --no-baseline")
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
        description="Time cpumoe.fused_experts (bf16/fp16 or INT8 W8A8 weights) on MoE model "
                    "shapes against the machine's measured streaming-read bandwidth and fp32 "
                    "FMA / u8*s8 peak, and against the PyTorch eager per-expert loop.")
    return add_arguments(p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m cpumoe bench``; returns 0 on success."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:1] == [_WORKER_FLAG]:  # the subprocess of --baseline-isa
        return _baseline_worker(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shape)
    except ValueError as e:
        parser.error(str(e))
    if args.iters is not None and args.iters <= 0:
        parser.error("--iters must be positive")
    if args.scheme is None:
        args.scheme = [args.dtype]
    if args.baseline_isa is not None and not args.baseline_isa.strip():
        parser.error("--baseline-isa needs a oneDNN ISA name, e.g. avx512_core_vnni")
    if args.threads is not None:
        if args.threads <= 0:
            parser.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    return run(args, shapes)


def _scheme_text(schemes: Sequence[str], dtype: str) -> str:
    if list(schemes) == [dtype] or all(s in DTYPES for s in schemes):
        return ", ".join(schemes)
    return ", ".join(schemes) + f" (int8 = W8A8, {dtype} activations)"


def run(args: argparse.Namespace, shapes: List[Shape]) -> int:
    t_start = time.perf_counter()
    json_stdout = args.json == "-"
    out = sys.stderr if json_stdout else sys.stdout  # the human-readable table
    show_bar = args.progress or (not json_stdout and sys.stderr.isatty())
    schemes = list(args.scheme)
    has_int8 = "int8" in schemes
    capped_isa = args.baseline_isa.strip() if args.baseline_isa else None
    total_cases = len(shapes) * len(schemes) * len(args.m)
    # budget: 1 unit per case, 0.5 per case for the capped baseline, 0.5 (0.7 with the u8*s8
    # peak) for the limits at the start and 0.25 at the end
    t_limits = 0.7 if has_int8 else 0.5
    t_capped = 0.5 * total_cases if capped_isa else 0.0
    bar = Progress(total_cases + t_limits + t_capped + 0.25, enabled=show_bar)

    def emit(line: str = "") -> None:
        bar.write(line, out)

    info = machine_info()
    busy0 = cpu_busy_fraction()
    bw_bytes = args.bw_mib << 20 if args.bw_mib else None
    int8pack_reason = int8pack_unavailable(args.dtype) if has_int8 else None
    int8pack_cols = has_int8 and not args.no_baseline and int8pack_reason is None
    columns = table_columns(int8pack=int8pack_cols, capped=bool(capped_isa))
    try:
        bar.update(0.0, "measuring streaming-read bandwidth", force=True)
        bw0 = _read_bandwidth_samples(bw_bytes)
        bar.update(0.3, "measuring fp32 FMA peak", force=True)
        fma = _fma_peak_samples()
        i8 = None
        if has_int8:
            bar.update(0.5, "measuring u8*s8 peak", force=True)
            i8 = _int8_peak_samples()
        read_gbps = max(bw0["samples_gbps"])
        peak = max(fma["samples_gflops"])
        peak_i8 = max(i8["samples_gops"]) if i8 else None
        bar.update(t_limits, "limits measured")

        capped = None
        if capped_isa:
            bar.update(t_limits, f"eager baseline with ONEDNN_MAX_CPU_ISA={capped_isa} "
                                 "(subprocess): starting", force=True)
            capped = run_capped_baseline(
                capped_isa, shapes, schemes, args.m, dtype=args.dtype, seed=args.seed,
                iters=args.iters, min_time=args.min_time,
                progress=lambda f, text: bar.update(t_limits + t_capped * f,
                                                    f"[{capped_isa}] {text}"))
            bar.update(t_limits + t_capped)
        t0_cases = t_limits + t_capped

        emit(f"cpumoe {info['cpumoe_version']} bench: tier {info['tier']}, {info['threads']} "
             f"threads, {_scheme_text(schemes, args.dtype)}, torch {info['torch_version']}")
        emit(f"CPU: {info['cpu_model']} ({info['logical_cpus']} logical CPUs"
             + (f", LLC {_fmt_bytes(info['last_level_cache_bytes'])}"
                if info["last_level_cache_bytes"] else "") + ")")
        emit(f"tier: {info['isa_reason']}")
        emit(f"streaming read: {read_gbps:.1f} GB/s (best of {len(bw0['samples_gbps'])} runs x "
             f"{bw0['passes']} passes over {_fmt_bytes(bw0['buffer_bytes'])}; median "
             f"{statistics.median(bw0['samples_gbps']):.1f})")
        emit(f"fp32 FMA peak:  {peak:.0f} GFLOP/s (best of {len(fma['samples_gflops'])} runs "
             f"of ~{fma['seconds_per_run']} s; median "
             f"{statistics.median(fma['samples_gflops']):.0f})"
             + ("; %peak and bound of bf16/fp16 rows" if has_int8 else ""))
        if i8:
            emit(f"u8*s8 peak:     {peak_i8:.0f} GOP/s (best of {len(i8['samples_gops'])} runs "
                 f"of ~{i8['seconds_per_run']} s; median "
                 f"{statistics.median(i8['samples_gops']):.0f}); %peak and bound of int8 rows")
        if busy0 is not None and busy0 > 0.1:
            emit(f"WARNING: other processes kept the CPUs {100 * busy0:.0f}% busy just before "
                 "the run; figures will be noisy")
        emit("fresh random routing on every call (weights come from DRAM); ms = median; "
             "%bw, %peak, %bound vs the limits above;")
        if not args.no_baseline:
            emit("speedup = eager per-expert PyTorch loop in the row's activation dtype"
                 + (" (int8 rows: over the dequantized weights)" if has_int8 else "")
                 + " / cpumoe;")
        if has_int8 and not args.no_baseline:
            if int8pack_reason is None:
                emit(f"vs int8pack = per-expert loop over torch._weight_int8pack_mm (int8 "
                     f"weights, {args.dtype} activations) / cpumoe, int8 rows;")
            else:
                emit(f"int8pack baseline skipped: {int8pack_reason}")
        if capped:
            impls = ", ".join(f"{d} GEMM {v}" for d, v in sorted(capped["matmul_impl"].items()))
            no_onednn = [d for d in sorted({s if s in DTYPES else args.dtype for s in schemes})
                         if d not in capped["matmul_impl"]]
            impls += "".join(f", {d} GEMM not in oneDNN" for d in no_onednn)
            emit(f"vs capped = the eager loop in a subprocess with ONEDNN_MAX_CPU_ISA={capped_isa}"
                 f" / cpumoe (oneDNN there: {capped['onednn_isa'] or 'isa unknown'}"
                 f"{'; ' + impls.lstrip(', ') if impls else ''});")
            if capped["error"]:
                emit(f"capped baseline FAILED: {capped['error']}")
        emit("others = share of the CPUs used by other processes while the case was timed")
        emit()
        emit(format_header_row(columns))

        cases: List[dict] = []
        done = 0
        for shape in shapes:
            for scheme in schemes:
                bar.update(t0_cases + done, f"{shape.name} {scheme}: generating and packing "
                                            "weights", force=True)
                weights = ExpertWeights(shape, args.dtype, args.seed, scheme=scheme)
                for M in args.m:
                    cap = capped["cases"].get((shape.name, scheme, M)) if capped else None
                    rec = run_case(
                        shape, M, dtype=args.dtype, scheme=scheme, weights=weights,
                        iters=args.iters, min_time=args.min_time,
                        baseline=not args.no_baseline, capped=cap, read_gbps=read_gbps,
                        fma_peak_gflops=peak, int8_peak_gops=peak_i8, seed=args.seed,
                        progress=lambda f, text, d=done: bar.update(t0_cases + d + f, text))
                    cases.append(rec)
                    emit(format_row(rec, columns))
                    done += 1
                    bar.update(t0_cases + done)
                del weights
                gc.collect()

        bar.update(t0_cases + done, "re-measuring streaming-read bandwidth", force=True)
        bw1 = _read_bandwidth_samples(bw_bytes)
        read_end = max(bw1["samples_gbps"])
        busy1 = cpu_busy_fraction()
        bar.update(t0_cases + done + 0.25)
        wall = time.perf_counter() - t_start
        emit()
        drift = (read_end - read_gbps) / read_gbps
        emit(f"streaming read at the end: {read_end:.1f} GB/s (start {read_gbps:.1f}, "
             f"{100 * drift:+.0f}%){'  -- the machine was noisy' if abs(drift) > 0.1 else ''}")
        noisy = [c for c in cases if (case_others_fraction(c) or 0) > NOISY]
        if noisy:
            emit(f"* {len(noisy)} case(s) ran while other processes used more than "
                 f"{100 * NOISY:.0f}% of the CPUs (column 'others'); rerun them on a quiet machine")
        for key, name in (("rel_diff_vs_baseline", "eager baseline"),
                          ("rel_diff_vs_int8pack", "int8pack baseline"),
                          ("rel_diff_vs_capped", "capped eager baseline")):
            diffs = [c[key] for c in cases if c[key] is not None]
            if diffs:
                emit(f"cpumoe vs {name}: max relative L2 difference {max(diffs):.1e}"
                     + ("  -- LARGER THAN EXPECTED" if max(diffs) > 5e-2 else ""))
        if capped:
            failed = [c for c in capped["cases"].values() if c.get("error")]
            for c in failed:
                emit(f"capped baseline failed on {c['shape']} {c['scheme']} M={c['M']}: "
                     f"{c['error']}")
            emit(f"capped baseline subprocess: {capped['seconds']:.1f} s")
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
        "int8_peak_gops": peak_i8,
        "int8_statistic": "best of runs" if i8 else None,
        "int8_samples_gops": i8["samples_gops"] if i8 else None,
        "capped_baseline": None if capped is None else {
            "isa": capped["isa"], "onednn_isa": capped["onednn_isa"],
            "matmul_impl": capped["matmul_impl"], "error": capped["error"],
            "seconds": capped["seconds"],
            "case_errors": [f"{c['shape']} {c['scheme']} M={c['M']}: {c['error']}"
                            for c in capped["cases"].values() if c.get("error")],
        },
    })
    doc = {
        "machine": machine,
        "settings": {
            "shapes": [s.name for s in shapes], "m": args.m, "schemes": schemes,
            "dtype": args.dtype, "iters": args.iters, "min_time": args.min_time,
            "baseline": not args.no_baseline, "baseline_isa": capped_isa,
            "int8pack_unavailable": int8pack_reason,
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
