"""The machine: what ``python -m cpumoe info`` shows (CPU model, cache, features, tiers;
:func:`machine_info`), what the package was built from (:func:`build_info`), how busy the
other processes keep the CPUs (:class:`OthersLoad`), and the limits every row is judged
against (docs/PERFORMANCE.md): streaming-read bandwidth, fp32 FMA, bf16 and u8*s8 peaks
(:func:`measure_limits`, :class:`Limits`; :func:`peak_loop` names the loop each peak runs
on a tier), and how many weight copies reach DRAM (:func:`default_weight_layers`)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .. import _C


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
    from .. import __version__

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


def weight_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in memory allocated as cpumoe's packers allocate packed weights
    (``_C.new_weight_buffer``: transparent huge pages where the OS gives them), as the read
    probe's buffer is. A ``clone()`` comes from torch's allocator, on 4 KiB pages unless
    THP is ``always``, so calls cycling through cloned weights paid TLB misses that neither
    a packed model nor the probe pays (measured: docs/PERFORMANCE-HISTORY.md)."""
    if not t.is_contiguous() or t.numel() == 0:
        return t.clone()
    buf = _C.new_weight_buffer(t.numel() * t.element_size())
    return buf.view(t.dtype).view(t.shape).copy_(t)


def _read_bandwidth_samples(buffer_bytes: Optional[int] = None, runs: int = 5,
                            passes: int = 2) -> dict:
    """Streams a buffer of ones with ``_C.probe_read`` on torch's threads: one untimed
    warm-up pass, then ``runs`` timed runs of ``passes`` passes each. Returns the per-run
    GB/s (1e9 bytes/s) and the buffer size. The buffer is allocated as cpumoe's packers
    allocate packed weights (``_C.new_weight_buffer``: transparent huge pages where the OS
    gives them), so the limit and the weights are read the same way."""
    size = int(buffer_bytes) if buffer_bytes else default_read_buffer_bytes()
    workers = min(torch.get_num_threads(), 256)
    per_worker = (size // workers) & ~511  # what cpumoe_probe_read actually streams
    if per_worker <= 0:
        raise ValueError(f"read buffer of {size} bytes is too small for {workers} threads")
    streamed = per_worker * workers * passes
    buf = _C.new_weight_buffer(size).fill_(1)
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


def _int4_peak_samples(target_seconds: float = 0.3, runs: int = 3) -> dict:
    """Runs ``_C.probe_int4`` (the register-only loop the active tier's INT4 kernels run:
    ``vpmaddubsw`` of nibbles with a widening ``vpmaddwd`` per 8 on avx2, the u8*s8 loop on
    the tiers whose INT4 kernels run the same instruction as INT8; 2 ops per multiply-add, on
    each of torch's threads) like :func:`_fma_peak_samples`."""
    r = _probe_rate_samples(_C.probe_int4, target_seconds, runs)
    return {"samples_gops": r["samples"], "iterations": r["iterations"],
            "seconds_per_run": target_seconds}


def _bf16_peak_samples(target_seconds: float = 0.3, runs: int = 3) -> dict:
    """Runs ``_C.probe_bf16`` (the loop the active tier's bf16 GEMMs peak at: AMX
    ``tdpbf16ps`` on amx, the fp32 FMA loop on the tiers that widen bf16 to fp32; 2 ops per
    multiply-add, on each of torch's threads) like :func:`_fma_peak_samples`."""
    r = _probe_rate_samples(_C.probe_bf16, target_seconds, runs)
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


def measure_int4_peak(target_seconds: float = 0.3, runs: int = 3, stat: str = "best") -> float:
    """Multiply-add peak of the active tier's INT4 loop in GOP/s (2 ops per multiply-add) on
    torch's current threads (best of ``runs`` runs of ~``target_seconds`` by default)."""
    return _stat(_int4_peak_samples(target_seconds, runs)["samples_gops"], stat)


def measure_bf16_peak(target_seconds: float = 0.3, runs: int = 3, stat: str = "best") -> float:
    """bf16 multiply-add peak of the active tier in GOP/s (2 ops per multiply-add; AMX on
    amx, the fp32 FMA rate elsewhere) on torch's current threads (best of ``runs`` runs of
    ~``target_seconds`` by default)."""
    return _stat(_bf16_peak_samples(target_seconds, runs)["samples_gops"], stat)


def _stat(samples: Sequence[float], stat: str) -> float:
    if stat == "best":
        return max(samples)
    if stat == "median":
        return statistics.median(samples)
    raise ValueError(f"stat must be 'best' or 'median', got '{stat}'")


# The compute ceilings a row can be judged against (a row's ``peak_kind``): the fp32 FMA
# peak (``_C.probe_fma``), the bf16 peak (``_C.probe_bf16``), the u8*s8 peak
# (``_C.probe_int8``) and the peak of the INT4 kernels' loop, 4-bit weights by s8
# activations (``_C.probe_int4``).
PEAK_KINDS = ("fp32_fma", "bf16", "u8s8", "u4s8")

# The loop each compute probe runs, by tier (what the header and the picture name); a
# tier not listed runs the default. Kept in step with csrc/kernels/dispatch/config.c.
_PEAK_LOOPS = {
    "fp32_fma": {None: "fp32 FMA"},
    "bf16": {"amx": "AMX tdpbf16ps", None: "fp32 FMA"},
    "u8s8": {"amx": "AMX tdpbusd", "avx512bf16": "VNNI vpdpbusd", "avx512": "VNNI vpdpbusd",
             "avx2vnni": "AVX-VNNI vpdpbusd", "avx2": "AVX2 vpmaddwd",
             "scalar": "scalar multiply-adds", None: "the tier's u8*s8 loop"},
    "u4s8": {"amx": "AMX tdpbusd", "avx512bf16": "VNNI vpdpbusd", "avx512": "VNNI vpdpbusd",
             "avx2vnni": "AVX-VNNI vpdpbusd", "avx2": "AVX2 vpmaddubsw",
             "scalar": "scalar multiply-adds", None: "the tier's int4 loop"},
}


def peak_loop(kind: str, tier: str) -> str:
    """The instruction loop the probe of peak ``kind`` (one of :data:`PEAK_KINDS`) runs on
    ``tier``: e.g. ``peak_loop("bf16", "amx")`` is "AMX tdpbf16ps" and
    ``peak_loop("bf16", "avx512")`` "fp32 FMA" (that tier widens bf16 to fp32)."""
    loops = _PEAK_LOOPS[kind]
    return loops.get(tier, loops[None])


@dataclass(frozen=True)
class Limits:
    """The machine limits one set of rows is judged against (any may be None: unknown)."""

    read_gbps: Optional[float] = None  # streaming read, 1e9 bytes/s
    fma_gflops: Optional[float] = None  # fp32 FMA peak, 1e9 flop/s
    int8_gops: Optional[float] = None  # u8*s8 peak, 1e9 op/s
    bf16_gops: Optional[float] = None  # bf16 peak (AMX on amx, else the FMA loop), 1e9 op/s
    int4_gops: Optional[float] = None  # the INT4 kernels' loop (u4*s8), 1e9 op/s

    def peak(self, kind: str) -> Optional[float]:
        """The compute ceiling of a row's ``peak_kind`` (one of :data:`PEAK_KINDS`)."""
        if kind == "fp32_fma":
            return self.fma_gflops
        if kind == "bf16":
            return self.bf16_gops
        if kind == "u8s8":
            return self.int8_gops
        if kind == "u4s8":
            return self.int4_gops
        raise ValueError(f"peak kind must be one of {', '.join(PEAK_KINDS)}, got '{kind}'")

    def bound(self, weight_bytes: float, ops: float, kind: str):
        """``("bandwidth" | "compute", seconds)``: the larger of bytes / bandwidth and ops /
        peak, the least time the call can take (the roofline); None if a limit is unknown."""
        peak = self.peak(kind)
        if not self.read_gbps or not peak:
            return None
        t_bw = weight_bytes / (self.read_gbps * 1e9)
        t_ops = ops / (peak * 1e9)
        return ("bandwidth", t_bw) if t_bw >= t_ops else ("compute", t_ops)


def measure_limits(need_int8: bool, buffer_bytes: Optional[int] = None, *,
                   need_bf16: bool = False, need_int4: bool = False) -> dict:
    """All limit samples on torch's current threads: ``{"threads", "read", "fma", "int8",
    "bf16", "int4"}`` (``int8``, ``bf16`` and ``int4`` None unless ``need_int8``,
    ``need_bf16``, ``need_int4``: only the peaks some row is judged against are measured,
    beside the fp32 FMA peak) and ``limits``, a :class:`Limits` of the best runs."""
    bw = _read_bandwidth_samples(buffer_bytes)
    peaks = measure_peaks(need_int8, need_bf16=need_bf16, need_int4=need_int4)
    return {"threads": torch.get_num_threads(), "read": bw, **peaks,
            "limits": best_limits(bw, peaks)}


def best_limits(read: dict, peaks: dict) -> Limits:
    """The :class:`Limits` of the best runs of a read probe's samples and of
    :func:`measure_peaks`' (a peak not measured stays None)."""
    def best(samples: Optional[dict]) -> Optional[float]:
        return max(samples["samples_gops"]) if samples else None

    return Limits(max(read["samples_gbps"]), max(peaks["fma"]["samples_gflops"]),
                  best(peaks["int8"]), best(peaks["bf16"]), best(peaks.get("int4")))


def measure_peaks(need_int8: bool, *, need_bf16: bool = False, need_int4: bool = False) -> dict:
    """The peak samples of :func:`measure_limits` alone: ``{"fma", "int8", "bf16", "int4"}``,
    the last three None unless needed. The bench takes them again after its rows: on a shared
    host the compute peaks drift as much as the bandwidth (docs/PERFORMANCE.md, "Method")."""
    return {"fma": _fma_peak_samples(),
            "int8": _int8_peak_samples() if need_int8 else None,
            "bf16": _bf16_peak_samples() if need_bf16 else None,
            "int4": _int4_peak_samples() if need_int4 else None}


# A limit that moved by more than this between a run's start and its end marks the run noisy.
NOISY_DRIFT = 0.1


def drift_line(what: str, start: float, end: float, unit: str, digits: int = 0) -> str:
    """``<what> at the end: <end> <unit> (start <start>, <change>%)``, flagged when the
    limit moved by more than :data:`NOISY_DRIFT` between the start and the end of a run."""
    drift = (end - start) / start
    return (f"{what} at the end: {end:.{digits}f} {unit} (start {start:.{digits}f}, "
            f"{100 * drift:+.0f}%){'  -- the machine was noisy' if abs(drift) > NOISY_DRIFT else ''}")


UNKNOWN = "unknown"


def build_info() -> dict:
    """What the package was built from, as setup.py's build_py step wrote it into
    ``cpumoe/_build_info.py``: ``git_commit``, ``dirty`` (whether the checkout had changes,
    untracked files included), ``compiler`` (the first line of ``$CC --version``, CC being
    ``cc`` unless set) and ``cc`` (that command). Each is "unknown" when the package was not
    built that way (a source tree with the extension built in place has no such file) or
    the build could not tell (no git)."""
    try:
        from .. import _build_info as recorded
    except ImportError:
        recorded = None
    return {"git_commit": getattr(recorded, "GIT_COMMIT", UNKNOWN),
            "dirty": getattr(recorded, "DIRTY", UNKNOWN),
            "compiler": getattr(recorded, "COMPILER", UNKNOWN),
            "cc": getattr(recorded, "CC", UNKNOWN)}
