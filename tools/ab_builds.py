"""Paired timing of two builds of cpumoe on one case: which build is faster, and by how much.

    python tools/ab_builds.py OLD_PYTHON_DIR NEW_PYTHON_DIR --scheme int8 --m 512
    python tools/ab_builds.py OLD_PYTHON_DIR NEW_PYTHON_DIR --scheme bf16 --m 512 \
        --linear qwen3-30b-a3b-q

`--linear SHAPE` times the dense linear op of the scheme on one of `python -m cpumoe bench
linear`'s shapes (or `custom:K,N`) instead of the fused MoE.

Each directory is a `python/` tree with its own built extension (`python setup.py build_ext
--inplace` in a checkout or a `git worktree` of each commit, then copy its `python/`). One
long-lived worker process per build holds its own weight copies (as many as the bench
cycles through, so weights come from DRAM) and the same 64 routings; the two take turns,
the order swapping every round, and each round times `--calls` calls per build. On the
shared development VMs a single run of a case drifts by several percent from minute to
minute; rounds a few seconds apart see the same drift, so their ratio does not
(docs/PERFORMANCE-HISTORY.md: "The intermediate with streaming stores").

Where a process's memory lands moves its speed too: on the AMX Xeon VM one build against
itself gave 0.86-0.90, the worker spawned second being the faster, and weight copies allocated
later in one process ran up to 0.82x the time of the first ("A/B runs in both spawn
orders"). So the rounds are split into two sittings with fresh workers, the old build's
spawned first, then the new one's, and the figure is the geometric mean of the two
sittings' median ratios, in which a bias of the order cancels. Printed: each round's median
ms per build and their ratio new / old, then that figure with the smallest and largest round
and each sitting's median. Nothing else should run meanwhile, builds included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CALLS_BY_M = ((1, 100), (64, 30), (0, 10))  # (M up to, calls per round); 0 = any larger M


def _linear_case(scheme: str, m: int, shape_name: str, seed: int):
    """The dense linear's call (copy index -> output) as `python -m cpumoe bench linear`
    builds it: its weights, copies and rows."""
    import torch

    from cpumoe.bench.linear import default_copies, make_weights, parse_shapes
    from cpumoe.bench.shapes import DTYPES

    K, N = next(iter(parse_shapes(shape_name).values()))
    dtype = DTYPES[scheme if scheme in ("bf16", "fp16") else "bf16"]
    first = make_weights(scheme, dtype, K, N, 1, seed)
    w = make_weights(scheme, dtype, K, N, default_copies(first.nbytes), seed)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return lambda i: w.op(x, *w.args[i % len(w.args)]), len(w.args)


def _moe_case(scheme: str, m: int, shape_name: str, seed: int):
    """The fused MoE's call (call index -> output) as the bench builds it: its weight copies
    ('layers') and the case's 64 routings, taken in turn."""
    from cpumoe.bench.schemes import ExpertWeights
    from cpumoe.bench.shapes import DTYPES, make_routings, parse_shapes
    from cpumoe.bench.timing import _case_inputs, _layered_call

    shape = parse_shapes(shape_name)[0]
    dname = scheme if scheme in ("bf16", "fp16") else "bf16"
    weights = ExpertWeights(shape, dname, seed, scheme=scheme)
    g, x, warm = _case_inputs(shape, m, DTYPES[dname], seed)  # the bench's inputs for the case
    routings = make_routings(64, m, shape.E, shape.topk, g)
    call, layers = _layered_call(weights, x, None)
    for r in warm:
        call(r)
    return lambda i: call(routings[i % len(routings)]), layers


def _worker(scheme: str, m: int, shape_name: str, seed: int, linear: str) -> int:
    """Builds the case and answers each line `n` on stdin with the median ms of n calls."""
    if linear:
        call, copies = _linear_case(scheme, m, linear, seed)
        for i in range(3):
            call(i)
    else:
        call, copies = _moe_case(scheme, m, shape_name, seed)
    print(f"ready {copies}", flush=True)
    i = 0
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            t = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - t)
            i += 1
        print(statistics.median(times) * 1e3, flush=True)
    return 0


