"""Timing: one (shape, scheme, M) case of cpumoe against the baselines and at other
thread counts (:func:`run_case`), several schemes interleaved in one loop
(:func:`run_interleaved`), and the loops both share (warm-up, call counts, per-call
timing with the other processes' CPU share)."""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import _C
from ..ops import fused_experts
from .baselines import BASELINES, PEERS, _rel_diff, _speedup_key
from .machine import Limits, OthersLoad, default_weight_layers
from .peers import PeerFormat
from .schemes import SCHEMES, ExpertWeights
from .shapes import DTYPES, Routing, Shape, _as_shape, _dtype_name, make_routings


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
    peers: Sequence[str] = (),
    capped: Optional[dict] = None,
    limits: Optional[Limits] = None,
    read_gbps: Optional[float] = None,
    fma_peak_gflops: Optional[float] = None,
    int8_peak_gops: Optional[float] = None,
    bf16_peak_gops: Optional[float] = None,
    int4_peak_gops: Optional[float] = None,
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
    loop for int8, where torch has it) use the same routings (a prefix, when slower), and
    so do the ``peers`` (keys of :data:`PEERS`: other libraries' kernels, where they run;
    one whose output disagrees with cpumoe's is reported in ``{key}_error``, not timed).
    cpumoe's calls cycle through ``weight_layers`` copies of the weights (default
    :func:`default_weight_layers`: weights come from DRAM, as in a model with many layers);
    the baselines read one copy (which, if anything, favours them).
    ``capped`` is this case's result from :func:`run_capped_baseline`, if any. ``ms`` is
    the median. Fractions and the bound are filled in when ``limits`` (or ``read_gbps`` and
    the peak of the row's ``peak_kind``: ``fma_peak_gflops``, ``bf16_peak_gops``,
    ``int8_peak_gops`` or ``int4_peak_gops``) are given, else None; the kind follows the scheme and the activation
    dtype (:meth:`Scheme.peak_kind`).
    For each count in ``scaling_threads`` cpumoe is timed again with that many torch
    threads (``thread_scaling``; its bound fraction against ``scaling_limits[count]``).
    ``progress(fraction_of_case, text)`` is called as the case advances.
    """
    shape = _as_shape(shape)
    if M <= 0:
        raise ValueError(f"M must be positive, got {M}")
    scheme, dname, weights = _case_weights(shape, dtype, scheme, weights, seed)
    if limits is None:
        limits = Limits(read_gbps, fma_peak_gflops, int8_peak_gops, bf16_peak_gops,
                        int4_peak_gops)
    report = progress or (lambda frac, text: None)
    label = f"{shape.name} {scheme} M={M}"
    g, x, warm = _case_inputs(shape, M, weights.dtype, seed)
    call_cpumoe, n_layers = _layered_call(weights, x, weight_layers)
    baselines, not_here = _baseline_calls(weights, x, baseline and torch_baseline, baseline,
                                          peers)
    threads = torch.get_num_threads()
    scaling_threads = [c for c in scaling_threads if c != threads]
    share = 1.0 / (1 + len(baselines) + len(scaling_threads))
    counts = (iters, min_time, min_iters, max_iters)
    with torch.inference_mode():
        gc.collect()
        report(0.0, f"{label}: cpumoe warm-up")
        n = _iterations(_warm_up(call_cpumoe, warm), *counts)
        routings = make_routings(n, M, shape.E, shape.topk, g)
        times, out_c, load_c = _time_calls(call_cpumoe, routings,
                                           _ticker(report, 0.0, share, n, f"{label}: cpumoe"))
        found, peer_fields = _time_baselines(baselines, out_c, warm, routings, counts, report,
                                             share, label)
        scaled = _time_thread_counts(call_cpumoe, scaling_threads, out_c, warm, routings, counts,
                                     report, share * (1 + len(baselines)), share, label)
    sec = statistics.median(times)
    rec = _case_record(shape, scheme, dname, M, threads, times, routings, weights, n_layers,
                       limits)
    rec.update(_baseline_fields(found, sec, peer_fields, not_here))
    cap = capped if capped and capped.get("ms") else None
    rec.update(_capped_fields(cap, out_c, rec["ms"]))
    rec["others_cpu_fraction"] = load_c.fraction
    for key in BASELINES:
        rec[f"{key}_others_cpu_fraction"] = found.get(key, (None,) * 3)[2]
    rec["capped_others_cpu_fraction"] = cap.get("others_cpu_fraction") if cap else None
    rec["thread_scaling"] = [_scaling_entry(entry, rec, sec, scaling_limits)
                             for entry in scaled]
    return rec


def _case_weights(shape: Shape, dtype, scheme: Optional[str],
                  weights: Optional[ExpertWeights], seed: int):
    """``(scheme, activation dtype name, weights)`` of a case: the scheme defaults to the
    weights' (else the dtype's), bf16/fp16 fix the activation dtype, and the weights are
    made when not given, else checked to match."""
    if scheme is None:
        scheme = weights.scheme if weights is not None else _dtype_name(dtype)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got '{scheme}'")
    if SCHEMES[scheme].float_weights:
        dtype = scheme
    dname = _dtype_name(dtype)
    if weights is None:
        weights = ExpertWeights(shape, dname, seed, scheme=scheme)
    if (weights.scheme != scheme or weights.dtype != DTYPES[dname]
            or weights.w1.shape != (shape.E, 2 * shape.N, shape.K)):
        raise ValueError("weights do not match the case's shape, scheme and dtype")
    return scheme, dname, weights


def _baseline_calls(weights: ExpertWeights, x: torch.Tensor, torch_baseline: bool,
                    eager: bool, peers: Sequence[str] = ()):
    """The in-process baselines that run: the eager loop (with ``eager``), with
    ``torch_baseline`` the scheme's torch path, where torch has it, and the ``peers`` that
    run here and have a format for this row. Returns ``([(Baseline, call, PeerFormat or
    None)], {peer: why it does not run on this row})``; a peer's call may be ``{label:
    call}`` (timed in each setting, the fastest reported)."""
    keys = ["baseline"] if eager else []
    own = SCHEMES[weights.scheme].torch_baseline
    if torch_baseline and own:
        keys.append(own)
    calls, skipped = [], {}
    for k in keys + list(peers):
        b = BASELINES[k]
        why = b.unavailable(weights.dtype)
        if why is not None:
            if k in PEERS:
                skipped[k] = why
            continue
        fmt = b.format(weights) if b.format else None
        if isinstance(fmt, str):
            skipped[k] = fmt
            continue
        try:
            calls.append((b, b.make_call(weights, x), fmt))
        except Exception as e:  # a peer that cannot set this case up is reported, not fatal
            if k not in PEERS:
                raise
            skipped[k] = f"setting up failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    return calls, skipped


def _close(fn) -> None:
    for f in (fn.values() if isinstance(fn, dict) else [fn]):
        getattr(f, "close", lambda: None)()


def _time_baselines(baselines: list, out_cpumoe: torch.Tensor, warm: List[Routing],
                    routings: List[Routing], counts: tuple, report, share: float,
                    label: str):
    """Times each baseline on a prefix of cpumoe's routings (as many calls as its own
    warm-up allows, at most cpumoe's): ``{key: (seconds per call, relative difference of
    cpumoe's first output from the baseline's, others' CPU share)}``, and the peers' own
    fields (:func:`_time_peer`). Each call is closed once timed."""
    found: Dict[str, tuple] = {}
    peer_fields: Dict[str, dict] = {}
    for k, (b, fn, fmt) in enumerate(baselines):
        lo = share * (k + 1)
        try:
            if b.key in PEERS:
                found[b.key], peer_fields[b.key] = _time_peer(
                    b, fn, fmt, out_cpumoe, warm, routings, counts, report, lo, share, label)
                continue
            name = f"{b.column} baseline"
            report(lo, f"{label}: {name} warm-up")
            nb = min(_iterations(_warm_up(fn, warm), *counts), len(routings))
            bt, out_b, load_b = _time_calls(fn, routings[:nb],
                                            _ticker(report, lo, share, nb, f"{label}: {name}"))
            found[b.key] = (bt, _rel_diff(out_cpumoe, out_b), load_b.fraction)
        finally:
            _close(fn)
    return found, peer_fields


def _time_peer(b, fn, fmt: PeerFormat, out_cpumoe: torch.Tensor, warm: List[Routing],
               routings: List[Routing], counts: tuple, report, lo: float, share: float,
               label: str):
    """A peer, in each of its settings (``fn`` a call or ``{label: call}``): first run on
    cpumoe's first routing; a setting whose output differs from cpumoe's by more than the
    format's tolerance (or fails) is not timed. Returns the fastest setting's ``(seconds
    per call, difference, others' share)`` (``(None, difference, None)`` when none was
    timed) and the record's ``{key}_*`` fields: format, bytes per weight, tolerance, the
    setting reported and every setting's median ms, and the error, if any."""
    settings = fn.items() if isinstance(fn, dict) else [("", fn)]
    results, errors, diffs = {}, [], {}
    for setting, call in settings:
        name = f"{b.column}{f' ({setting})' if setting else ''}"
        try:
            diff = _rel_diff(out_cpumoe, call(routings[0]))
        except Exception as e:
            errors.append(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            _close(call)
            continue
        diffs[setting] = diff
        if diff is None or not diff <= fmt.tolerance:
            errors.append(f"{name}: output differs from cpumoe's by {diff:.3g} (relative), "
                          f"more than {fmt.tolerance}: not timed")
            _close(call)
            continue
        report(lo, f"{label}: {name} warm-up")
        nb = min(_iterations(_warm_up(call, warm), *counts), len(routings))
        bt, out_b, load_b = _time_calls(call, routings[:nb],
                                        _ticker(report, lo, share, nb, f"{label}: {name}"))
        _close(call)
        results[setting] = (bt, _rel_diff(out_cpumoe, out_b), load_b.fraction)
    best = min(results, key=lambda s: statistics.median(results[s][0]), default=None)
    fields = {
        f"{b.key}_format": fmt.name, f"{b.key}_detail": fmt.detail or None,
        f"{b.key}_bytes_per_weight": fmt.bytes_per_weight, f"{b.key}_tolerance": fmt.tolerance,
        f"{b.key}_setting": best or None,
        f"{b.key}_settings_ms": {s: statistics.median(r[0]) * 1e3 for s, r in results.items()}
        if isinstance(fn, dict) else None,
    }
    if not results:
        fields[f"{b.key}_error"] = "; ".join(errors)
        first = next(iter(diffs.values()), None)
        return (None, first, None), fields
    return results[best], fields


def _time_thread_counts(call_cpumoe: Callable, counts_to_time: Sequence[int],
                        out_cpumoe: torch.Tensor, warm: List[Routing],
                        routings: List[Routing], counts: tuple, report, start: float,
                        share: float, label: str) -> List[tuple]:
    """Times cpumoe again at each thread count on a prefix of its routings, torch's count
    restored after each: ``[(threads, seconds per call, first output identical to the
    row's, others' CPU share)]``."""
    threads = torch.get_num_threads()
    scaled: List[tuple] = []
    for k, count in enumerate(counts_to_time):
        lo = start + share * k
        report(lo, f"{label}: cpumoe at {count} threads warm-up")
        torch.set_num_threads(count)
        try:
            nt = min(_iterations(_warm_up(call_cpumoe, warm), *counts), len(routings))
            st, out_t, load_t = _time_calls(
                call_cpumoe, routings[:nt],
                _ticker(report, lo, share, nt, f"{label}: cpumoe at {count} threads"))
        finally:
            torch.set_num_threads(threads)
        scaled.append((count, st, torch.equal(out_t, out_cpumoe), load_t.fraction))
    return scaled


def _case_record(shape: Shape, scheme: str, dname: str, M: int, threads: int,
                 times: List[float], routings: List[Routing], weights: ExpertWeights,
                 weight_layers: int, limits: Limits) -> dict:
    """The record's cpumoe fields: the case, the times, the bytes and operations and how
    they compare with the limits."""
    spec = SCHEMES[scheme]
    distinct = statistics.fmean(int(torch.unique(r.topk_ids).numel()) for r in routings)
    weight_bytes = distinct * weights.expert_bytes()
    flops = 2.0 * M * shape.topk * 3 * shape.N * shape.K
    sec = statistics.median(times)
    kind = spec.peak_kind(dname)
    peak = limits.peak(kind)
    bound = limits.bound(weight_bytes, flops, kind)
    return {
        "shape": shape.name, "scheme": scheme, "E": shape.E, "topk": shape.topk,
        "K": shape.K, "N": shape.N, "M": M,
        "dtype": dname,
        "moe_comp_method": int(spec.method),
        "threads": threads,
        "tier": _C.active_isa(),
        "ms": sec * 1e3,
        "ms_min": min(times) * 1e3,
        "iters": len(times),
        "distinct_experts": distinct,
        "weight_layers": weight_layers,
        "weight_bytes": weight_bytes,
        "bytes_per_weight": weights.expert_bytes() / (3 * shape.N * shape.K),
        "gbps": weight_bytes / sec / 1e9,
        "bw_fraction": weight_bytes / sec / 1e9 / limits.read_gbps if limits.read_gbps else None,
        "flops": flops,
        "gflops": flops / sec / 1e9,
        "peak_kind": kind,
        "peak_fraction": flops / sec / 1e9 / peak if peak else None,
        "bound": bound[0] if bound else None,
        "bound_ms": bound[1] * 1e3 if bound else None,
        "bound_fraction": bound[1] / sec if bound else None,
    }


def _baseline_fields(found: Dict[str, tuple], sec: float, peer_fields: Dict[str, dict],
                     skipped: Dict[str, str]) -> dict:
    """``{key}_ms``, ``{key}_iters``, the speedup and ``rel_diff_vs_{key}`` of every
    baseline (None where it did not run), and every peer's own fields (None where it did not
    run; ``{key}_skipped``: why it has no format for this row); ``sec`` is cpumoe's median."""
    fields: dict = {}
    for key in BASELINES:
        bt, diff, _ = found.get(key, (None, None, None))
        med = statistics.median(bt) if bt else None
        fields.update({
            f"{key}_ms": med * 1e3 if med else None,
            f"{key}_iters": len(bt) if bt else None,
            _speedup_key(key): med / sec if med else None,
            f"rel_diff_vs_{key}": diff,
        })
        if key in PEERS:
            fields.update({f"{key}_{f}": None for f in PEER_FIELDS})
            fields.update(peer_fields.get(key, {}))
            fields[f"{key}_skipped"] = skipped.get(key)
    return fields


# A peer's fields in each case record besides those of every baseline (``{key}_<field>``).
PEER_FIELDS = ("format", "detail", "bytes_per_weight", "tolerance", "setting", "settings_ms",
               "error", "skipped")


def _capped_fields(cap: Optional[dict], out_cpumoe: torch.Tensor, ms: float) -> dict:
    """The capped eager loop's fields (``cap``: this case's result from the subprocess)."""
    return {
        "eager_capped_ms": cap["ms"] if cap else None,
        "eager_capped_iters": cap["iters"] if cap else None,
        "speedup_capped": cap["ms"] / ms if cap else None,
        "rel_diff_vs_capped": _rel_diff(out_cpumoe, cap.get("out")) if cap else None,
    }


def _scaling_entry(entry: tuple, rec: dict, sec: float,
                   scaling_limits: Optional[Dict[int, Limits]]) -> dict:
    """A ``thread_scaling`` item of the record ``rec`` (whose median is ``sec`` seconds),
    its bound against that count's limits."""
    count, st, identical, others = entry
    ms_c = statistics.median(st)
    lim = (scaling_limits or {}).get(count)
    b_c = lim.bound(rec["weight_bytes"], rec["flops"], rec["peak_kind"]) if lim else None
    return {
        "threads": count, "ms": ms_c * 1e3, "ms_min": min(st) * 1e3, "iters": len(st),
        "scaling": ms_c / sec,  # how much faster the row's thread count is
        "bound_ms": b_c[1] * 1e3 if b_c else None,
        "bound_fraction": b_c[1] / ms_c if b_c else None,
        "identical_output": identical,
        "others_cpu_fraction": others,
    }


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

