#!/usr/bin/env python
"""Markdown summary tables of a `python -m cpumoe bench --json` run, as quoted in
docs/PERFORMANCE.md: one pivot table per figure (rows = shape x scheme, columns = M).

    python benchmarks/perf_tables.py benchmarks/results/full-matrix.json > tables.md

Tables: % of the bound (with the bound's kind), the ratio against the eager loop, the ratio
against torch's weight-only int8/int4 loop, the 1 -> N thread scaling (when the run had
it), the share of the CPUs other processes used while each case ran, and the interleaved
pairs' ratios (when the run had `--interleave`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, List, Optional


def _pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{100 * v:.0f}"


def _ratio(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.2f}"


def pivot(doc: dict, cell: Callable[[dict], Optional[str]], rows_with: Callable[[dict], bool]
          = lambda c: True) -> List[str]:
    """A markdown table: a row per (shape, scheme) having cases that pass ``rows_with``, a
    column per M, ``cell(case)`` in each cell."""
    cases = doc["cases"]
    ms = sorted({c["M"] for c in cases})
    keys = list(dict.fromkeys((c["shape"], c["scheme"]) for c in cases if rows_with(c)))
    by_key = {(c["shape"], c["scheme"], c["M"]): c for c in cases}
    out = ["| shape | scheme | " + " | ".join(f"M={m}" for m in ms) + " |",
           "|---|---|" + "---:|" * len(ms)]
    for shape, scheme in keys:
        cells = []
        for m in ms:
            c = by_key.get((shape, scheme, m))
            cells.append((cell(c) or "–") if c else "")
        out.append(f"| {shape} | {scheme} | " + " | ".join(cells) + " |")
    return out


def bound_cell(c: dict) -> str:
    kind = {"bandwidth": "b", "compute": "c"}.get(c["bound"], "")
    return f"{_pct(c['bound_fraction'])}{kind}"


def tables(doc: dict) -> str:
    s = doc["settings"]
    parts = ["**% of the bound** (`%bound` = bound time / measured time; `b`: bytes / read "
             "bandwidth, `c`: operations / peak)", ""]
    parts += pivot(doc, bound_cell)
    if "baseline" in s.get("baselines", []):
        parts += ["", "**vs eager** (eager per-expert PyTorch loop in the activation dtype, "
                  "over the dequantized weights for quantized schemes, / cpumoe; > 1: cpumoe "
                  "is faster)", ""]
        parts += pivot(doc, lambda c: _ratio(c["speedup"]))
    for key, what in (("int8pack", "torch._weight_int8pack_mm"),
                      ("int4pack", "torch._weight_int4pack_mm_for_cpu")):
        if key in s.get("baselines", []):
            parts += ["", f"**vs {key}** (per-expert loop over `{what}` / cpumoe)", ""]
            parts += pivot(doc, lambda c, k=key: _ratio(c.get(f"speedup_{k}")),
                           lambda c, k=key: c.get(f"{k}_ms") is not None)
    threads = s.get("threads", [])
    for count in threads[1:]:
        parts += ["", f"**{count} -> {threads[0]} threads** (cpumoe's time at {count} / its "
                  f"time at {threads[0]}; `!`: output not bit-identical)", ""]

        def scaling(c: dict, n: int = count) -> Optional[str]:
            e = next((x for x in c["thread_scaling"] if x["threads"] == n), None)
            return None if e is None else _ratio(e["scaling"]) + (
                "" if e["identical_output"] else "!")

        parts += pivot(doc, scaling)
    parts += ["", "**others' CPU share** (% of the machine other processes used while the case "
              "was timed, largest over cpumoe and the baselines)", ""]

    def others(c: dict) -> Optional[str]:
        vals = [c.get(k) for k in c if k.endswith("others_cpu_fraction")]
        vals += [x.get("others_cpu_fraction") for x in c.get("thread_scaling", [])]
        vals = [v for v in vals if v is not None]
        return _pct(max(vals)) if vals else None

    parts += pivot(doc, others)
    pairs = doc.get("interleaved") or []
    if pairs:
        ms = sorted({r["M"] for r in pairs})
        parts += ["", "**interleaved pairs** (A ms / B ms, the two timed in one loop that "
                  "alternates them; > 1: B is faster)", "",
                  "| shape | pair | " + " | ".join(f"M={m}" for m in ms) + " |",
                  "|---|---|" + "---:|" * len(ms)]
        for shape, pair in dict.fromkeys((r["shape"], r["pair"]) for r in pairs):
            got = {r["M"]: r["ratio"] for r in pairs if (r["shape"], r["pair"]) == (shape, pair)}
            parts.append(f"| {shape} | {pair} | "
                         + " | ".join(_ratio(got.get(m)) for m in ms) + " |")
    return "\n".join(parts) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a document written by python -m cpumoe bench --json")
    args = p.parse_args(argv)
    with open(args.json) as f:
        sys.stdout.write(tables(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