def _spawn(python_dir: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(python_dir))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--scheme", args.scheme,
           "--m", str(args.m), "--shape", args.shape, "--seed", str(args.seed),
           "--linear", args.linear]
    # run outside any checkout, so that PYTHONPATH alone decides which cpumoe is imported
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         cwd=os.path.abspath(os.sep))
    ready = p.stdout.readline().split()
    if not ready or ready[0] != "ready":
        raise SystemExit(f"the worker for {python_dir} did not start (see its error above)")
    return p


def _round(p: subprocess.Popen, calls: int) -> float:
    p.stdin.write(f"{calls}\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def add_case_arguments(ap: argparse.ArgumentParser, rounds: int, each: str) -> None:
    """The case and round options this tool and tools/ab_switch.py share (`each`: what a
    round times `--calls` calls of)."""
    ap.add_argument("--scheme", default="bf16", help="bf16, fp16, int8, fp8, int4 or mxfp4")
    ap.add_argument("--m", type=int, default=512, help="tokens per call")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="as the bench's --shape (one)")
    ap.add_argument("--linear", default="", metavar="SHAPE",
                    help="time the dense linear op on this bench-linear shape instead")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--calls", type=int, help=f"calls per {each} and round (default by M)")
    ap.add_argument("--seed", type=int, default=0)


def calls_per_round(args: argparse.Namespace) -> int:
    return args.calls or next(n for top, n in CALLS_BY_M if top == 0 or args.m <= top)


def case_label(args: argparse.Namespace) -> str:
    """The case as the summary lines name it."""
    case = f"linear {args.linear}" if args.linear else args.shape
    return f"{case} {args.scheme} M={args.m}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", nargs="?", help="python/ dir of the old build")
    ap.add_argument("new", nargs="?", help="python/ dir of the new build")
    add_case_arguments(ap, 12, "build")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.scheme, args.m, args.shape, args.seed, args.linear)
    if not args.old or not args.new:
        ap.error("give the old and the new build's python/ directories")
    if args.rounds < 1:
        ap.error("give at least one round")
    calls = calls_per_round(args)
    # Two sittings, each with fresh workers: the old build's spawned first, then the new
    # one's. Where a process's memory lands moves its speed (module docstring), and the
    # worker spawned second allocates its weights second.
    first_half = (args.rounds + 1) // 2
    sittings = [(False, first_half), (True, args.rounds - first_half)]
    ratios, old_ms, new_ms, sitting_medians = [], [], [], []
    k = 0
    for new_first, rounds in sittings:
        if rounds == 0:
            continue
        if new_first:
            new = _spawn(args.new, args)
            old = _spawn(args.old, args)
        else:
            old = _spawn(args.old, args)
            new = _spawn(args.new, args)
        sitting = []
        try:
            for _ in range(rounds):
                if k % 2:
                    b = _round(new, calls)
                    a = _round(old, calls)
                else:
                    a = _round(old, calls)
                    b = _round(new, calls)
                old_ms.append(a)
                new_ms.append(b)
                sitting.append(b / a)
                print(f"round {k}: old {a:.3f} ms, new {b:.3f} ms, new/old {b / a:.3f}"
                      f"{' (new spawned first)' if new_first else ''}", flush=True)
                k += 1
        finally:
            for p in (old, new):
                p.stdin.close()
                p.wait()
        ratios += sitting
        sitting_medians.append(statistics.median(sitting))
    # the geometric mean of the sittings' medians: a bias of the spawn order cancels
    ratio = statistics.geometric_mean(sitting_medians)
    by_order = ""
    if len(sitting_medians) == 2:
        by_order = (f"; old spawned first {sitting_medians[0]:.3f}, "
                    f"new spawned first {sitting_medians[1]:.3f}")
    print(f"{case_label(args)}: old {statistics.median(old_ms):.3f} ms, "
          f"new {statistics.median(new_ms):.3f} ms; new/old median {ratio:.3f} "
          f"(rounds {min(ratios):.3f}-{max(ratios):.3f}{by_order})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
