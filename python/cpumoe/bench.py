"""Model-shape benchmark of ``fused_experts`` with roofline figures (``python -m cpumoe bench``).

For every (shape, weight scheme, M) case it times ``cpumoe.fused_experts`` on weights
packed once, and the PyTorch code a user would otherwise run, and reports each against
the machine limits of DESIGN.md §5, all measured in the same run:

* streaming-read bandwidth: ``_C.probe_read`` over a buffer several times the
  last-level cache (:func:`measure_read_bandwidth`), measured at the start and again
  at the end of the run;
* fp32 FMA peak of the active tier: ``_C.probe_fma``, a register-only loop on each of
  torch's threads (:func:`measure_fma_peak`); the ceiling of the bf16/fp16/fp8 schemes;
* u8*s8 peak of the active tier: ``_C.probe_int8``, the same kind of loop of u8*s8 dot
  products (VNNI where the tier has it) (:func:`measure_int8_peak`); the ceiling of the
  int8 and int4 schemes, measured only when one of them is benchmarked.

Each row's bound is the larger of bytes / bandwidth and operations / peak (the roofline);
``%bound`` is that bound over the measured time. With ``--threads 1,2`` every case is
also timed at the other thread counts (limits measured at each count too).

Weight schemes (``--scheme``) are the rows of :data:`SCHEMES`: ``bf16`` / ``fp16`` (weights
and activations in that dtype), ``int8`` (INT8 W8A8), ``fp8`` (FP8 W8A16, 128x128 block
scales) and ``int4`` (INT4 W4A8, AWQ group-quantized; skipped with the reason when this
build of cpumoe rejects ``moe_comp_method=3``). Each has a weight generator that turns
random float weights into the scheme's tensors and the dequantized float weights the
eager baseline reads.

Baselines (:data:`BASELINES`): the eager per-expert loop in the activation dtype
(:func:`baseline_moe`; for quantized schemes over the dequantized weights); for int8 a
per-expert loop over ``torch._weight_int8pack_mm`` (:func:`baseline_int8pack_moe`) and for
int4 one over ``torch._weight_int4pack_mm_for_cpu`` (:func:`baseline_int4pack_moe`) where
torch has them; and, with ``--baseline-isa NAME``, the eager loop again in a subprocess
started with ``ONEDNN_MAX_CPU_ISA=NAME`` (:func:`run_capped_baseline`), e.g.
``avx512_core_vnni`` to see what the eager code does on a CPU without AVX512-BF16 and AMX.

Routing is decode-realistic: every timed call gets a fresh, pre-generated routing
(random distinct experts per token, softmax-normalised fp32 weights, int32 ids), and
cpumoe's calls cycle through copies of the weights, as through the layers of a model
(:func:`default_weight_layers`), so expert weights come from DRAM rather than from cache.
cpumoe and the baselines see the same routings (the subprocess regenerates them from the
seed). ``benchmarks/README.md`` describes the method and the output fields; ``--plot
FILE.png`` draws the roofline picture (:func:`write_plot`, needs matplotlib).

Importable for tests: :func:`main` (returns 0), :func:`measure_read_bandwidth`,
:func:`measure_fma_peak`, :func:`measure_int8_peak`, :func:`run_case`,
:func:`baseline_moe`, :func:`baseline_int8pack_moe`, :func:`baseline_int4pack_moe`,
:func:`run_capped_baseline`, :func:`machine_info`, :func:`write_plot`. Smoke run (seconds):
``main(["--shape", "custom:8,2,256,128", "--scheme", "bf16,int8", "--m", "1,4", "--iters", "2"])``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import itertools
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import _C
from ._progress import Progress
from .ops import MoeCompMethod, convert_weight_packed, convert_weight_packed_scale_zp, fused_experts
from .quant import quantize_fp8_blockwise, quantize_int4, quantize_int8_per_channel
from .reference import dequantize_int4, unpack_int4_checkpoint

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
    "olmoe-1b-7b": Shape("olmoe-1b-7b", E=64, topk=8, K=2048, N=1024),
    # gpt-oss-20b's sizes with cpumoe's SiLU*mul (the model itself uses a clamped SwiGLU with
    # biases); K = N = 2880 is not a multiple of 128: fp8 has partial 128x128 scale blocks
    # and int4 uses groups of 64
    "gpt-oss-20b": Shape("gpt-oss-20b", E=32, topk=4, K=2880, N=2880),
}
DEFAULT_SHAPE = "qwen3-30b-a3b"
DEFAULT_M = (1, 4, 16, 64, 256, 512)
ALL_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # --m all

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8_BLOCK = (128, 128)  # DeepSeek-V3 style weight_block_size of the fp8 scheme
INT4_GROUPS = (128, 64, 32)  # int4 group size: the first that divides both K and N


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        return dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def parse_shapes(spec: str) -> List[Shape]:
    """A name of :data:`SHAPES` (``qwen3-30b-a3b``, ``mixtral-8x7b``, ``deepseek-v2-lite``,
    ``olmoe-1b-7b``, ``gpt-oss-20b``) | ``all`` | ``custom:E,topk,K,N``; several may be
    given separated by ``+`` (e.g. ``mixtral-8x7b+custom:8,2,256,128``)."""
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
    """Comma list of weight schemes (names of :data:`SCHEMES`, or ``all``), duplicates
    dropped."""
    out: List[str] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        names = list(SCHEMES) if part == "all" else [part]
        if part != "all" and part not in SCHEMES:
            raise argparse.ArgumentTypeError(
                f"unknown scheme '{part}': expected a comma list of {', '.join(SCHEMES)} "
                "or all")
        out.extend(n for n in names if n not in out)
    if not out:
        raise argparse.ArgumentTypeError("--scheme expects at least one scheme")
    return out


def parse_pairs(text: str) -> List[Tuple[str, str]]:
    """``--interleave``: comma list of scheme pairs ``A/B`` (names of :data:`SCHEMES`),
    duplicates dropped."""
    out: List[Tuple[str, str]] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        names = [n.strip() for n in part.split("/")]
        if len(names) != 2 or not all(names):
            raise argparse.ArgumentTypeError(
                f"bad pair '{part}': expected A/B, e.g. bf16/int8,int8/int4")
        for n in names:
            if n not in SCHEMES:
                raise argparse.ArgumentTypeError(
                    f"unknown scheme '{n}' in pair '{part}': expected {', '.join(SCHEMES)}")
        if names[0] == names[1]:
            raise argparse.ArgumentTypeError(f"pair '{part}' names one scheme twice")
        if tuple(names) not in out:
            out.append((names[0], names[1]))
    if not out:
        raise argparse.ArgumentTypeError("--interleave expects at least one pair A/B")
    return out


def _parse_int_list(text: str, flag: str) -> List[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{flag} expects a comma list of integers, got '{text}'") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{flag} expects positive integers, got '{text}'")
    return vals


def _parse_m(text: str) -> List[int]:
    """``--m``: a comma list of token counts, or ``all`` (:data:`ALL_M`)."""
    if text.strip().lower() == "all":
        return list(ALL_M)
    return _parse_int_list(text, "--m")


def _parse_threads(text: str) -> List[int]:
    """``--threads``: one count, or several (duplicates dropped, largest first: the rows are
    measured at the largest, the others give the scaling columns)."""
    return sorted(set(_parse_int_list(text, "--threads")), reverse=True)


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


MAX_WEIGHT_LAYERS = 16
INT4_COMP_BYTES = 128  # int32 per column after each packed int4 block (docs/FORMATS.md)


def default_weight_layers(layer_bytes: int) -> int:
    """How many copies ("layers") of a case's weights its calls cycle through, so that the
    weights come from DRAM as in a model with many MoE layers: enough for max(1 GiB, 8 x
    last-level cache) in all, at most MAX_WEIGHT_LAYERS and a quarter of the available
    memory, at least 1. With one copy, weights of the order of the LLC partly stay there
    between calls under random routing (a random working set W in an LLC of C hits about
    C / W of the time), which flatters the small schemes' decode."""
    llc = last_level_cache_bytes() or 0
    layers = -(-max(_GiB, 8 * llc) // max(int(layer_bytes), 1))
    avail = _mem_available_bytes()
    if avail:
        layers = min(layers, avail // 4 // max(int(layer_bytes), 1))
    return int(max(1, min(layers, MAX_WEIGHT_LAYERS)))


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


@dataclass(frozen=True)
class Limits:
    """The machine limits one set of rows is judged against (any may be None: unknown)."""

    read_gbps: Optional[float] = None  # streaming read, 1e9 bytes/s
    fma_gflops: Optional[float] = None  # fp32 FMA peak, 1e9 flop/s
    int8_gops: Optional[float] = None  # u8*s8 peak, 1e9 op/s

    def peak(self, kind: str) -> Optional[float]:
        """The compute ceiling of a scheme's ``peak_kind`` (``"fp32_fma"`` or ``"u8s8"``)."""
        return self.int8_gops if kind == "u8s8" else self.fma_gflops

    def bound(self, weight_bytes: float, ops: float, kind: str):
        """``("bandwidth" | "compute", seconds)``: the larger of bytes / bandwidth and ops /
        peak, the least time the call can take (the roofline); None if a limit is unknown."""
        peak = self.peak(kind)
        if not self.read_gbps or not peak:
            return None
        t_bw = weight_bytes / (self.read_gbps * 1e9)
        t_ops = ops / (peak * 1e9)
        return ("bandwidth", t_bw) if t_bw >= t_ops else ("compute", t_ops)


def measure_limits(need_int8: bool, buffer_bytes: Optional[int] = None) -> dict:
    """All limit samples on torch's current threads: ``{"threads", "read", "fma", "int8"}``
    (``int8`` None unless ``need_int8``) and ``limits``, a :class:`Limits` of the best runs."""
    bw = _read_bandwidth_samples(buffer_bytes)
    fma = _fma_peak_samples()
    i8 = _int8_peak_samples() if need_int8 else None
    return {"threads": torch.get_num_threads(), "read": bw, "fma": fma, "int8": i8,
            "limits": Limits(max(bw["samples_gbps"]), max(fma["samples_gflops"]),
                             max(i8["samples_gops"]) if i8 else None)}


# ---- weight schemes ------------------------------------------------------------------------


@dataclass
class SchemeWeights:
    """What a scheme's weight generator returns: the packed ``w1``/``w2`` cpumoe reads (None
    when not packing), the other keyword arguments of :func:`cpumoe.fused_experts` (scales,
    zeros, block size; ``moe_comp_method`` comes from the :class:`Scheme`) and what the
    scheme's torch baseline reads (``torch_data``)."""

    w1p: Optional[torch.Tensor]
    w2p: Optional[torch.Tensor]
    kwargs: dict
    torch_data: Optional[tuple] = None


# A weight generator: (w1 [E, 2N, K], w2 [E, K, N] random float weights in the activation
# dtype, generator, pack) -> SchemeWeights. A quantized scheme overwrites w1/w2 with its
# dequantized weights (what the eager baseline then reads).
WeightGenerator = Callable[[torch.Tensor, torch.Tensor, torch.Generator, bool], SchemeWeights]


@dataclass(frozen=True)
class Scheme:
    """One weight scheme of the benchmark: a row of :data:`SCHEMES`."""

    name: str
    method: MoeCompMethod
    text: str  # what it is, for --help and the table header
    peak_kind: str  # "fp32_fma" or "u8s8": the compute ceiling of its rows
    make_weights: WeightGenerator
    torch_baseline: Optional[str] = None  # key of BASELINES: torch's own path for these weights
    unavailable: Optional[Callable[[torch.dtype], Optional[str]]] = None  # why cpumoe can't run it

    @property
    def float_weights(self) -> bool:
        """bf16/fp16: the weights are in the activation dtype, which the scheme fixes."""
        return self.name in DTYPES


def _float_weights(w1, w2, g, pack) -> SchemeWeights:
    return SchemeWeights(convert_weight_packed(w1) if pack else None,
                         convert_weight_packed(w2) if pack else None, {})


def _int8_weights(w1, w2, g, pack) -> SchemeWeights:
    """Per-channel int8 of the random weights (:func:`cpumoe.quant.quantize_int8_per_channel`);
    torch_data = (q1, s1, q2, s2) for the int8pack baseline."""
    q1, s1 = _quantize_experts(w1)
    q2, s2 = _quantize_experts(w2)
    return SchemeWeights(convert_weight_packed(q1) if pack else None,
                         convert_weight_packed(q2) if pack else None,
                         {"w1_scale": s1, "w2_scale": s2}, (q1, s1, q2, s2))


def _fp8_weights(w1, w2, g, pack) -> SchemeWeights:
    """e4m3 weights with 128x128 block scales (:func:`cpumoe.quant.quantize_fp8_blockwise`;
    partial blocks where K or N is not a multiple of 128)."""
    q1, s1 = _quantize_experts(w1, fp8=True)
    q2, s2 = _quantize_experts(w2, fp8=True)
    return SchemeWeights(convert_weight_packed(q1) if pack else None,
                         convert_weight_packed(q2) if pack else None,
                         {"w1_scale": s1, "w2_scale": s2, "block_size": list(FP8_BLOCK)})


def int4_group_size(K: int, N: int) -> int:
    """The int4 group size of a shape: the first of :data:`INT4_GROUPS` dividing K and N
    (w1's input is K, w2's is N, and both share one group size)."""
    for gs in INT4_GROUPS:
        if K % gs == 0 and N % gs == 0:
            return gs
    raise ValueError(f"no int4 group size in {INT4_GROUPS} divides K={K} and N={N}")


def _int4_weights(w1, w2, g, pack) -> SchemeWeights:
    """AWQ int4 of the random weights (:func:`cpumoe.quant.quantize_int4`, groups of
    :func:`int4_group_size` along the input dimension, scales in the activation dtype),
    packed with :func:`cpumoe.convert_weight_packed_scale_zp`; torch_data holds torch's
    int4pack form of the same weights (if this torch has it)."""
    gs = int4_group_size(w1.shape[2], w2.shape[2])
    torch_form = pack and int4pack_unavailable(w1.dtype) is None
    ck1, t1 = _int4_experts(w1, gs, torch_form)
    ck2, t2 = _int4_experts(w2, gs, torch_form)
    w1p = w2p = None
    kwargs: dict = {}
    if pack:
        w1p, z1, s1 = convert_weight_packed_scale_zp(*ck1, 0)
        w2p, z2, s2 = convert_weight_packed_scale_zp(*ck2, 0)
        kwargs = {"w1_scale": s1, "w2_scale": s2, "w1_zero": z1, "w2_zero": z2}
    return SchemeWeights(w1p, w2p, kwargs, (*t1, *t2, gs) if torch_form else None)


def _int4_experts(w: torch.Tensor, gs: int, torch_form: bool):
    """Per expert of ``w [E, OC, IC]``: the AWQ checkpoint ``(qweight, qzeros, scales)``
    (stacked over E) and, with ``torch_form``, torch's int4pack tensors of the same
    weights (see :func:`baseline_int4pack_moe`), else None; ``w`` is overwritten with the
    dequantized weights. One expert at a time, so the temporaries stay small."""
    E, OC, IC = w.shape
    G = IC // gs
    qweight = torch.empty(E, IC, OC // 8, dtype=torch.int32)
    qzeros = torch.empty(E, G, OC // 8, dtype=torch.int32)
    scales = torch.empty(E, G, OC, dtype=w.dtype)
    packed = torch.empty(E, OC, IC // 2, dtype=torch.uint8) if torch_form else None
    scale_zero = torch.empty(E, G, OC, 2, dtype=w.dtype) if torch_form else None
    for e in range(E):
        ck = quantize_int4(w[e], gs, "awq", scales_dtype=w.dtype)
        for dst, src in zip((qweight, qzeros, scales), ck):
            dst[e].copy_(src)
        q, z, s = unpack_int4_checkpoint(*ck, 0)  # [OC, IC], [OC, G], [OC, G]
        w[e].copy_(dequantize_int4(q, z, s))
        if torch_form:
            # torch dequantizes (q - 8) * scale + zero, so zero = (8 - z) * scale
            packed[e].copy_(torch._convert_weight_to_int4pack_for_cpu(q, 2))
            scale_zero[e].copy_(torch.stack([s, (8 - z) * s], dim=-1).transpose(0, 1))
    return (qweight, qzeros, scales), ((packed, scale_zero) if torch_form else None)


def _int4_unavailable(dtype: torch.dtype) -> Optional[str]:
    """None when cpumoe runs INT4 W4A8 here, checked once per activation dtype on a tiny
    layer against the eager loop over the dequantized weights; else why not."""
    if dtype in _INT4_REASON:
        return _INT4_REASON[dtype]
    if not hasattr(torch.ops.cpumoe, "convert_weight_packed_scale_zp"):
        reason = ("int4 not built yet: this cpumoe has no "
                  "torch.ops.cpumoe.convert_weight_packed_scale_zp")
    else:
        try:  # a tiny layer against the eager loop over its dequantized weights
            shape = Shape("int4-check", E=4, topk=2, K=256, N=128)
            w = ExpertWeights(shape, dtype, seed=1, scheme="int4")
            g = torch.Generator().manual_seed(1)
            x = torch.randn(3, shape.K, generator=g).to(w.dtype)
            r = make_routings(1, 3, shape.E, shape.topk, g)[0]
            out = fused_experts(x, w.w1p, w.w2p, r.topk_weights, r.topk_ids, is_vnni=True,
                                **w.kwargs)
            diff = _rel_diff(out, baseline_moe(x, w.w1, w.w2, r.topk_weights, r.topk_ids))
            reason = None if diff < 5e-2 else (
                f"int4: cpumoe differs from the eager loop over the dequantized weights by "
                f"{diff:.1e} (relative L2) on a test layer")
        except Exception as e:  # the op rejects moe_comp_method=3 (or the packer fails)
            reason = f"int4 not built yet: {type(e).__name__}: {str(e).splitlines()[0]}"
    _INT4_REASON[dtype] = reason
    return reason


_INT4_REASON: Dict[torch.dtype, Optional[str]] = {}

SCHEMES: Dict[str, Scheme] = {s.name: s for s in (
    Scheme("bf16", MoeCompMethod.UNQUANT, "bf16 weights and activations", "fp32_fma",
           _float_weights),
    Scheme("fp16", MoeCompMethod.UNQUANT, "fp16 weights and activations", "fp32_fma",
           _float_weights),
    Scheme("int8", MoeCompMethod.INT8_W8A8, "INT8 W8A8 (moe_comp_method=1): per-channel int8 "
           "weights, activations quantized per token", "u8s8", _int8_weights, "int8pack"),
    Scheme("fp8", MoeCompMethod.FP8_W8A16, "FP8 W8A16 (moe_comp_method=2): e4m3 weights, "
           "128x128 block scales", "fp32_fma", _fp8_weights),
    Scheme("int4", MoeCompMethod.INT4_W4A8, "INT4 W4A8 (moe_comp_method=3): AWQ int4 weights, "
           "groups of 128 (64 or 32 where K or N needs it), activations quantized per token",
           "u8s8", _int4_weights, "int4pack", _int4_unavailable),
)}


def scheme_unavailable(name: str, dtype) -> Optional[str]:
    """None when cpumoe can run scheme ``name`` here with activations of ``dtype``."""
    check = SCHEMES[name].unavailable
    return check(DTYPES[_dtype_name(dtype)]) if check else None


# ---- weights, routing, baselines -----------------------------------------------------------


class ExpertWeights:
    """Random expert weights of one shape and weight scheme: ``w1 [E, 2N, K]``,
    ``w2 [E, K, N]`` in the activation dtype (for the eager baseline; the dequantized
    weights for a quantized scheme), the packed ``w1p``, ``w2p`` and the other keyword
    arguments (``kwargs``) cpumoe reads, and what the scheme's torch baseline reads
    (``torch_data``).

    Values are normal with std 1/sqrt(K) (w1) and 1/sqrt(N) (w2), so activations stay
    O(1) and fp16 does not overflow. For speed they are copied from a 16 Mi-value random
    pool at random offsets; values do not affect timing. ``scheme`` is a name of
    :data:`SCHEMES` (default: ``dtype``'s); ``bf16``/``fp16`` fix the activation dtype,
    the quantized schemes use ``dtype``'s. The scheme's weight generator makes the rest.
    """

    def __init__(self, shape: Shape, dtype: str = "bf16", seed: int = 0, pack: bool = True,
                 scheme: Optional[str] = None):
        self.shape = shape
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.scheme = scheme or _dtype_name(self.dtype)
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got '{scheme}'")
        if SCHEMES[self.scheme].float_weights:
            self.dtype = DTYPES[self.scheme]
        g = torch.Generator().manual_seed(seed)
        E, K, N = shape.E, shape.K, shape.N
        self.w1 = torch.empty(E, 2 * N, K, dtype=self.dtype)
        self.w2 = torch.empty(E, K, N, dtype=self.dtype)
        _fill_random(self.w1, 1.0 / math.sqrt(K), g)
        _fill_random(self.w2, 1.0 / math.sqrt(N), g)
        made = SCHEMES[self.scheme].make_weights(self.w1, self.w2, g, pack)
        self.w1p, self.w2p = made.w1p, made.w2p
        self.kwargs = {"moe_comp_method": SCHEMES[self.scheme].method, **made.kwargs}
        self.torch_data = made.torch_data
        self._layers = [(self.w1p, self.w2p, self.kwargs)]  # see layers()

    def layer_bytes(self) -> int:
        """Bytes of one copy of everything cpumoe reads (packed weights, scales, zeros)."""
        return self.expert_bytes() * self.shape.E

    def layers(self, count: int) -> List[tuple]:
        """``count`` copies of cpumoe's inputs as ``(w1p, w2p, kwargs)``: this object's own
        tensors first, then clones (made once and kept, see :func:`default_weight_layers`)."""
        while len(self._layers) < count:
            self._layers.append((self.w1p.clone(), self.w2p.clone(),
                                 {k: v.clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in self.kwargs.items()}))
        del self._layers[max(count, 1):]
        return list(self._layers)

    def expert_bytes(self) -> int:
        """Bytes cpumoe reads per expert touched: the packed weights and every per-expert
        tensor passed with them (scales, zero points), over E; e.g. int8 adds an fp32 scale
        and the packed layout's 4-byte compensation per output row (2N + K rows). int4
        leaves out the 128 bytes of compensation after each packed block
        ``[..., 16 bk + 128]``: its decode kernel sums the columns itself and never reads
        them (the prefill path does, where the bound is the arithmetic)."""
        tensors = [self.w1p, self.w2p] + [v for v in self.kwargs.values()
                                          if isinstance(v, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self.scheme == "int4":
            total -= sum(t.numel() // t.shape[-1] * INT4_COMP_BYTES for t in (self.w1p, self.w2p))
        return total // self.shape.E


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


def baseline_int4pack_moe(x: torch.Tensor, p1: torch.Tensor, sz1: torch.Tensor,
                          p2: torch.Tensor, sz2: torch.Tensor, group_size: int,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The same per-expert loop as :func:`baseline_moe` with both GEMMs done by
    ``torch._weight_int4pack_mm_for_cpu(A [T, K], B, group_size, scales_and_zeros)``
    (torch's weight-only int4 matmul; activations stay in ``x``'s dtype): ``p1 [E, 2N, K/2]``
    and ``p2 [E, K, N/2]`` from ``torch._convert_weight_to_int4pack_for_cpu``,
    ``sz1 [E, K/gs, 2N, 2]``, ``sz2 [E, N/gs, K, 2]`` (scale, zero) in ``x``'s dtype."""
    mm = torch._weight_int4pack_mm_for_cpu
    return _per_expert_loop(x, 2 * p2.shape[2], topk_weights, topk_ids,
                            lambda e, a: mm(a, p1[e], group_size, sz1[e]),
                            lambda e, a: mm(a, p2[e], group_size, sz2[e]))


_TORCH_OP_REASON: Dict[tuple, Optional[str]] = {}


def _torch_op_unavailable(names: Sequence[str], dtype, check: Callable[[torch.dtype], bool]
                          ) -> Optional[str]:
    """None when torch has every function in ``names`` and ``check(dtype)`` (a tiny product
    with a known result) passes; else why not. Checked once per (names, dtype)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    key = (tuple(names), dtype)
    if key not in _TORCH_OP_REASON:
        missing = [n for n in names if getattr(torch, n, None) is None]
        reason = None
        if missing:
            reason = f"torch {torch.__version__} has no torch.{missing[0]}"
        else:
            try:
                if not check(dtype):
                    reason = f"torch.{names[-1]} gave a wrong result on a test product"
            except Exception as e:  # any failure means "not usable here"
                reason = f"torch.{names[-1]}: {type(e).__name__}: {str(e).splitlines()[0]}"
        _TORCH_OP_REASON[key] = reason
    return _TORCH_OP_REASON[key]


def int8pack_unavailable(dtype) -> Optional[str]:
    """None when ``torch._weight_int8pack_mm`` works here for activations of ``dtype``."""
    def check(dt: torch.dtype) -> bool:
        y = torch._weight_int8pack_mm(torch.ones(2, 64, dtype=dt),
                                      torch.full((32, 64), 2, dtype=torch.int8),
                                      torch.full((32,), 0.5, dtype=dt))
        return tuple(y.shape) == (2, 32) and bool((y.float() == 64).all())

    return _torch_op_unavailable(["_weight_int8pack_mm"], dtype, check)


def int4pack_unavailable(dtype) -> Optional[str]:
    """None when ``torch._weight_int4pack_mm_for_cpu`` (with
    ``torch._convert_weight_to_int4pack_for_cpu``) works here for activations of ``dtype``."""
    def check(dt: torch.dtype) -> bool:
        packed = torch._convert_weight_to_int4pack_for_cpu(
            torch.full((32, 64), 9, dtype=torch.int32), 2)
        sz = torch.tensor([0.5, 0.25], dtype=dt).expand(2, 32, 2).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(torch.ones(2, 64, dtype=dt), packed, 32, sz)
        # each weight is (9 - 8) * 0.5 + 0.25
        return tuple(y.shape) == (2, 32) and bool((y.float() == 48).all())

    return _torch_op_unavailable(["_convert_weight_to_int4pack_for_cpu",
                                  "_weight_int4pack_mm_for_cpu"], dtype, check)


@dataclass(frozen=True)
class Baseline:
    """A PyTorch implementation a user would run instead: a row of :data:`BASELINES`."""

    key: str  # JSON prefix: {key}_ms, {key}_iters, rel_diff_vs_{key}, ...
    column: str  # table columns "{column} ms" and "vs {column}"
    text: str  # what it is, for the table header
    unavailable: Callable[[torch.dtype], Optional[str]]
    # (weights, x) -> the call on one routing
    make_call: Callable[[ExpertWeights, torch.Tensor], Callable[[Routing], torch.Tensor]]


def _eager_call(w: ExpertWeights, x: torch.Tensor):
    return lambda r: baseline_moe(x, w.w1, w.w2, r.topk_weights, r.topk_ids)


def _int8pack_call(w: ExpertWeights, x: torch.Tensor):
    q1, s1, q2, s2 = w.torch_data
    s1 = s1.squeeze(-1).to(x.dtype)  # _weight_int8pack_mm wants [OC] in A's dtype
    s2 = s2.squeeze(-1).to(x.dtype)
    return lambda r: baseline_int8pack_moe(x, q1, s1, q2, s2, r.topk_weights, r.topk_ids)


def _int4pack_call(w: ExpertWeights, x: torch.Tensor):
    p1, sz1, p2, sz2, gs = w.torch_data
    return lambda r: baseline_int4pack_moe(x, p1, sz1, p2, sz2, gs, r.topk_weights, r.topk_ids)


BASELINES: Dict[str, Baseline] = {b.key: b for b in (
    Baseline("baseline", "eager", "the eager per-expert PyTorch loop in the activation dtype "
             "(quantized schemes: over the dequantized weights)", lambda dt: None, _eager_call),
    Baseline("int8pack", "int8pack", "a per-expert loop over torch._weight_int8pack_mm (int8 "
             "weights, 16-bit activations), int8 rows", int8pack_unavailable, _int8pack_call),
    Baseline("int4pack", "int4pack", "a per-expert loop over torch._weight_int4pack_mm_for_cpu "
             "(the same int4 weights and groups, 16-bit activations), int4 rows",
             int4pack_unavailable, _int4pack_call),
)}


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


def _speedup_key(key: str) -> str:
    """JSON key of a baseline's ratio: ``speedup`` (eager), ``speedup_int8pack``, ..."""
    return "speedup" if key == "baseline" else f"speedup_{key}"


def _layered_call(weights: ExpertWeights, x: torch.Tensor, weight_layers: Optional[int]):
    """cpumoe's call on one routing, cycling through ``weight_layers`` copies of the weights
    (default :func:`default_weight_layers`), and the number of copies."""
    layers = weights.layers(weight_layers or default_weight_layers(weights.layer_bytes()))
    calls = itertools.count()

    def call(r: Routing) -> torch.Tensor:
        w1p, w2p, kwargs = layers[next(calls) % len(layers)]
        return fused_experts(x, w1p, w2p, r.topk_weights, r.topk_ids, is_vnni=True, **kwargs)

    return call, len(layers)


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
    torch_baseline: bool = True,
    capped: Optional[dict] = None,
    limits: Optional[Limits] = None,
    read_gbps: Optional[float] = None,
    fma_peak_gflops: Optional[float] = None,
    int8_peak_gops: Optional[float] = None,
    scaling_threads: Sequence[int] = (),
    scaling_limits: Optional[Dict[int, Limits]] = None,
    seed: int = 0,
    weight_layers: Optional[int] = None,
    progress: Optional[Callable[[float, str], None]] = None,
) -> dict:
    """Times one (shape, scheme, M) case and returns its JSON record.

    ``shape`` is a :class:`Shape`, a name accepted by :func:`parse_shapes` or a tuple
    ``(E, topk, K, N)``. ``scheme`` is a name of :data:`SCHEMES`: ``"bf16"``/``"fp16"``
    (weights and activations in that dtype; overrides ``dtype``) or a quantized scheme
    (activations in ``dtype``); default: ``weights.scheme``, else ``dtype``. ``weights``
    (an :class:`ExpertWeights` of that shape, scheme and dtype) is created if not given.
    Each call gets a fresh pre-generated routing; the number of timed calls is ``iters``
    if given, else enough for ``min_time`` seconds, clamped to ``[min_iters, max_iters]``
    (estimated from the warm-up). The baselines (``baseline``: the eager loop; with
    ``torch_baseline`` also the scheme's torch path, e.g. the ``torch._weight_int8pack_mm``
    loop for int8, where torch has it) use the same routings (a prefix, when slower).
    cpumoe's calls cycle through ``weight_layers`` copies of the weights (default
    :func:`default_weight_layers`: weights come from DRAM, as in a model with many layers);
    the baselines read one copy (which, if anything, favours them).
    ``capped`` is this case's result from :func:`run_capped_baseline`, if any. ``ms`` is
    the median. Fractions and the bound are filled in when ``limits`` (or ``read_gbps`` and
    the scheme's peak: ``fma_peak_gflops`` or ``int8_peak_gops``) are given, else None.
    For each count in ``scaling_threads`` cpumoe is timed again with that many torch
    threads (``thread_scaling``; its bound fraction against ``scaling_limits[count]``).
    ``progress(fraction_of_case, text)`` is called as the case advances.
    """
    shape = _as_shape(shape)
    if M <= 0:
        raise ValueError(f"M must be positive, got {M}")
    if scheme is None:
        scheme = weights.scheme if weights is not None else _dtype_name(dtype)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got '{scheme}'")
    spec = SCHEMES[scheme]
    if spec.float_weights:
        dtype = scheme
    dname = _dtype_name(dtype)
    tdtype = DTYPES[dname]
    if weights is None:
        weights = ExpertWeights(shape, dname, seed, scheme=scheme)
    if (weights.scheme != scheme or weights.dtype != tdtype
            or weights.w1.shape != (shape.E, 2 * shape.N, shape.K)):
        raise ValueError("weights do not match the case's shape, scheme and dtype")
    if limits is None:
        limits = Limits(read_gbps, fma_peak_gflops, int8_peak_gops)
    E, topk, K, N = shape.E, shape.topk, shape.K, shape.N
    report = progress or (lambda frac, text: None)
    label = f"{shape.name} {scheme} M={M}"

    g, x, warm = _case_inputs(shape, M, tdtype, seed)

    call_cpumoe, n_layers = _layered_call(weights, x, weight_layers)

    impls = []  # in-process baselines: (Baseline, fn)
    keys = ["baseline"] if baseline else []
    if baseline and torch_baseline and spec.torch_baseline:
        keys.append(spec.torch_baseline)
    for key in keys:
        b = BASELINES[key]
        if b.unavailable(tdtype) is None:
            impls.append((b, b.make_call(weights, x)))

    threads = torch.get_num_threads()
    scaling_threads = [c for c in scaling_threads if c != threads]
    share = 1.0 / (1 + len(impls) + len(scaling_threads))
    found: Dict[str, tuple] = {}
    scaled: List[tuple] = []
    with torch.inference_mode():
        gc.collect()
        report(0.0, f"{label}: cpumoe warm-up")
        n = _iterations(_warm_up(call_cpumoe, warm), iters, min_time, min_iters, max_iters)
        routings = make_routings(n, M, E, topk, g)
        times, out_c, load_c = _time_calls(call_cpumoe, routings,
                                           _ticker(report, 0.0, share, n, f"{label}: cpumoe"))
        for k, (b, fn) in enumerate(impls):
            lo = share * (k + 1)
            name = f"{b.column} baseline"
            report(lo, f"{label}: {name} warm-up")
            nb = min(_iterations(_warm_up(fn, warm), iters, min_time, min_iters, max_iters), n)
            bt, out_b, load_b = _time_calls(fn, routings[:nb],
                                            _ticker(report, lo, share, nb, f"{label}: {name}"))
            found[b.key] = (bt, _rel_diff(out_c, out_b), load_b.fraction)
        for k, count in enumerate(scaling_threads):
            lo = share * (1 + len(impls) + k)
            report(lo, f"{label}: cpumoe at {count} threads warm-up")
            torch.set_num_threads(count)
            try:
                nt = min(_iterations(_warm_up(call_cpumoe, warm), iters, min_time, min_iters,
                                     max_iters), n)
                st, out_t, load_t = _time_calls(
                    call_cpumoe, routings[:nt],
                    _ticker(report, lo, share, nt, f"{label}: cpumoe at {count} threads"))
            finally:
                torch.set_num_threads(threads)
            scaled.append((count, st, torch.equal(out_t, out_c), load_t.fraction))

    distinct = statistics.fmean(int(torch.unique(r.topk_ids).numel()) for r in routings)
    weight_bytes = distinct * weights.expert_bytes()
    flops = 2.0 * M * topk * 3 * N * K
    sec = statistics.median(times)
    peak = limits.peak(spec.peak_kind)
    bound = limits.bound(weight_bytes, flops, spec.peak_kind)
    rec = {
        "shape": shape.name, "scheme": scheme, "E": E, "topk": topk, "K": K, "N": N, "M": M,
        "dtype": dname,
        "moe_comp_method": int(spec.method),
        "threads": threads,
        "tier": _C.active_isa(),
        "ms": sec * 1e3,
        "ms_min": min(times) * 1e3,
        "iters": len(times),
        "distinct_experts": distinct,
        "weight_layers": n_layers,
        "weight_bytes": weight_bytes,
        "gbps": weight_bytes / sec / 1e9,
        "bw_fraction": weight_bytes / sec / 1e9 / limits.read_gbps if limits.read_gbps else None,
        "flops": flops,
        "gflops": flops / sec / 1e9,
        "peak_kind": spec.peak_kind,
        "peak_fraction": flops / sec / 1e9 / peak if peak else None,
        "bound": bound[0] if bound else None,
        "bound_ms": bound[1] * 1e3 if bound else None,
        "bound_fraction": bound[1] / sec if bound else None,
    }
    for key in BASELINES:
        bt, diff, others = found.get(key, (None, None, None))
        med = statistics.median(bt) if bt else None
        rec.update({
            f"{key}_ms": med * 1e3 if med else None,
            f"{key}_iters": len(bt) if bt else None,
            _speedup_key(key): med / sec if med else None,
            f"rel_diff_vs_{key}": diff,
        })
    cap = capped if capped and capped.get("ms") else None
    rec.update({
        "eager_capped_ms": cap["ms"] if cap else None,
        "eager_capped_iters": cap["iters"] if cap else None,
        "speedup_capped": cap["ms"] / (sec * 1e3) if cap else None,
        "rel_diff_vs_capped": _rel_diff(out_c, cap.get("out")) if cap else None,
        "others_cpu_fraction": load_c.fraction,
    })
    for key in BASELINES:
        rec[f"{key}_others_cpu_fraction"] = found.get(key, (None,) * 3)[2]
    rec["capped_others_cpu_fraction"] = cap.get("others_cpu_fraction") if cap else None
    rec["thread_scaling"] = []
    for count, st, identical, others in scaled:
        ms_c = statistics.median(st)
        lim = (scaling_limits or {}).get(count)
        b_c = lim.bound(weight_bytes, flops, spec.peak_kind) if lim else None
        rec["thread_scaling"].append({
            "threads": count, "ms": ms_c * 1e3, "ms_min": min(st) * 1e3, "iters": len(st),
            "scaling": ms_c / sec,  # how much faster the row's thread count is
            "bound_ms": b_c[1] * 1e3 if b_c else None,
            "bound_fraction": b_c[1] / ms_c if b_c else None,
            "identical_output": identical,
            "others_cpu_fraction": others,
        })
    return rec


def run_interleaved(
    shape,
    M: int,
    weights: Sequence[ExpertWeights],
    *,
    iters: Optional[int] = None,
    min_time: float = 1.0,
    min_iters: int = 3,
    max_iters: int = 200,
    seed: int = 0,
    weight_layers: Optional[int] = None,
) -> dict:
    """Times cpumoe on several weight schemes of one shape in one loop: every routing is
    run by each scheme in turn, the order rotating from one routing to the next, each
    scheme cycling through its own copies of the weights (as in :func:`run_case`). A slow
    spell of a shared machine then lands on all of them alike, so their time ratio is
    steadier than that of rows timed minutes apart. ``weights`` are :class:`ExpertWeights`
    of ``shape`` with distinct schemes; each gets x (the same draw) in its activation
    dtype. The number of routings is ``iters`` if given, else enough for every scheme to
    run ``min_time`` seconds, clamped to ``[min_iters, max_iters]``. Returns ``{"shape", "M", "schemes",
    "ms": {scheme: median}, "ms_min": {...}, "weight_layers": {...}, "iters"}``."""
    shape = _as_shape(shape)
    if M <= 0:
        raise ValueError(f"M must be positive, got {M}")
    names = [w.scheme for w in weights]
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"run_interleaved needs at least two distinct schemes, got {names}")
    if any(w.w1.shape != (shape.E, 2 * shape.N, shape.K) for w in weights):
        raise ValueError("weights do not match the case's shape")
    # each scheme gets x in its activation dtype (w.dtype), from the same fp32 draw
    g, x32, warm = _case_inputs(shape, M, torch.float32, seed)
    calls = []  # (scheme, copies, call)
    for w in weights:
        call, copies = _layered_call(w, x32.to(w.dtype), weight_layers)
        calls.append((w.scheme, copies, call))
    times: Dict[str, List[float]] = {name: [] for name in names}
    with torch.inference_mode():
        gc.collect()
        slowest = max(_warm_up(call, warm) for _, _, call in calls)
        n = _iterations(slowest, iters, min_time, min_iters, max_iters)
        for i, r in enumerate(make_routings(n, M, shape.E, shape.topk, g)):
            for name, _, call in calls[i % len(calls):] + calls[:i % len(calls)]:
                times[name].append(_timed(call, r)[0])
    return {
        "shape": shape.name, "M": M, "schemes": names, "iters": n,
        "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "ms_min": {k: min(v) * 1e3 for k, v in times.items()},
        "weight_layers": {name: count for name, count, _ in calls},
    }


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
    ("tier", 6, lambda r: r.get("tier") or "-"),
    ("thr", 3, lambda r: str(r.get("threads") or "-")),
    ("ms", 9, lambda r: f"{r['ms']:.2f}"),
    ("bound ms", 9, lambda r: _ms(r.get("bound_ms"))),
    ("bound", 5, lambda r: {"bandwidth": "bw", "compute": "ops"}.get(r["bound"], "-")),
    ("%bound", 6, lambda r: _pct(r["bound_fraction"])),
    ("wt MB", 7, lambda r: f"{r['weight_bytes'] / 1e6:.0f}"),
    ("GB/s", 6, lambda r: f"{r['gbps']:.1f}"),
    ("%bw", 5, lambda r: _pct(r["bw_fraction"])),
    ("GOP/s", 7, lambda r: f"{r['gflops']:.1f}"),
    ("%peak", 5, lambda r: _pct(r["peak_fraction"])),
    ("others", 7, lambda r: _others(r)),
]
_CAPPED_COLUMNS = [
    ("capped ms", 10, lambda r: _ms(r.get("eager_capped_ms"))),
    ("vs capped", 9, lambda r: _ratio(r.get("speedup_capped"))),
]


def _baseline_columns(key: str) -> list:
    col = BASELINES[key].column
    width = max(len(col) + 3, 8)
    return [(f"{col} ms", width, lambda r: _ms(r.get(f"{key}_ms"))),
            (f"vs {col}", width, lambda r: _ratio(r.get(_speedup_key(key))))]


def _scaling_columns(count: int, threads: int) -> list:
    def entry(r: dict) -> Optional[dict]:
        return next((s for s in r.get("thread_scaling") or [] if s["threads"] == count), None)

    def ms(r: dict) -> str:
        e = entry(r)
        return _ms(e["ms"] if e else None) + ("" if not e or e["identical_output"] else "!")

    def ratio(r: dict) -> str:
        e = entry(r)
        return _ratio(e["scaling"] if e else None)

    return [(f"{count}t ms", 9, ms), (f"{count}->{threads}t", 7, ratio)]


def table_columns(int8pack: bool = False, capped: bool = False,
                  baselines: Sequence[str] = (), scaling: Sequence[int] = (),
                  threads: Optional[int] = None) -> list:
    """The table's columns: the base ones, then for each key of :data:`BASELINES` in
    ``baselines`` (``int8pack=True`` adds "int8pack") its time and ratio, the capped
    baseline's, and for each count in ``scaling`` cpumoe's time at that many threads and
    its ratio to the row's (``threads``) time; "others" last."""
    keys = list(baselines) + (["int8pack"] if int8pack and "int8pack" not in baselines else [])
    extra: list = []
    for key in BASELINES:  # in table order
        if key in keys:
            extra += _baseline_columns(key)
    extra += _CAPPED_COLUMNS if capped else []
    threads = threads or torch.get_num_threads()
    for count in scaling:
        extra += _scaling_columns(count, threads)
    return _COLUMNS[:-1] + extra + _COLUMNS[-1:]


NOISY = 0.10  # others' share of the CPUs above which a row is flagged


def case_others_fraction(rec: dict) -> Optional[float]:
    """Largest share of the CPUs used by other processes while the case was timed."""
    keys = (["others_cpu_fraction", "capped_others_cpu_fraction"]
            + [f"{k}_others_cpu_fraction" for k in BASELINES])
    vals = [rec[k] for k in keys if rec.get(k) is not None]
    vals += [s["others_cpu_fraction"] for s in rec.get("thread_scaling") or []
             if s.get("others_cpu_fraction") is not None]
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


# ---- roofline picture ----------------------------------------------------------------------


def _matplotlib_figure():
    """matplotlib's Figure class (imported here: matplotlib is optional); a clear error
    when it is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise RuntimeError("--plot needs matplotlib, which is not installed here "
                           "(pip install matplotlib)") from None
    return Figure, Line2D


def write_plot(doc: dict, path: str):
    """Draws the roofline picture of a run (``doc`` is the ``--json`` document) into
    ``path`` (PNG, or any format matplotlib infers from the name): one panel per scheme,
    log-log, x = M, y = GOP/s = 2·M·topk·3·N·K / time. Per shape (one colour): cpumoe
    (solid, dots), its bound (dashed: ops / bound time, i.e. the bandwidth line rising with
    M until it meets the peak) and the eager baseline (dotted). Returns the matplotlib
    Figure."""
    Figure, Line2D = _matplotlib_figure()
    cases = doc["cases"]
    if not cases:
        raise ValueError("no cases to plot")
    schemes = list(dict.fromkeys(c["scheme"] for c in cases))
    shapes = list(dict.fromkeys(c["shape"] for c in cases))
    colour = {s: f"C{i % 10}" for i, s in enumerate(shapes)}
    ncol = min(len(schemes), 3)
    nrow = -(-len(schemes) // ncol)
    fig = Figure(figsize=(5.2 * ncol, 4.2 * nrow + 0.9), layout="constrained")
    axes = fig.subplots(nrow, ncol, squeeze=False)
    for ax, scheme in zip(axes.flat, schemes):
        for shape in shapes:
            rows = sorted((c for c in cases if c["scheme"] == scheme and c["shape"] == shape),
                          key=lambda c: c["M"])
            if not rows:
                continue
            ms = [c["M"] for c in rows]
            ax.plot(ms, [c["gflops"] for c in rows], "o-", color=colour[shape], ms=4)
            bound = [(c["M"], c["flops"] / c["bound_ms"] / 1e6) for c in rows if c["bound_ms"]]
            if bound:
                ax.plot(*zip(*bound), "--", color=colour[shape], lw=1.2)
            eager = [(c["M"], c["flops"] / c["baseline_ms"] / 1e6) for c in rows
                     if c.get("baseline_ms")]
            if eager:
                ax.plot(*zip(*eager), ":", color=colour[shape], lw=1.2)
        kind = SCHEMES[scheme].peak_kind if scheme in SCHEMES else "fp32_fma"
        ax.set_title(f"{scheme} (bound: read bandwidth, "
                     f"{'u8*s8' if kind == 'u8s8' else 'fp32 FMA'} peak)", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("GOP/s (2·M·topk·3·N·K / time)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(schemes):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=colour[s], marker="o", ms=4, label=s) for s in shapes]
    handles += [Line2D([], [], color="k", ls=ls, label=text) for ls, text in
                (("-", "cpumoe"), ("--", "bound (roofline)"), (":", "eager PyTorch loop"))]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5),
               fontsize=9, frameon=False)
    m = doc["machine"]
    limits = f"read {m['read_gbps']:.1f} GB/s, fp32 FMA {m['fma_peak_gflops']:.0f} GFLOP/s"
    if m.get("int8_peak_gops"):
        limits += f", u8*s8 {m['int8_peak_gops']:.0f} GOP/s"
    fig.suptitle(f"cpumoe {m['cpumoe_version']} fused_experts, tier {m['tier']}, "
                 f"{m['threads']} threads, {m['cpu_model']}\nlimits measured in the run: "
                 f"{limits}", fontsize=10)
    if path.lower().endswith(".png"):
        # a 64-colour palette keeps the picture ~4x smaller than matplotlib's RGBA PNG with
        # no visible change (Pillow comes with matplotlib)
        from PIL import Image

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        buf.seek(0)
        Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)
    else:
        fig.savefig(path, dpi=100)
    return fig


# ---- CLI -----------------------------------------------------------------------------------

# --quick: a representative subset that finishes in under 2 minutes on the 2-vCPU dev VM:
# one shape, every scheme, decode / mid / prefill M, shorter timing, 1-thread scaling.
QUICK = {"shape": "qwen3-30b-a3b", "scheme": "bf16,int8,fp8,int4", "m": "1,64,512",
         "min_time": 0.3}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shape", default=None,
                   help="%s (default %s), all, or custom:E,topk,K,N (K, N multiples of 32); "
                        "join several with '+'" % (", ".join(SHAPES), DEFAULT_SHAPE))
    p.add_argument("--m", type=_parse_m, default=None, metavar="M,M,...",
                   help="token counts, or all (%s) (default: %s)"
                        % (",".join(map(str, ALL_M)), ",".join(map(str, DEFAULT_M))))
    p.add_argument("--scheme", type=parse_schemes, default=None, metavar="S,S,...",
                   help="weight schemes, comma list of %s or all: bf16, fp16 (weights and "
                        "activations in that dtype), int8 (INT8 W8A8), fp8 (FP8 W8A16), int4 "
                        "(INT4 W4A8; skipped with the reason if this cpumoe cannot run it); "
                        "quantized schemes take activations in --dtype (default: --dtype)"
                        % ", ".join(SCHEMES))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="activation and weight dtype when --scheme is not given; the "
                        "activation dtype of the quantized schemes' rows (default bf16)")
    p.add_argument("--threads", type=_parse_threads, default=None, metavar="N[,N...]",
                   help="torch.set_num_threads: the rows run at the largest count; each "
                        "other count times cpumoe again (columns 'Nt ms' and 'N->Mt' = time "
                        "at N threads / time of the row), e.g. 1,2 (default: keep torch's, "
                        "%d here)" % torch.get_num_threads())
    p.add_argument("--quick", action="store_true",
                   help="a representative subset in under 2 minutes on a 2-vCPU machine: "
                        "--shape %s --scheme %s --m %s --min-time %s%s; any of these given "
                        "explicitly wins"
                        % (QUICK["shape"], QUICK["scheme"], QUICK["m"], QUICK["min_time"],
                           " --threads 1,%d" % torch.get_num_threads()
                           if torch.get_num_threads() > 1 else ""))
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per case (default: enough for --min-time)")
    p.add_argument("--min-time", type=float, default=None, metavar="SEC",
                   help="seconds of timed calls per case and implementation when --iters is "
                        "not given; at least 3 calls (fewer if they would take over 4x this), "
                        "at most 200 (default 2.0)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the in-process baselines (the PyTorch eager per-expert loop and "
                        "torch's int8/int4 weight-only loops)")
    p.add_argument("--baseline-isa", metavar="NAME", default=None,
                   help="also time the eager baseline in a subprocess started with "
                        "ONEDNN_MAX_CPU_ISA=NAME, e.g. avx512_core_vnni (a Cascade Lake class "
                        "CPU: no AVX512-BF16, no AMX) or avx2 (columns 'capped ms', "
                        "'vs capped'); independent of --no-baseline")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write a JSON document to PATH ('-' = stdout; the table then "
                        "goes to stderr)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the roofline picture (achieved and bound GOP/s over M, a "
                        "panel per scheme, log axes) into FILE; needs matplotlib")
    p.add_argument("--progress", action="store_true",
                   help="show the progress bar even if stderr is not a terminal")
    p.add_argument("--bw-mib", type=int, default=None, metavar="MiB",
                   help="buffer of the bandwidth probe (default max(1 GiB, 4 x LLC))")
    p.add_argument("--weight-layers", type=int, default=None, metavar="N",
                   help="copies of each case's weights that cpumoe's calls cycle through, as "
                        "the layers of a model (default: enough for max(1 GiB, 8 x LLC), at "
                        "most %d)" % MAX_WEIGHT_LAYERS)
    p.add_argument("--interleave", type=parse_pairs, default=None, metavar="A/B,...",
                   help="after the rows, time each pair of schemes in one loop, their calls "
                        "alternating on the same routings, for every shape and M; reports "
                        "A ms / B ms (how many times faster B is), much less exposed than two "
                        "rows to the drift of a shared machine; e.g. bf16/int8,int8/int4")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and routings")
    return p


def build_parser(prog: str = "python -m cpumoe bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Time cpumoe.fused_experts (bf16/fp16, INT8, FP8 or INT4 weights) on MoE "
                    "model shapes against the machine's measured streaming-read bandwidth and "
                    "fp32 FMA / u8*s8 peak (the roofline), and against the PyTorch code a user "
                    "would run instead.")
    return add_arguments(p)


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the options not given from the ``--quick`` preset or the defaults."""
    quick = bool(getattr(args, "quick", False))
    if args.shape is None:
        args.shape = QUICK["shape"] if quick else DEFAULT_SHAPE
    if args.m is None:
        args.m = _parse_m(QUICK["m"]) if quick else list(DEFAULT_M)
    if args.scheme is None:
        args.scheme = parse_schemes(QUICK["scheme"]) if quick else [args.dtype]
    if args.min_time is None:
        args.min_time = QUICK["min_time"] if quick else 2.0
    if args.threads is None:
        n = torch.get_num_threads()
        args.threads = [n, 1] if quick and n > 1 else [n]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m cpumoe bench``; returns 0 on success."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:1] == [_WORKER_FLAG]:  # the subprocess of --baseline-isa
        return _baseline_worker(argv[1:])
    parser = build_parser()
    args = resolve_arguments(parser.parse_args(argv))
    try:
        shapes = parse_shapes(args.shape)
    except ValueError as e:
        parser.error(str(e))
    if args.iters is not None and args.iters <= 0:
        parser.error("--iters must be positive")
    if args.weight_layers is not None and args.weight_layers <= 0:
        parser.error("--weight-layers must be positive")
    if args.min_time <= 0:
        parser.error("--min-time must be positive")
    if args.baseline_isa is not None and not args.baseline_isa.strip():
        parser.error("--baseline-isa needs a oneDNN ISA name, e.g. avx512_core_vnni")
    if args.plot:
        try:  # fail now, not after the run
            _matplotlib_figure()
        except RuntimeError as e:
            parser.error(str(e))
    torch.set_num_threads(args.threads[0])
    return run(args, shapes)


def _limits_line(label: str, samples: List[float], unit: str, detail: str, fmt: str) -> str:
    return (f"{label}{max(samples):{fmt}} {unit} (best of {len(samples)} {detail}; median "
            f"{statistics.median(samples):{fmt}})")


def _limit_lines(lim: dict, used_by: Dict[str, List[str]]) -> List[str]:
    """The header lines of one thread count's limits; ``used_by[kind]`` = schemes judged
    against that peak."""
    bw, fma, i8 = lim["read"], lim["fma"], lim["int8"]
    out = [_limits_line("streaming read: ", bw["samples_gbps"], "GB/s",
                        f"runs x {bw['passes']} passes over {_fmt_bytes(bw['buffer_bytes'])}",
                        ".1f"),
           _limits_line("fp32 FMA peak:  ", fma["samples_gflops"], "GFLOP/s",
                        f"runs of ~{fma['seconds_per_run']} s", ".0f")]
    if used_by.get("fp32_fma"):
        out[-1] += f"; bound of {', '.join(used_by['fp32_fma'])} rows"
    if i8:
        out.append(_limits_line("u8*s8 peak:     ", i8["samples_gops"], "GOP/s",
                                f"runs of ~{i8['seconds_per_run']} s", ".0f")
                   + f"; bound of {', '.join(used_by.get('u8s8', []))} rows")
    return out


def _limits_json(lim: dict) -> dict:
    bw, fma, i8 = lim["read"], lim["fma"], lim["int8"]
    return {"threads": lim["threads"], "read_gbps": max(bw["samples_gbps"]),
            "read_samples_gbps": bw["samples_gbps"],
            "fma_peak_gflops": max(fma["samples_gflops"]),
            "fma_samples_gflops": fma["samples_gflops"],
            "int8_peak_gops": max(i8["samples_gops"]) if i8 else None,
            "int8_samples_gops": i8["samples_gops"] if i8 else None}


def run_pairs(args: argparse.Namespace, shapes: List[Shape], pairs: List[Tuple[str, str]],
              emit: Callable[[str], None], progress: Callable[[float, str], None]) -> List[dict]:
    """``--interleave``: :func:`run_interleaved` for every shape, pair and M; prints a
    table and returns the records, each with ``pair`` "A/B" and ``ratio`` = A ms / B ms."""
    if not pairs:
        return []
    emit()
    emit("interleaved pairs: the two schemes' calls alternate in one loop (which goes first "
         "swaps every call) on the same routings, each cycling its own weight copies; "
         "ratio = A ms / B ms")
    emit(f"{'shape':<17} {'M':>5} {'pair':>11} {'A ms':>9} {'B ms':>9} {'ratio':>6}")
    records: List[dict] = []
    steps, step = len(shapes) * len(pairs) * len(args.m), 0
    for shape in shapes:
        weights: Dict[str, ExpertWeights] = {}
        for k, (a, b) in enumerate(pairs):
            reason = scheme_unavailable(a, args.dtype) or scheme_unavailable(b, args.dtype)
            if reason:
                emit(f"{shape.name:<17} pair {a}/{b} skipped: {reason}")
                step += len(args.m)
                continue
            for name in (a, b):
                if name not in weights:
                    progress(step / steps, f"{shape.name} {name}: generating and packing weights")
                    weights[name] = ExpertWeights(shape, args.dtype, args.seed, scheme=name)
            for M in args.m:
                progress(step / steps, f"{shape.name} {a}/{b} M={M}: interleaved")
                rec = run_interleaved(shape, M, [weights[a], weights[b]], iters=args.iters,
                                      min_time=args.min_time, seed=args.seed,
                                      weight_layers=args.weight_layers)
                rec["pair"] = f"{a}/{b}"
                rec["ratio"] = rec["ms"][a] / rec["ms"][b]
                records.append(rec)
                emit(f"{shape.name:<17} {M:>5} {a + '/' + b:>11} {rec['ms'][a]:>9.2f} "
                     f"{rec['ms'][b]:>9.2f} {rec['ratio']:>5.2f}x")
                step += 1
            for name in [n for n in weights if all(n not in p for p in pairs[k + 1:])]:
                del weights[name]  # no later pair needs it: free its copies
        del weights
        gc.collect()
    return records


def run(args: argparse.Namespace, shapes: List[Shape]) -> int:
    t_start = time.perf_counter()
    json_stdout = args.json == "-"
    out = sys.stderr if json_stdout else sys.stdout  # the human-readable table
    show_bar = args.progress or (not json_stdout and sys.stderr.isatty())
    threads, scaling = args.threads[0], list(args.threads[1:])

    def emit(line: str = "") -> None:
        bar.write(line, out)

    bar = Progress(1.0, enabled=False)
    skipped = {s: r for s in args.scheme if (r := scheme_unavailable(s, args.dtype))}
    schemes = [s for s in args.scheme if s not in skipped]
    for s, reason in skipped.items():
        emit(f"scheme {s} skipped: {reason}")
    if not schemes:
        emit("nothing to run: every scheme asked for was skipped")
        return 1
    used_by: Dict[str, List[str]] = {}
    for s in schemes:
        used_by.setdefault(SCHEMES[s].peak_kind, []).append(s)
    need_int8 = "u8s8" in used_by
    capped_isa = args.baseline_isa.strip() if args.baseline_isa else None
    baseline_keys = [] if args.no_baseline else ["baseline"]
    unavailable: Dict[str, Optional[str]] = {}
    for s in schemes:
        key = SCHEMES[s].torch_baseline
        if key and not args.no_baseline and key not in unavailable:
            unavailable[key] = BASELINES[key].unavailable(DTYPES[args.dtype])
            if unavailable[key] is None:
                baseline_keys.append(key)
    total_cases = len(shapes) * len(schemes) * len(args.m)
    # budget: 1 unit per case (+0.3 per scaling count), 0.5 per case for the capped
    # baseline, 0.5 (0.7 with the u8*s8 peak) per thread count for the limits, 0.25 at the end
    t_limits = (0.7 if need_int8 else 0.5) * len(args.threads)
    t_capped = 0.5 * total_cases if capped_isa else 0.0
    case_units = 1 + 0.3 * len(scaling)
    pairs = list(args.interleave or [])
    t_pairs = len(shapes) * len(pairs) * len(args.m)
    bar = Progress(total_cases * case_units + t_limits + t_capped + t_pairs + 0.25,
                   enabled=show_bar)

    info = machine_info()
    busy0 = cpu_busy_fraction()
    bw_bytes = args.bw_mib << 20 if args.bw_mib else None
    columns = table_columns(baselines=baseline_keys, capped=bool(capped_isa), scaling=scaling,
                            threads=threads)
    try:
        bar.update(0.0, f"measuring the limits at {threads} threads", force=True)
        lim_main = measure_limits(need_int8, bw_bytes)
        lim_by_threads = {threads: lim_main}
        for k, count in enumerate(scaling):
            bar.update(t_limits * (k + 1) / len(args.threads),
                       f"measuring the limits at {count} threads", force=True)
            torch.set_num_threads(count)
            try:
                lim_by_threads[count] = measure_limits(need_int8, bw_bytes)
            finally:
                torch.set_num_threads(threads)
        limits = lim_main["limits"]
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

        emit(f"cpumoe {info['cpumoe_version']} bench: tier {info['tier']}, {threads} "
             f"thread{'s' if threads > 1 else ''}"
             + (f" (and {', '.join(map(str, scaling))} for the scaling columns)"
                if scaling else "") + f", torch {info['torch_version']}")
        emit(f"CPU: {info['cpu_model']} ({info['logical_cpus']} logical CPUs"
             + (f", LLC {_fmt_bytes(info['last_level_cache_bytes'])}"
                if info["last_level_cache_bytes"] else "") + ")")
        emit(f"tier: {info['isa_reason']}")
        for s in schemes:
            emit(f"{s}: {SCHEMES[s].text}"
                 + ("" if SCHEMES[s].float_weights else f"; {args.dtype} activations"))
        for line in _limit_lines(lim_main, used_by):
            emit(line)
        for count in scaling:
            emit(f"at {count} thread{'s' if count > 1 else ''}:")
            for line in _limit_lines(lim_by_threads[count], used_by):
                emit("  " + line)
        if busy0 is not None and busy0 > 0.1:
            emit(f"WARNING: other processes kept the CPUs {100 * busy0:.0f}% busy just before "
                 "the run; figures will be noisy")
        emit("fresh random routing on every call, and cpumoe's calls cycle through copies "
             "of the weights ('layers', at least max(1 GiB, 8 x LLC) in all unless "
             "--weight-layers), so weights come from DRAM; ms = median;")
        emit("bound ms = the larger of weight bytes / read bandwidth (bound 'bw') and "
             "operations / peak (bound 'ops'); %bound = bound ms / ms; %bw, %peak likewise;")
        for key in baseline_keys:
            b = BASELINES[key]
            emit(f"vs {b.column} = {b.text} / cpumoe;")
        for key, reason in unavailable.items():
            if reason:
                emit(f"{BASELINES[key].column} baseline skipped: {reason}")
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
        for count in scaling:
            emit(f"{count}->{threads}t = cpumoe's time at {count} thread"
                 f"{'s' if count > 1 else ''} / its time at {threads} (ideal "
                 f"{threads / count:.2f}x; '!' after '{count}t ms': output not bit-identical);")
        emit("others = share of the CPUs used by other processes while the case was timed")
        emit()
        emit(format_header_row(columns))

        cases: List[dict] = []
        done = 0.0
        scaling_limits = {c: lim_by_threads[c]["limits"] for c in scaling}
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
                        baseline=not args.no_baseline, capped=cap, limits=limits,
                        scaling_threads=scaling, scaling_limits=scaling_limits,
                        seed=args.seed, weight_layers=args.weight_layers,
                        progress=lambda f, text, d=done: bar.update(
                            t0_cases + d + case_units * f, text))
                    cases.append(rec)
                    emit(format_row(rec, columns))
                    done += case_units
                    bar.update(t0_cases + done)
                del weights
                gc.collect()

        interleaved = run_pairs(args, shapes, pairs, emit,
                                lambda f, text, d=done: bar.update(t0_cases + d + t_pairs * f,
                                                                   text))
        done += t_pairs

        bar.update(t0_cases + done, "re-measuring streaming-read bandwidth", force=True)
        bw1 = _read_bandwidth_samples(bw_bytes)
        read_end = max(bw1["samples_gbps"])
        busy1 = cpu_busy_fraction()
        bar.update(t0_cases + done + 0.25)
        wall = time.perf_counter() - t_start
        emit()
        drift = (read_end - limits.read_gbps) / limits.read_gbps
        emit(f"streaming read at the end: {read_end:.1f} GB/s (start {limits.read_gbps:.1f}, "
             f"{100 * drift:+.0f}%){'  -- the machine was noisy' if abs(drift) > 0.1 else ''}")
        noisy = [c for c in cases if (case_others_fraction(c) or 0) > NOISY]
        if noisy:
            emit(f"* {len(noisy)} case(s) ran while other processes used more than "
                 f"{100 * NOISY:.0f}% of the CPUs (column 'others'); rerun them on a quiet machine")
        others = [v for c in cases if (v := case_others_fraction(c)) is not None]
        if others:
            emit(f"others' share of the CPUs while timing: median {100 * statistics.median(others):.0f}%,"
                 f" max {100 * max(others):.0f}% over {len(others)} case(s)")
        for key in list(BASELINES) + ["capped"]:
            diffs = [c[f"rel_diff_vs_{key}"] for c in cases if c[f"rel_diff_vs_{key}"] is not None]
            name = f"{BASELINES[key].column} baseline" if key in BASELINES else "capped eager baseline"
            if diffs:
                emit(f"cpumoe vs {name}: max relative L2 difference {max(diffs):.1e}"
                     + ("  -- LARGER THAN EXPECTED" if max(diffs) > 5e-2 else ""))
        differ = [f"{c['shape']} {c['scheme']} M={c['M']} at {s['threads']} threads"
                  for c in cases for s in c["thread_scaling"] if not s["identical_output"]]
        if differ:
            emit(f"WARNING: output not bit-identical across thread counts: {'; '.join(differ)}")
        elif scaling:
            emit(f"cpumoe's outputs at {', '.join(map(str, scaling))} and {threads} threads: "
                 "bit-identical in every case")
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

    bw0, fma, i8 = lim_main["read"], lim_main["fma"], lim_main["int8"]
    machine = dict(info)
    machine.update({
        "read_gbps": limits.read_gbps,
        "read_gbps_end": read_end,
        "read_statistic": "best of runs",
        "read_samples_gbps": bw0["samples_gbps"],
        "read_samples_gbps_end": bw1["samples_gbps"],
        "read_buffer_bytes": bw0["buffer_bytes"],
        "read_passes_per_run": bw0["passes"],
        "cpu_busy_before": busy0,
        "cpu_busy_after": busy1,
        "fma_peak_gflops": limits.fma_gflops,
        "fma_statistic": "best of runs",
        "fma_samples_gflops": fma["samples_gflops"],
        "int8_peak_gops": limits.int8_gops,
        "int8_statistic": "best of runs" if i8 else None,
        "int8_samples_gops": i8["samples_gops"] if i8 else None,
        "limits_by_threads": [_limits_json(lim_by_threads[c]) for c in args.threads],
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
            "skipped_schemes": skipped, "dtype": args.dtype, "threads": args.threads,
            "quick": bool(args.quick), "iters": args.iters, "min_time": args.min_time,
            "baseline": not args.no_baseline, "baselines": baseline_keys,
            "baseline_isa": capped_isa,
            "int8pack_unavailable": unavailable.get("int8pack"),
            "int4pack_unavailable": unavailable.get("int4pack"),
            "seed": args.seed, "timing": "median of per-call wall time, fresh routing per call",
            "weight_layers": args.weight_layers,
            "interleave": [f"{a}/{b}" for a, b in pairs],
        },
        "cases": cases,
        "interleaved": interleaved,
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
    if args.plot:
        write_plot(doc, args.plot)
        print(f"roofline picture: {args.plot}", file=sys.stderr if json_stdout else out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
