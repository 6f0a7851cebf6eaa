"""``python -m cpumoe bench``: the options (:func:`build_parser`, the ``--quick`` preset),
the entry point (:func:`main`, which also dispatches ``compare``, ``routing``, ``linear`` and
the capped baseline's worker) and the run itself (:func:`run`), step by step."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._progress import Progress
from . import compare, routing
from .baselines import BASELINES, PEERS
from .capped import _WORKER_FLAG, _baseline_worker, run_capped_baseline
from .machine import (
    MAX_WEIGHT_LAYERS,
    _read_bandwidth_samples,
    best_limits,
    cpu_busy_fraction,
    machine_info,
    measure_limits,
    measure_peaks,
)
from .peers import INSTALL, PEER_GROUPS, PEER_ISAS, set_peer_isa
from .report import (
    _matplotlib_figure,
    build_document,
    format_header_row,
    format_row,
    header_lines,
    summary_lines,
    table_columns,
    write_plot,
)
from .schemes import SCHEMES, ExpertWeights, scheme_unavailable
from .shapes import ALL_M, DEFAULT_M, DEFAULT_SHAPE, DTYPES, SHAPES, Shape, parse_shapes
from .timing import run_case, run_interleaved


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


def parse_peers(text: str) -> List[str]:
    """``--peers``: names of :data:`PEERS` or of :data:`PEER_GROUPS` (a library's rows), or
    ``all``; duplicates dropped."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(PEERS)
    bad = [n for n in names if n not in PEERS and n not in PEER_GROUPS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown peer {', '.join(bad)} (known: "
            f"{', '.join(sorted(set(PEERS) | set(PEER_GROUPS)))}, all)")
    out: List[str] = []
    for n in names:
        out.extend(k for k in PEER_GROUPS.get(n, (n,)) if k not in out)
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



# --quick: a representative subset that finishes in under 2 minutes on the 2-vCPU dev VM:
# one shape, every scheme, decode / mid / prefill M, shorter timing, 1-thread scaling.
COMPARE_COMMAND = "compare"  # python -m cpumoe bench compare A.json B.json
ROUTING_COMMAND = "routing"  # python -m cpumoe bench routing [options]
LINEAR_COMMAND = "linear"  # python -m cpumoe bench linear [options]

QUICK = {"shape": "qwen3-30b-a3b", "scheme": "bf16,int8,fp8,int4,mxfp4", "m": "1,64,512",
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
                        "(INT4 W4A8; skipped with the reason if this cpumoe cannot run it), "
                        "mxfp4 (MXFP4, gpt-oss); "
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
    p.add_argument("--peers", metavar="P,P,...", type=parse_peers, default=[],
                   help="also time other libraries' MoE kernels on the same weights (or "
                        "the same float weights in their own formats), routings and threads, "
                        "where they are installed and run on this CPU: comma list of "
                        + ", ".join(PEERS) + " (ggml = ggml,ggml_q4k; kt = kt,kt_gptq), or "
                        "all; a peer whose output disagrees with cpumoe's is reported, not "
                        "timed. Installs: " + "; ".join(f"{k}: {v}" for k, v in INSTALL.items()))
    p.add_argument("--peer-isa", choices=PEER_ISAS, default=None,
                   help="the peers load the builds they would pick on a CPU with no more than "
                        "this: avx2 (no AVX-512, AVX-VNNI or AMX: vLLM's _C_AVX2, "
                        "KTransformers' avx2 build, no SGLang) or avx512 (a Cascade Lake: "
                        "vLLM's _C_AVX512, KTransformers' avx512_vnni); to compare with cpumoe "
                        "capped the same way (CPUMOE_ISA). ggml chooses its instructions when it "
                        "is built: it runs only if the installed ggml-python has none above the "
                        "cap (benchmarks/README.md says how to build one)")
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
                    "compute peak (fp32 FMA, bf16 or u8*s8 by scheme: the roofline), and "
                    "against the PyTorch code a user would run instead.",
        epilog=f"'{prog} {COMPARE_COMMAND} A.json B.json' sets two saved --json runs side by "
               "side instead: each case's ms in both and B/A, their geometric mean, and the "
               f"cases found in only one ('{prog} {COMPARE_COMMAND} --help'). "
               f"'{prog} {LINEAR_COMMAND}' times the dense linear ops instead "
               f"('{prog} {LINEAR_COMMAND} --help').")
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
    """``python -m cpumoe bench``; returns 0 on success. ``compare A.json B.json`` as the
    first arguments sets two saved runs side by side instead (:mod:`cpumoe.bench.compare`),
    ``routing`` times the routing ops (:mod:`cpumoe.bench.routing`), ``linear`` the dense
    linear ops (:mod:`cpumoe.bench.linear`)."""
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:1] == [_WORKER_FLAG]:  # the subprocess of --baseline-isa
        return _baseline_worker(argv[1:])
    if argv[:1] == [COMPARE_COMMAND]:
        return compare.main(argv[1:])
    if argv[:1] == [ROUTING_COMMAND]:
        return routing.main(argv[1:])
    if argv[:1] == [LINEAR_COMMAND]:
        from . import linear  # the dense linear ops (cpumoe.bench.linear)

        return linear.main(argv[1:])
    parser = build_parser()
    args = resolve_arguments(parser.parse_args(argv))
    shapes = _checked_arguments(parser, args)
    set_peer_isa(args.peer_isa)
    torch.set_num_threads(args.threads[0])
    return run(args, shapes)


def _checked_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace
                       ) -> List[Shape]:
    """The shapes of ``--shape``, once every option is known to be usable (else
    ``parser.error``, which exits)."""
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
    return shapes


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


