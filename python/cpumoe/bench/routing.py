"""``python -m cpumoe bench routing``: the routing ops before the experts, timed per call and
set against the MoE layer they route.

Cases (:data:`CASES`): Qwen3-30B-A3B's ``topk_softmax_cpu`` (E=128, topk=8, renormalize),
DeepSeek-V3's ``biased_grouped_topk_cpu`` (E=256 in 8 groups keeping 4, topk=8, sigmoid,
correction bias, renormalize, routed scaling factor 2.5), the same with its shared expert
fused (topk=9), and DeepSeek-V2's ``grouped_topk_cpu`` (E=160 in 8 groups keeping 3,
topk=6). Each call gets fresh bf16 logits (the router's output; pre-generated) and is timed
alone (``time.perf_counter`` around the op call, as a model calls it: dispatcher, output
allocation and all); the median and best of the calls are reported, with torch's eager
version of the same routing (SGLang's torch algorithm) for comparison.

The layer a routing serves is estimated from below as the bytes of the experts it touches
over the streaming-read bandwidth measured in this run (``_C.probe_read``, the benchmark's
bandwidth probe): ``distinct experts x 3 N K x bytes per weight``, with the expected number of
distinct experts of M tokens picking topk of E at random. So ``% layer`` is an upper bound
of the routing's share. Qwen3 counts bf16 weights (2 bytes), DeepSeek-V3 FP8 (1 byte, its
checkpoint's format). ``python -m cpumoe bench --m 1`` measures the Qwen3 layer itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from .machine import build_info, machine_info, measure_read_bandwidth


@dataclass(frozen=True)
class RoutingCase:
    name: str
    op: str  # torch.ops.cpumoe.<op>
    E: int
    topk: int  # slots, the fused shared slot included
    K: int  # the layer it routes: hidden size,
    N: int  # expert intermediate size,
    weight_bytes: int  # bytes per weight
    groups: int = 1
    topk_group: int = 1
    shared: int = 0

    def layer_bytes(self, M: int) -> float:
        """Bytes of the routed experts M tokens touch (expected distinct experts)."""
        routed = self.topk - (self.shared > 0)
        distinct = self.E * (1.0 - (1.0 - routed / self.E) ** M)
        return (distinct + self.shared) * 3 * self.N * self.K * self.weight_bytes


CASES = {
    "qwen3": RoutingCase("qwen3-30b-a3b topk_softmax", "topk_softmax_cpu", E=128, topk=8,
                         K=2048, N=768, weight_bytes=2),
    "dsv3": RoutingCase("deepseek-v3 biased_grouped_topk", "biased_grouped_topk_cpu", E=256,
                        topk=8, K=7168, N=2048, weight_bytes=1, groups=8, topk_group=4),
    "dsv3-shared": RoutingCase("deepseek-v3 + fused shared", "biased_grouped_topk_cpu", E=256,
                               topk=9, K=7168, N=2048, weight_bytes=1, groups=8, topk_group=4,
                               shared=1),
    "dsv2": RoutingCase("deepseek-v2 grouped_topk", "grouped_topk_cpu", E=160, topk=6, K=5120,
                        N=1536, weight_bytes=2, groups=8, topk_group=3),
}


def _calls(case: RoutingCase, M: int, n: int, seed: int):
    """(cpumoe call, torch eager call) over n pre-generated bf16 logits."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(M, case.E, generator=g).to(torch.bfloat16) for _ in range(n)]
    bias = torch.randn(case.E, generator=g) * 0.1
    x = torch.empty(M, case.K, dtype=torch.bfloat16)
    op = getattr(torch.ops.cpumoe, case.op).default
    factor = 2.5 if case.op == "biased_grouped_topk_cpu" else None
    if case.op == "topk_softmax_cpu":
        def ours(lg):
            return op(x, lg, case.topk, True)
    elif case.op == "grouped_topk_cpu":
        def ours(lg):
            return op(x, lg, case.topk, True, case.groups, case.topk_group, 0, None, None)
    else:
        def ours(lg):
            return op(x, lg, bias, case.topk, True, case.groups, case.topk_group, case.shared,
                      factor, None)

    def eager(lg):
        return _torch_routing(case, lg, bias, factor)

    return logits, ours, eager


