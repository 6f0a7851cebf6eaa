"""Paired timing of settings of one build, in one process: which setting is faster, and by how
much.

    python tools/ab_switch.py --env CM_EXP --values 0,0,1 --scheme bf16 --m 512
    python tools/ab_switch.py --env CM_EXP --values 0,1 --scheme int8 --m 512 \
        --linear qwen3-30b-a3b-q

For a change that a build can switch at run time: an experiment's C code reads the variable
`--env` names (`getenv`, before each call) and picks a variant by its value. The case is built
once (`tools/ab_builds.py`'s: the bench's weight copies and routings, or with `--linear` the
dense linear's), then the values take turns, the order reversing every round, each round timing
`--calls` calls per value with the variable set to it. Printed per value: the median ms and
the median over rounds of (its round's median / the first value's), with the quartiles.

Both settings read the same weights, which `tools/ab_builds.py` cannot give two builds: on the
AMX Xeon VM where a process's memory lands moved a case by 10-18 %
(docs/PERFORMANCE-HISTORY.md, "A/B runs in both spawn orders"). Repeat the first value to see
the noise: `--values 0,0,1` times an A/A pair beside the change. Nothing else should run
meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_builds import (  # noqa: E402
    _linear_case,
    _moe_case,
    add_case_arguments,
    calls_per_round,
    case_label,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="the environment variable the build reads")
    ap.add_argument("--values", required=True,
                    help="comma list of its values; the first is the reference, and may repeat")
    add_case_arguments(ap, 20, "value")
    args = ap.parse_args(argv)
    values = args.values.split(",")
    if len(values) < 2 or args.rounds < 1:
        ap.error("give at least two values and one round")
    calls = calls_per_round(args)
    if args.linear:
        call, _ = _linear_case(args.scheme, args.m, args.linear, args.seed)
    else:
        call, _ = _moe_case(args.scheme, args.m, args.shape, args.seed)
    saved = os.environ.get(args.env)
    ms = [[] for _ in values]  # per value (by position: a repeated value is its own entry)
    i = 0
    try:
        for v in values:  # one untimed call with each setting
            os.environ[args.env] = v
            call(i)
            i += 1
        for k in range(args.rounds):
            order = range(len(values)) if k % 2 == 0 else reversed(range(len(values)))
            for j in order:
                os.environ[args.env] = values[j]
                times = []
                for _ in range(calls):
                    t = time.perf_counter()
                    call(i)
                    times.append(time.perf_counter() - t)
                    i += 1
                ms[j].append(statistics.median(times) * 1e3)
    finally:
        if saved is None:
            os.environ.pop(args.env, None)
        else:
            os.environ[args.env] = saved
    for j, v in enumerate(values):
        ratios = [a / b for a, b in zip(ms[j], ms[0])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{case_label(args)} {args.env}={v}: "
              f"{statistics.median(ms[j]):.3f} ms; over {args.env}={values[0]}: "
              f"median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