@dataclass
class RunPlan:
    """What a run does, settled from the options before anything is measured, and the
    progress bar's budget: 1 unit per case (+0.3 per scaling count), 0.5 per case for the
    capped baseline, 0.5 per thread count for the limits (+0.2 each for the u8*s8, the bf16
    and the u4*s8 peak, measured only when a row is judged against them), 1 per interleaved (shape,
    pair, M), 0.25 for the bandwidth and the peaks measured again at the end."""

    shapes: List[Shape]
    ms: List[int]
    schemes: List[str]  # those that run
    skipped: Dict[str, str]  # scheme -> why cpumoe cannot run it here
    used_by: Dict[str, List[str]]  # peak kind -> the schemes whose rows are judged against it
    baseline_keys: List[str]  # the in-process baselines (keys of BASELINES) that run
    unavailable: Dict[str, Optional[str]]  # scheme-specific baseline -> why not, or None
    capped_isa: Optional[str]
    threads: int  # the rows' thread count
    scaling: List[int]  # the other thread counts
    pairs: List[Tuple[str, str]]
    bw_bytes: Optional[int]

    @property
    def need_int8(self) -> bool:
        return "u8s8" in self.used_by

    @property
    def need_bf16(self) -> bool:
        return "bf16" in self.used_by

    @property
    def need_int4(self) -> bool:
        return "u4s8" in self.used_by

    @property
    def peaks_needed(self) -> dict:
        """The keyword arguments of :func:`measure_limits` beyond ``need_int8``."""
        return {"need_bf16": self.need_bf16, "need_int4": self.need_int4}

    @property
    def case_count(self) -> int:
        return len(self.shapes) * len(self.schemes) * len(self.ms)

    @property
    def units_limits(self) -> float:
        return ((0.5 + 0.2 * (self.need_int8 + self.need_bf16 + self.need_int4))
                * (1 + len(self.scaling)))

    @property
    def units_capped(self) -> float:
        return 0.5 * self.case_count if self.capped_isa else 0.0

    @property
    def units_per_case(self) -> float:
        return 1 + 0.3 * len(self.scaling)

    @property
    def units_pairs(self) -> float:
        return len(self.shapes) * len(self.pairs) * len(self.ms)

    @property
    def units_total(self) -> float:
        return (self.case_count * self.units_per_case + self.units_limits + self.units_capped
                + self.units_pairs + 0.25)


