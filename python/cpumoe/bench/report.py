"""What the benchmark prints and writes: the table's columns and rows, the header and
summary lines, the JSON document (:func:`build_document`) and the roofline picture
(:func:`write_plot`)."""

from __future__ import annotations

import io
import statistics
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import torch

from .baselines import BASELINES, PEERS, _speedup_key
from .machine import Limits, _GiB, build_info, drift_line, peak_loop
from .peers import peer_isa
from .schemes import SCHEMES
from .shapes import DTYPES

if TYPE_CHECKING:  # only for annotations: cli imports this module
    from .cli import RunPlan


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
        _draw_panel(ax, scheme, [c for c in cases if c["scheme"] == scheme], shapes, colour)
    for ax in list(axes.flat)[len(schemes):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=colour[s], marker="o", ms=4, label=s) for s in shapes]
    handles += [Line2D([], [], color="k", ls=ls, label=text) for ls, text in
                (("-", "cpumoe"), ("--", "bound (roofline)"), (":", "eager PyTorch loop"))]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5),
               fontsize=9, frameon=False)
    m = doc["machine"]
    fig.suptitle(f"cpumoe {m['cpumoe_version']} fused_experts, tier {m['tier']}, "
                 f"{m['threads']} threads, {m['cpu_model']}\nlimits measured in the run: "
                 f"{limits_text(m)}", fontsize=10)
    _save_figure(fig, path)
    return fig