def _torch_routing(case: RoutingCase, logits, bias, factor):
    """SGLang's torch algorithm for the case (what a CPU without its kernels runs)."""
    x = logits.float()
    M = x.shape[0]
    routed = case.topk - (case.shared > 0)
    if case.op == "topk_softmax_cpu":
        w, ids = torch.topk(torch.softmax(x, -1), case.topk, dim=-1)
        return w / w.sum(-1, keepdim=True), ids.int()
    biased = case.op == "biased_grouped_topk_cpu"
    scores = torch.sigmoid(x) if biased else torch.softmax(x, -1)
    choice = scores + bias[None] if biased else scores
    per_group = choice.view(M, case.groups, -1)
    gscore = per_group.topk(2, -1).values.sum(-1) if biased else per_group.amax(-1)
    keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(case.topk_group, -1).indices, 1.0)
    mask = keep[:, :, None].expand_as(per_group).reshape(M, -1).bool()
    ids = choice.masked_fill(~mask, float("-inf")).topk(routed, -1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    if factor is not None:
        w = w * factor
    if case.shared:
        ids = torch.cat([ids, torch.full((M, 1), case.E)], 1)
        w = torch.cat([w, torch.ones(M, 1)], 1)
    return w, ids.int()


def _time(fn: Callable, inputs: List[torch.Tensor], min_time: float) -> List[float]:
    """Seconds of single calls: one warm-up pass over the inputs, then passes over them
    until min_time has gone by (at least one)."""
    for t in inputs:
        fn(t)
    times: List[float] = []
    start = time.perf_counter()
    while not times or time.perf_counter() - start < min_time:
        for t in inputs:
            t0 = time.perf_counter()
            fn(t)
            times.append(time.perf_counter() - t0)
    return times


def run(cases: Sequence[str], ms: Sequence[int], min_time: float, eager: bool,
        seed: int) -> dict:
    bw = measure_read_bandwidth()  # GB/s
    rows = []
    for key in cases:
        case = CASES[key]
        for M in ms:
            logits, ours, torch_fn = _calls(case, M, 64, seed)
            t = _time(ours, logits, min_time)
            row = dict(case=key, name=case.name, op=case.op, E=case.E, topk=case.topk, M=M,
                       us_median=statistics.median(t) * 1e6, us_best=min(t) * 1e6,
                       calls=len(t), layer_bytes=case.layer_bytes(M))
            row["layer_ms_estimate"] = row["layer_bytes"] / (bw * 1e9) * 1e3
            row["percent_of_layer"] = 100 * row["us_median"] / (row["layer_ms_estimate"] * 1e3)
            if eager:
                te = _time(torch_fn, logits, min_time)
                row["eager_us_median"] = statistics.median(te) * 1e6
            rows.append(row)
    return dict(read_bandwidth_gbps=bw, threads=torch.get_num_threads(), rows=rows,
                machine=machine_info(), build=build_info())


def format_table(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"routing ops on {m['cpu_model']}, tier {m['tier']}, {doc['threads']} threads; "
             f"read bandwidth {doc['read_bandwidth_gbps']:.1f} GB/s (best of 5)",
             f"{'case':<34}{'M':>6}{'median us':>11}{'best us':>9}{'eager us':>10}"
             f"{'layer ms*':>11}{'% layer':>9}"]
    for r in doc["rows"]:
        eager = f"{r['eager_us_median']:10.1f}" if "eager_us_median" in r else f"{'-':>10}"
        lines.append(f"{r['name']:<34}{r['M']:>6}{r['us_median']:11.1f}{r['us_best']:9.1f}"
                     f"{eager}{r['layer_ms_estimate']:11.2f}{r['percent_of_layer']:9.3f}")
    lines.append("* the layer's experts' bytes / the read bandwidth: a lower bound of the layer's "
                 "time, so % layer is an upper bound")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpumoe bench routing",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="qwen3,dsv3,dsv3-shared,dsv2",
                   help=f"comma list of {', '.join(CASES)} (default: all)")
    p.add_argument("--m", default="1,16,256", help="comma list of token counts (default 1,16,256)")
    p.add_argument("--min-time", type=float, default=1.0,
                   help="seconds of calls per case and implementation (default 1.0)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-eager", action="store_true", help="skip torch's eager version")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.case.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown case {', '.join(bad)} (known: {', '.join(CASES)})")
    ms = [int(v) for v in args.m.split(",") if v.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    doc = run(cases, ms, args.min_time, not args.no_eager, args.seed)
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