def plan_run(args: argparse.Namespace, shapes: List[Shape]) -> RunPlan:
    """The :class:`RunPlan` of resolved options: which schemes and baselines can run here."""
    skipped = {s: r for s in args.scheme if (r := scheme_unavailable(s, args.dtype))}
    schemes = [s for s in args.scheme if s not in skipped]
    used_by: Dict[str, List[str]] = {}
    for s in schemes:
        used_by.setdefault(SCHEMES[s].peak_kind(args.dtype), []).append(s)
    baseline_keys = [] if args.no_baseline else ["baseline"]
    unavailable: Dict[str, Optional[str]] = {}
    for s in schemes:
        key = SCHEMES[s].torch_baseline
        if key and not args.no_baseline and key not in unavailable:
            unavailable[key] = BASELINES[key].unavailable(DTYPES[args.dtype])
            if unavailable[key] is None:
                baseline_keys.append(key)
    for key in args.peers:
        unavailable[key] = BASELINES[key].unavailable(DTYPES[args.dtype])
        if unavailable[key] is None:
            baseline_keys.append(key)
    return RunPlan(
        shapes=shapes, ms=list(args.m), schemes=schemes, skipped=skipped, used_by=used_by,
        baseline_keys=baseline_keys, unavailable=unavailable,
        capped_isa=args.baseline_isa.strip() if args.baseline_isa else None,
        threads=args.threads[0], scaling=list(args.threads[1:]),
        pairs=list(args.interleave or []), bw_bytes=args.bw_mib << 20 if args.bw_mib else None)


class Console:
    """Where the human-readable lines go (``out``), printed through the progress bar so
    that they never tear it; the bar starts disabled and is replaced once the run's budget
    is known."""

    def __init__(self, out):
        self.out = out
        self.bar = Progress(1.0, enabled=False)

    def emit(self, line: str = "") -> None:
        self.bar.write(line, self.out)


def measure_limits_by_threads(plan: RunPlan, bar: Progress) -> Dict[int, dict]:
    """:func:`measure_limits` at the rows' thread count, then at each scaling count (torch's
    thread count restored after each)."""
    bar.update(0.0, f"measuring the limits at {plan.threads} threads", force=True)
    by_threads = {plan.threads: measure_limits(plan.need_int8, plan.bw_bytes,
                                               **plan.peaks_needed)}
    for k, count in enumerate(plan.scaling):
        bar.update(plan.units_limits * (k + 1) / (1 + len(plan.scaling)),
                   f"measuring the limits at {count} threads", force=True)
        torch.set_num_threads(count)
        try:
            by_threads[count] = measure_limits(plan.need_int8, plan.bw_bytes,
                                               **plan.peaks_needed)
        finally:
            torch.set_num_threads(plan.threads)
    bar.update(plan.units_limits, "limits measured")
    return by_threads


def run_capped(args: argparse.Namespace, plan: RunPlan, bar: Progress) -> Optional[dict]:
    """``--baseline-isa``: :func:`run_capped_baseline` over every case, else None."""
    if not plan.capped_isa:
        return None
    isa, lo = plan.capped_isa, plan.units_limits
    bar.update(lo, f"eager baseline with ONEDNN_MAX_CPU_ISA={isa} (subprocess): starting",
               force=True)
    capped = run_capped_baseline(
        isa, plan.shapes, plan.schemes, plan.ms, dtype=args.dtype, seed=args.seed,
        iters=args.iters, min_time=args.min_time,
        progress=lambda f, text: bar.update(lo + plan.units_capped * f, f"[{isa}] {text}"))
    bar.update(lo + plan.units_capped)
    return capped