def _draw_panel(ax, scheme: str, cases: List[dict], shapes: List[str],
                colour: Dict[str, str]) -> None:
    """One scheme's panel: per shape its cpumoe, bound and eager lines over M."""
    for shape in shapes:
        rows = sorted((c for c in cases if c["shape"] == shape), key=lambda c: c["M"])
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
    ax.set_title(panel_title(scheme, cases), fontsize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("GOP/s (2·M·topk·3·N·K / time)")
    ax.grid(True, which="both", alpha=0.3)


PEAK_LABELS = {"fp32_fma": "fp32 FMA", "bf16": "bf16", "u8s8": "u8*s8",
               "u4s8": "u4*s8"}  # by peak kind


def panel_title(scheme: str, cases: List[dict]) -> str:
    """A scheme's panel title: what its rows' bound is made of (the peaks of their
    ``peak_kind``; a document made before bf16 rows had their own peak says fp32 FMA)."""
    kinds = dict.fromkeys(PEAK_LABELS.get(c["peak_kind"], c["peak_kind"]) for c in cases
                          if c.get("peak_kind"))
    return f"{scheme} (bound: read bandwidth, {' / '.join(kinds) or 'compute'} peak)"


def limits_text(machine: dict) -> str:
    """The limits of a document's ``machine`` block in one line, each compute peak with the
    loop it runs on the document's tier, e.g. "read 24.1 GB/s, fp32 FMA 430 GFLOP/s, bf16
    6595 GOP/s (AMX tdpbf16ps), u8*s8 13020 GOP/s (AMX tdpbusd)"; a limit the run did not
    measure (or a document older than it) is left out."""
    tier = machine.get("tier")
    parts = []
    if machine.get("read_gbps"):
        parts.append(f"read {machine['read_gbps']:.1f} GB/s")
    if machine.get("fma_peak_gflops"):
        parts.append(f"fp32 FMA {machine['fma_peak_gflops']:.0f} GFLOP/s")
    for key, kind in (("bf16_peak_gops", "bf16"), ("int8_peak_gops", "u8s8"),
                      ("int4_peak_gops", "u4s8")):
        if machine.get(key):
            parts.append(f"{PEAK_LABELS[kind]} {machine[key]:.0f} GOP/s"
                         + (f" ({peak_loop(kind, tier)})" if tier else ""))
    return ", ".join(parts)


def _save_figure(fig, path: str) -> None:
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


def _limits_line(label: str, samples: List[float], unit: str, detail: str, fmt: str) -> str:
    return (f"{label}{max(samples):{fmt}} {unit} (best of {len(samples)} {detail}; median "
            f"{statistics.median(samples):{fmt}})")


def _limit_lines(lim: dict, used_by: Dict[str, List[str]], tier: str) -> List[str]:
    """The header lines of one thread count's limits (of :func:`measure_limits`, on
    ``tier``); ``used_by[kind]`` = schemes whose rows are judged against that peak. The bf16
    and u8*s8 lines name the loop their probe runs (:func:`peak_loop`) and appear only when
    that peak was measured."""
    bw, fma = lim["read"], lim["fma"]
    out = [_limits_line("streaming read: ", bw["samples_gbps"], "GB/s",
                        f"runs x {bw['passes']} passes over {_fmt_bytes(bw['buffer_bytes'])}",
                        ".1f"),
           _limits_line("fp32 FMA peak:  ", fma["samples_gflops"], "GFLOP/s",
                        f"runs of ~{fma['seconds_per_run']} s", ".0f")]
    if used_by.get("fp32_fma"):
        out[-1] += f"; bound of {', '.join(used_by['fp32_fma'])} rows"
    for key, label, kind in (("bf16", "bf16 peak:      ", "bf16"),
                             ("int8", "u8*s8 peak:     ", "u8s8"),
                             ("int4", "u4*s8 peak:     ", "u4s8")):
        probe = lim.get(key)
        if probe:
            out.append(_limits_line(label, probe["samples_gops"], "GOP/s",
                                    f"runs of ~{probe['seconds_per_run']} s, "
                                    f"{peak_loop(kind, tier)}", ".0f")
                       + f"; bound of {', '.join(used_by.get(kind, []))} rows")
    return out


def _limits_json(lim: dict) -> dict:
    bw, fma, i8, bf, i4 = lim["read"], lim["fma"], lim["int8"], lim.get("bf16"), lim.get("int4")
    return {"threads": lim["threads"], "read_gbps": max(bw["samples_gbps"]),
            "read_samples_gbps": bw["samples_gbps"],
            "fma_peak_gflops": max(fma["samples_gflops"]),
            "fma_samples_gflops": fma["samples_gflops"],
            "int8_peak_gops": max(i8["samples_gops"]) if i8 else None,
            "int8_samples_gops": i8["samples_gops"] if i8 else None,
            "bf16_peak_gops": max(bf["samples_gops"]) if bf else None,
            "bf16_samples_gops": bf["samples_gops"] if bf else None,
            "int4_peak_gops": max(i4["samples_gops"]) if i4 else None,
            "int4_samples_gops": i4["samples_gops"] if i4 else None}



# ---- the run's header, summary and JSON document ---------------------------------------------


def header_lines(info: dict, plan: "RunPlan", dtype: str, limits_by_threads: Dict[int, dict],
                 capped: Optional[dict], busy_before: Optional[float]) -> List[str]:
    """The lines above the table: versions, CPU, tier, each scheme, the limits at each
    thread count, how busy the machine was, and what every column compares against."""
    threads, scaling = plan.threads, plan.scaling
    lines = [f"cpumoe {info['cpumoe_version']} bench: tier {info['tier']}, {threads} "
             f"thread{'s' if threads > 1 else ''}"
             + (f" (and {', '.join(map(str, scaling))} for the scaling columns)"
                if scaling else "") + f", torch {info['torch_version']}",
             f"CPU: {info['cpu_model']} ({info['logical_cpus']} logical CPUs"
             + (f", LLC {_fmt_bytes(info['last_level_cache_bytes'])}"
                if info["last_level_cache_bytes"] else "") + ")",
             f"tier: {info['isa_reason']}"]
    for s in plan.schemes:
        lines.append(f"{s}: {SCHEMES[s].text}"
                     + ("" if SCHEMES[s].float_weights else f"; {dtype} activations"))
    lines += _limit_lines(limits_by_threads[threads], plan.used_by, info["tier"])
    for count in scaling:
        lines.append(f"at {count} thread{'s' if count > 1 else ''}:")
        lines += ["  " + line for line in _limit_lines(limits_by_threads[count], plan.used_by,
                                                       info["tier"])]
    if busy_before is not None and busy_before > 0.1:
        lines.append(f"WARNING: other processes kept the CPUs {100 * busy_before:.0f}% busy just "
                     "before the run; figures will be noisy")
    lines += _method_lines(plan, dtype, capped)
    return lines


def _method_lines(plan: "RunPlan", dtype: str, capped: Optional[dict]) -> List[str]:
    """The header's explanation of the timing and of each ratio column."""
    lines = ["fresh random routing on every call, and cpumoe's calls cycle through copies "
             "of the weights ('layers', at least max(1 GiB, 8 x LLC) in all unless "
             "--weight-layers), so weights come from DRAM; ms = median;",
             "bound ms = the larger of weight bytes / read bandwidth (bound 'bw') and "
             "operations / peak (bound 'ops'); %bound = bound ms / ms; %bw, %peak likewise;"]
    for key in plan.baseline_keys:
        b = BASELINES[key]
        lines.append(f"vs {b.column} = {b.text} / cpumoe;")
    if peer_isa() and any(key in PEERS for key in plan.unavailable):
        lines.append(f"peers capped (--peer-isa {peer_isa()}): each loads the build it would "
                     f"pick on a CPU with no more than {peer_isa()};")
    for key, reason in plan.unavailable.items():
        if reason:
            kind = "peer" if key in PEERS else "baseline"
            lines.append(f"{BASELINES[key].column} {kind} skipped: {reason}")
    if capped:
        impls = ", ".join(f"{d} GEMM {v}" for d, v in sorted(capped["matmul_impl"].items()))
        no_onednn = [d for d in sorted({s if s in DTYPES else dtype for s in plan.schemes})
                     if d not in capped["matmul_impl"]]
        impls += "".join(f", {d} GEMM not in oneDNN" for d in no_onednn)
        lines.append(f"vs capped = the eager loop in a subprocess with "
                     f"ONEDNN_MAX_CPU_ISA={plan.capped_isa} / cpumoe (oneDNN there: "
                     f"{capped['onednn_isa'] or 'isa unknown'}"
                     f"{'; ' + impls.lstrip(', ') if impls else ''});")
        if capped["error"]:
            lines.append(f"capped baseline FAILED: {capped['error']}")
    for count in plan.scaling:
        lines.append(f"{count}->{plan.threads}t = cpumoe's time at {count} thread"
                     f"{'s' if count > 1 else ''} / its time at {plan.threads} (ideal "
                     f"{plan.threads / count:.2f}x; '!' after '{count}t ms': output not "
                     "bit-identical);")
    lines.append("others = share of the CPUs used by other processes while the case was timed")
    return lines


def summary_lines(plan: "RunPlan", cases: List[dict], limits: Limits, limits_end: Limits,
                  busy_after: Optional[float], capped: Optional[dict], wall: float
                  ) -> List[str]:
    """The lines below the table: the drift of the bandwidth and of the peaks over the run
    (``limits`` at its start, ``limits_end`` after its rows), noisy cases, the largest
    difference from each baseline, bit-identity across thread counts, the capped baseline's
    failures, and the wall time."""
    lines = [drift_line("streaming read", limits.read_gbps, limits_end.read_gbps, "GB/s", 1)]
    for what, field, unit in (("fp32 FMA peak", "fma_gflops", "GFLOP/s"),
                              ("u8*s8 peak", "int8_gops", "GOP/s"),
                              ("bf16 peak", "bf16_gops", "GOP/s"),
                              ("u4*s8 peak", "int4_gops", "GOP/s")):
        start, end = getattr(limits, field), getattr(limits_end, field)
        if start and end:
            lines.append(drift_line(what, start, end, unit))
    noisy = [c for c in cases if (case_others_fraction(c) or 0) > NOISY]
    if noisy:
        lines.append(f"* {len(noisy)} case(s) ran while other processes used more than "
                     f"{100 * NOISY:.0f}% of the CPUs (column 'others'); rerun them on a quiet "
                     "machine")
    others = [v for c in cases if (v := case_others_fraction(c)) is not None]
    if others:
        lines.append(f"others' share of the CPUs while timing: median "
                     f"{100 * statistics.median(others):.0f}%, max {100 * max(others):.0f}% "
                     f"over {len(others)} case(s)")
    for key in [k for k in BASELINES if k not in PEERS] + ["capped"]:
        diffs = [c[f"rel_diff_vs_{key}"] for c in cases if c[f"rel_diff_vs_{key}"] is not None]
        name = (f"{BASELINES[key].column} baseline" if key in BASELINES
                else "capped eager baseline")
        if diffs:
            lines.append(f"cpumoe vs {name}: max relative L2 difference {max(diffs):.1e}"
                         + ("  -- LARGER THAN EXPECTED" if max(diffs) > 5e-2 else ""))
    lines += peer_summary_lines(cases)
    differ = [f"{c['shape']} {c['scheme']} M={c['M']} at {s['threads']} threads"
              for c in cases for s in c["thread_scaling"] if not s["identical_output"]]
    if differ:
        lines.append(f"WARNING: output not bit-identical across thread counts: "
                     f"{'; '.join(differ)}")
    elif plan.scaling:
        lines.append(f"cpumoe's outputs at {', '.join(map(str, plan.scaling))} and "
                     f"{plan.threads} threads: bit-identical in every case")
    if capped:
        for c in capped["cases"].values():
            if c.get("error"):
                lines.append(f"capped baseline failed on {c['shape']} {c['scheme']} "
                             f"M={c['M']}: {c['error']}")
        lines.append(f"capped baseline subprocess: {capped['seconds']:.1f} s")
    if busy_after is not None and busy_after > 0.1:
        lines.append(f"WARNING: other processes kept the CPUs {100 * busy_after:.0f}% busy at "
                     "the end of the run; figures may be noisy")
    lines.append(f"total wall time: {wall:.1f} s")
    return lines


def peer_summary_lines(cases: List[dict]) -> List[str]:
    """Per peer that was asked for: its largest difference from cpumoe by format (against
    that format's tolerance), the rows where it disagreed or failed, and why it did not run
    on the others."""
    lines = []
    for key in PEERS:
        col = BASELINES[key].column
        by_format: Dict[str, List[float]] = {}
        for c in cases:
            if c.get(f"{key}_ms") is not None:
                by_format.setdefault(c[f"{key}_format"], []).append(c[f"rel_diff_vs_{key}"])
        for fmt, diffs in by_format.items():
            tol = next(c[f"{key}_tolerance"] for c in cases if c.get(f"{key}_format") == fmt)
            lines.append(f"cpumoe vs {col} ({fmt}): max relative L2 difference "
                         f"{max(diffs):.1e} (tolerance {tol})")
        for c in cases:
            if c.get(f"{key}_error"):
                lines.append(f"{col} on {c['shape']} {c['scheme']} M={c['M']}: "
                             f"{c[f'{key}_error']}")
        reasons: Dict[str, List[str]] = {}
        for c in cases:
            if c.get(f"{key}_skipped"):
                rows = reasons.setdefault(c[f"{key}_skipped"], [])
                if c["scheme"] not in rows:
                    rows.append(c["scheme"])
        for why, schemes in reasons.items():
            lines.append(f"{col} not run on {', '.join(schemes)} rows: {why}")
    return lines


def build_document(info: dict, plan: "RunPlan", args, limits_by_threads: Dict[int, dict], *,
                   read_end: dict, peaks_end: dict, limits_end: Limits,
                   busy_before: Optional[float],
                   busy_after: Optional[float],
                   capped: Optional[dict], cases: List[dict], interleaved: List[dict],
                   wall: float) -> dict:
    """The ``--json`` document (benchmarks/README.md lists its fields): ``machine`` (what
    ``python -m cpumoe info`` shows, with the limits measured), ``build`` (what the package
    was built from: :func:`cpumoe.bench.machine.build_info`), ``settings``, ``cases``,
    ``interleaved``, ``wall_seconds``, ``timestamp``."""
    main = limits_by_threads[plan.threads]
    limits, bw0, fma, i8 = main["limits"], main["read"], main["fma"], main["int8"]
    bf, i4 = main.get("bf16"), main.get("int4")
    end = limits_end  # the best runs of read_end's and peaks_end's samples
    machine = dict(info)
    machine.update({
        "read_gbps": limits.read_gbps,
        "read_gbps_end": end.read_gbps,
        "read_statistic": "best of runs",
        "read_samples_gbps": bw0["samples_gbps"],
        "read_samples_gbps_end": read_end["samples_gbps"],
        "read_buffer_bytes": bw0["buffer_bytes"],
        "read_passes_per_run": bw0["passes"],
        "cpu_busy_before": busy_before,
        "cpu_busy_after": busy_after,
        "fma_peak_gflops": limits.fma_gflops,
        "fma_statistic": "best of runs",
        "fma_samples_gflops": fma["samples_gflops"],
        "int8_peak_gops": limits.int8_gops,
        "int8_statistic": "best of runs" if i8 else None,
        "int8_samples_gops": i8["samples_gops"] if i8 else None,
        "bf16_peak_gops": limits.bf16_gops,
        "bf16_statistic": "best of runs" if bf else None,
        "bf16_samples_gops": bf["samples_gops"] if bf else None,
        "int4_peak_gops": limits.int4_gops,
        "int4_statistic": "best of runs" if i4 else None,
        "int4_samples_gops": i4["samples_gops"] if i4 else None,
        "fma_peak_gflops_end": end.fma_gflops,
        "fma_samples_gflops_end": peaks_end["fma"]["samples_gflops"],
        "int8_peak_gops_end": end.int8_gops,
        "int8_samples_gops_end": peaks_end["int8"]["samples_gops"] if peaks_end["int8"] else None,
        "bf16_peak_gops_end": end.bf16_gops,
        "bf16_samples_gops_end": peaks_end["bf16"]["samples_gops"] if peaks_end["bf16"] else None,
        "int4_peak_gops_end": end.int4_gops,
        "int4_samples_gops_end": (peaks_end["int4"]["samples_gops"] if peaks_end.get("int4")
                                  else None),
        "limits_by_threads": [_limits_json(limits_by_threads[c]) for c in args.threads],
        "capped_baseline": None if capped is None else {
            "isa": capped["isa"], "onednn_isa": capped["onednn_isa"],
            "matmul_impl": capped["matmul_impl"], "error": capped["error"],
            "seconds": capped["seconds"],
            "case_errors": [f"{c['shape']} {c['scheme']} M={c['M']}: {c['error']}"
                            for c in capped["cases"].values() if c.get("error")],
        },
    })
    return {
        "machine": machine,
        "build": build_info(),
        "settings": {
            "shapes": [s.name for s in plan.shapes], "m": args.m, "schemes": plan.schemes,
            "skipped_schemes": plan.skipped, "dtype": args.dtype, "threads": args.threads,
            "quick": bool(args.quick), "iters": args.iters, "min_time": args.min_time,
            "baseline": not args.no_baseline, "baselines": plan.baseline_keys,
            "baseline_isa": plan.capped_isa,
            "int8pack_unavailable": plan.unavailable.get("int8pack"),
            "int4pack_unavailable": plan.unavailable.get("int4pack"),
            "peers": list(args.peers), "peer_isa": peer_isa(),
            "peers_unavailable": {k: r for k, r in plan.unavailable.items()
                                  if k in PEERS and r},
            "seed": args.seed, "timing": "median of per-call wall time, fresh routing per call",
            "weight_layers": args.weight_layers,
            "interleave": [f"{a}/{b}" for a, b in plan.pairs],
        },
        "cases": cases,
        "interleaved": interleaved,
        "wall_seconds": wall,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
