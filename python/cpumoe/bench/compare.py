"""``python -m cpumoe bench compare A.json B.json``: two saved runs (``--json`` documents)
side by side. A row per timing present in both: (shape, scheme, activation dtype, M,
threads, implementation) with A's ms, B's ms and B/A, then the geometric mean of the ratios
(over all rows and per implementation) and the timings found in only one of the files. Above
them, what each file is and the limits its run measured (a document without the bf16 peak,
made before it existed, shows the others).

The implementations of a case record are cpumoe (``ms``, and each ``thread_scaling`` entry
at its own thread count), each in-process baseline that ran (``{key}_ms`` of
:data:`~cpumoe.bench.baselines.BASELINES`, named by its column: ``eager``, ``int8pack``,
``int4pack``), the capped eager loop (``eager_capped_ms``, named with its oneDNN ISA) and,
from ``--interleave`` records, cpumoe in each pair (``cpumoe in A/B``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .baselines import BASELINES
from .machine import UNKNOWN
from .report import limits_text

# (shape, scheme, dtype, M, threads, implementation)
CaseKey = Tuple[str, str, str, int, int, str]
FLOAT_SCHEMES = ("bf16", "fp16")  # their activation dtype is the scheme itself


class UnreadableDocument(ValueError):
    """A file that is not a benchmark document compare can read; the message says why."""


def load_document(path: str) -> dict:
    """The ``--json`` document at ``path``, checked to hold a list of cases with the fields
    compare reads; :class:`UnreadableDocument` otherwise."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise UnreadableDocument(f"{path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise UnreadableDocument(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        raise UnreadableDocument(f"{path}: not a 'python -m cpumoe bench --json' document "
                                 "(no list of cases)")
    for i, case in enumerate(doc["cases"]):
        missing = [k for k in ("shape", "scheme", "dtype", "M", "threads", "ms")
                   if not isinstance(case, dict) or k not in case]
        if missing:
            raise UnreadableDocument(f"{path}: case {i} lacks {', '.join(missing)}")
    try:  # the rest of the structure: thread_scaling entries, interleaved records
        timings_by_key(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UnreadableDocument(f"{path}: malformed document ({type(e).__name__}: {e})"
                                 ) from None
    return doc


def timings(doc: dict) -> Iterator[Tuple[CaseKey, float]]:
    """Every (key, ms) the document holds; a baseline that did not run (ms null) gives
    none."""
    capped = (doc.get("machine") or {}).get("capped_baseline") or {}
    capped_name = f"eager {capped['isa']}" if capped.get("isa") else "eager capped"
    for c in doc["cases"]:
        head = (c["shape"], c["scheme"], c["dtype"], int(c["M"]))
        threads = int(c["threads"])
        yield head + (threads, "cpumoe"), c["ms"]
        for key, b in BASELINES.items():
            if c.get(f"{key}_ms") is not None:
                yield head + (threads, b.column), c[f"{key}_ms"]
        if c.get("eager_capped_ms") is not None:
            yield head + (threads, capped_name), c["eager_capped_ms"]
        for s in c.get("thread_scaling") or []:
            yield head + (int(s["threads"]), "cpumoe"), s["ms"]
    settings = doc.get("settings") or {}
    threads = (settings.get("threads") or [0])[0]
    for r in doc.get("interleaved") or []:
        for scheme in r["schemes"]:
            dtype = scheme if scheme in FLOAT_SCHEMES else settings.get("dtype", UNKNOWN)
            yield ((r["shape"], scheme, dtype, int(r["M"]), threads, f"cpumoe in {r['pair']}"),
                   r["ms"][scheme])


def timings_by_key(doc: dict) -> Dict[CaseKey, float]:
    """:func:`timings` as a dict; a key seen twice (a shape given twice) keeps its first
    time, and a time that is not a positive number is no timing."""
    found: Dict[CaseKey, float] = {}
    for key, ms in timings(doc):
        if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0:
            found.setdefault(key, float(ms))
    return found


def geometric_mean(values: Sequence[float]) -> Optional[float]:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def compare_documents(a: dict, b: dict) -> dict:
    """``{"rows": [{"key", "a_ms", "b_ms", "ratio"}], "geomean", "geomean_by_impl":
    {implementation: (geomean, count)}, "only_a": [key], "only_b": [key]}``, rows and keys
    in A's order (B's for ``only_b``); ratio = B ms / A ms."""
    in_a, in_b = timings_by_key(a), timings_by_key(b)
    rows = [{"key": k, "a_ms": ms, "b_ms": in_b[k], "ratio": in_b[k] / ms}
            for k, ms in in_a.items() if k in in_b]
    by_impl: Dict[str, List[float]] = {}
    for r in rows:
        by_impl.setdefault(r["key"][5], []).append(r["ratio"])
    return {
        "rows": rows,
        "geomean": geometric_mean([r["ratio"] for r in rows]),
        "geomean_by_impl": {impl: (geometric_mean(v), len(v)) for impl, v in by_impl.items()},
        "only_a": [k for k in in_a if k not in in_b],
        "only_b": [k for k in in_b if k not in in_a],
    }


def describe(label: str, path: str, doc: dict) -> str:
    """One line saying what a document is: build, tier, threads, CPU, when."""
    build = doc.get("build") or {}
    machine = doc.get("machine") or {}
    commit = build.get("git_commit", UNKNOWN)
    dirty = build.get("dirty", UNKNOWN)
    state = {True: ", dirty tree", False: ""}.get(dirty, ", tree state unknown")
    threads = machine.get("threads", "?")
    return (f"{label}: {path}: commit {commit[:12] if commit != UNKNOWN else commit}{state}, "
            f"tier {machine.get('tier', '?')}, {threads} thread{'' if threads == 1 else 's'}, "
            f"{machine.get('cpu_model', 'CPU unknown')}, {doc.get('timestamp', 'time unknown')}")


def describe_limits(doc: dict) -> Optional[str]:
    """The limits the document's run measured (:func:`~cpumoe.bench.report.limits_text`:
    read bandwidth and each compute peak that run had; a document older than the bf16 peak
    has none), indented under its :func:`describe` line; None when it records none."""
    text = limits_text(doc.get("machine") or {})
    return f"   limits: {text}" if text else None


def _key_text(k: CaseKey) -> str:
    shape, scheme, dtype, M, threads, impl = k
    return f"{shape} {scheme} ({dtype}) M={M} {threads}t {impl}"


def format_comparison(result: dict) -> List[str]:
    """The table and summary lines of :func:`compare_documents`' result."""
    rows = result["rows"]
    impl_width = max([len("implementation")] + [len(r["key"][5]) for r in rows])
    lines = [f"{'shape':<17} {'scheme':>6} {'dtype':>5} {'M':>5} {'thr':>3} "
             f"{'implementation':<{impl_width}} {'A ms':>9} {'B ms':>9} {'B/A':>6}"]
    for r in rows:
        shape, scheme, dtype, M, threads, impl = r["key"]
        lines.append(f"{shape:<17} {scheme:>6} {dtype:>5} {M:>5} {threads:>3} "
                     f"{impl:<{impl_width}} {r['a_ms']:>9.3f} {r['b_ms']:>9.3f} "
                     f"{r['ratio']:>5.2f}x")
    if rows:
        lines.append("")
        lines.append(f"geometric mean of B/A: {result['geomean']:.3f}x over {len(rows)} "
                     "timing(s)")
        if len(result["geomean_by_impl"]) > 1:
            for impl, (g, n) in result["geomean_by_impl"].items():
                lines.append(f"  {impl}: {g:.3f}x over {n}")
    for side in ("a", "b"):
        only = result[f"only_{side}"]
        lines.append(f"only in {side.upper()}: {len(only)}"
                     + (" timing(s):" if only else ""))
        lines += [f"  {_key_text(k)}" for k in only]
    return lines


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m cpumoe bench compare",
        description="Compare two 'python -m cpumoe bench --json' documents: for each timing "
                    "in both (shape, scheme, dtype, M, threads, implementation), A's ms, B's "
                    "ms and B/A (below 1: B is faster), their geometric mean, and the timings "
                    "found in only one file. Exits 1 when a file cannot be read or the two "
                    "have no timing in common.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    p.add_argument("a", metavar="A.json", help="the reference run")
    p.add_argument("b", metavar="B.json", help="the run compared with it")
    args = p.parse_args(argv)
    try:
        a, b = load_document(args.a), load_document(args.b)
    except UnreadableDocument as e:
        print(f"cpumoe bench compare: {e}", file=sys.stderr)
        return 1
    result = compare_documents(a, b)
    lines = []
    for label, path, doc in (("A", args.a, a), ("B", args.b, b)):
        lines.append(describe(label, path, doc))
        limits = describe_limits(doc)
        if limits:
            lines.append(limits)
    lines += ["B/A = B's ms / A's ms (median per call); below 1: B is faster", ""]
    try:
        for line in lines + format_comparison(result):
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader (e.g. head) stopped early: not a failure here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet exit flush
    if not result["rows"]:
        print("cpumoe bench compare: the two files have no timing in common", file=sys.stderr)
        return 1
    return 0