def run_cases(args: argparse.Namespace, plan: RunPlan, limits_by_threads: Dict[int, dict],
              capped: Optional[dict], columns: list, console: Console, start: float
              ) -> List[dict]:
    """:func:`run_case` for every shape, scheme and M (weights made once per shape and
    scheme), printing each row as it comes; ``start`` is where the cases begin in the
    progress bar's budget."""
    bar = console.bar
    limits = limits_by_threads[plan.threads]["limits"]
    scaling_limits = {c: limits_by_threads[c]["limits"] for c in plan.scaling}
    cases: List[dict] = []
    done = 0.0
    for shape in plan.shapes:
        for scheme in plan.schemes:
            bar.update(start + done, f"{shape.name} {scheme}: generating and packing weights",
                       force=True)
            weights = ExpertWeights(shape, args.dtype, args.seed, scheme=scheme)
            for M in plan.ms:
                cap = capped["cases"].get((shape.name, scheme, M)) if capped else None
                rec = run_case(
                    shape, M, dtype=args.dtype, scheme=scheme, weights=weights,
                    iters=args.iters, min_time=args.min_time,
                    baseline=not args.no_baseline, capped=cap, limits=limits,
                    peers=[k for k in plan.baseline_keys if k in PEERS],
                    scaling_threads=plan.scaling, scaling_limits=scaling_limits,
                    seed=args.seed, weight_layers=args.weight_layers,
                    progress=lambda f, text, d=done: bar.update(
                        start + d + plan.units_per_case * f, text))
                cases.append(rec)
                console.emit(format_row(rec, columns))
                done += plan.units_per_case
                bar.update(start + done)
            del weights
            gc.collect()
    return cases


def run(args: argparse.Namespace, shapes: List[Shape]) -> int:
    """The run of resolved options: plan, limits, capped baseline, header, cases,
    interleaved pairs, the bandwidth again, summary; then the JSON document and picture.
    Returns 0, 1 when no scheme can run, 130 when interrupted."""
    t_start = time.perf_counter()
    json_stdout = args.json == "-"
    console = Console(sys.stderr if json_stdout else sys.stdout)  # the human-readable table
    plan = plan_run(args, shapes)
    for s, reason in plan.skipped.items():
        console.emit(f"scheme {s} skipped: {reason}")
    if not plan.schemes:
        console.emit("nothing to run: every scheme asked for was skipped")
        return 1
    bar = console.bar = Progress(plan.units_total,
                                 enabled=args.progress or (not json_stdout
                                                           and sys.stderr.isatty()))
    info = machine_info()
    busy_before = cpu_busy_fraction()
    columns = table_columns(baselines=plan.baseline_keys, capped=bool(plan.capped_isa),
                            scaling=plan.scaling, threads=plan.threads)
    try:
        limits_by_threads = measure_limits_by_threads(plan, bar)
        capped = run_capped(args, plan, bar)
        start = plan.units_limits + plan.units_capped
        for line in header_lines(info, plan, args.dtype, limits_by_threads, capped,
                                 busy_before):
            console.emit(line)
        console.emit()
        console.emit(format_header_row(columns))
        cases = run_cases(args, plan, limits_by_threads, capped, columns, console, start)
        done = plan.case_count * plan.units_per_case
        interleaved = run_pairs(args, shapes, plan.pairs, console.emit,
                                lambda f, text: bar.update(start + done + plan.units_pairs * f,
                                                           text))
        done += plan.units_pairs
        bar.update(start + done, "re-measuring the streaming-read bandwidth and the peaks",
                   force=True)
        read_end = _read_bandwidth_samples(plan.bw_bytes)
        peaks_end = measure_peaks(plan.need_int8, **plan.peaks_needed)
        limits_end = best_limits(read_end, peaks_end)
        busy_after = cpu_busy_fraction()
        bar.update(start + done + 0.25)
        wall = time.perf_counter() - t_start
        console.emit()
        for line in summary_lines(plan, cases, limits_by_threads[plan.threads]["limits"],
                                  limits_end, busy_after, capped, wall):
            console.emit(line)
    except KeyboardInterrupt:
        bar.close()
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        bar.close()
    doc = build_document(
        info, plan, args, limits_by_threads, read_end=read_end, peaks_end=peaks_end,
        limits_end=limits_end, busy_before=busy_before,
        busy_after=busy_after, capped=capped, cases=cases, interleaved=interleaved, wall=wall)
    write_outputs(doc, args, console.out)
    return 0


def write_outputs(doc: dict, args: argparse.Namespace, out) -> None:
    """``--json`` (a file, or stdout for ``-``) and ``--plot``."""
    json_stdout = args.json == "-"
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
