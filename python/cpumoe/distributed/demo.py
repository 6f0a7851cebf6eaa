"""``python -m cpumoe.distributed.demo``: one MoE layer sharded over processes, checked against
one process and timed.

Started by hand, it starts ``--world-size`` processes of itself on this machine (gloo over
127.0.0.1, a free port, ``--threads`` threads each); started by torchrun (RANK and
WORLD_SIZE set), it is one of them. Every rank builds its own experts of a
Qwen3-30B-A3B-shaped layer (E=128, top-8, K=2048, N=768 unless told otherwise) from a seed,
so no weights travel; rank 0 builds all of them, for the check and the one-process
baseline. For each M (default 1 and 512) it then

* checks: every rank's :func:`cpumoe.distributed.fused_experts` output has the same bits,
  and each element is within one rounding of one process holding every expert (the bound
  of :mod:`cpumoe.distributed`);
* times, median over ``--repeats`` calls, each on a fresh routing (no routing is timed
  twice, so no set finds its experts cached by another), every rank starting
  together (a barrier before each call): the whole sharded call (the slowest rank's time),
  the local op alone (slowest rank), the all-reduce of the float32 ``[M, K]`` partial sums
  alone, and one process holding every expert with ``world size x threads`` threads while
  the other ranks wait (``--no-baseline`` skips it; it is rank 0, so under a numactl binding
  its threads stay on rank 0's node).

The table it prints has the rows docs/PERFORMANCE.md records.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from datetime import timedelta
from functools import partial as partial_call
from typing import List, Optional, Sequence

import torch

SCHEMES = ("bf16", "fp16", "int8", "fp8", "int4", "mxfp4")
FP8_BLOCK = (128, 128)
INT4_GROUPS = (128, 64, 32)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cpumoe.distributed.demo",
        description="A MoE layer with its experts sharded over processes (gloo), checked "
                    "against one process and timed.")
    p.add_argument("--world-size", type=int, default=2,
                   help="processes to start on this machine (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--scheme", choices=SCHEMES, default="bf16",
                   help="weight scheme (activations bf16, fp16 for the fp16 scheme)")
    p.add_argument("--E", type=int, default=128, help="experts")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--K", type=int, default=2048, help="hidden size")
    p.add_argument("--N", type=int, default=768, help="expert intermediate size")
    p.add_argument("--tokens", default="1,512", help="token counts M, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per M")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip timing one process holding every expert")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before a stuck run is stopped")
    args = p.parse_args(argv)
    args.tokens = [int(v) for v in args.tokens.split(",") if v.strip()]
    if args.world_size < 1 or args.threads < 1 or args.repeats < 1:
        p.error("--world-size, --threads and --repeats must be at least 1")
    return args


# ---------------------------------------------------------------------------------------
# The layer: experts [first, first + count) of it, made from the seed alone.


def expert_weights(args, e: int, dtype: torch.dtype):
    """Expert e's float weights w1 [2N, K], w2 [K, N] (the same on every rank)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + e)
    w1 = torch.randn(2 * args.N, args.K, generator=g) / args.K ** 0.5
    w2 = torch.randn(args.K, args.N, generator=g) / args.N ** 0.5
    return w1.to(dtype), w2.to(dtype)


def int4_group(args) -> int:
    for group in INT4_GROUPS:
        if args.K % group == 0 and args.N % group == 0:
            return group
    raise SystemExit(f"no int4 group size in {INT4_GROUPS} divides K={args.K} and N={args.N}")


def build_experts(args, first: int, count: int, dtype: torch.dtype):
    """(w1, w2, op keyword arguments) of experts [first, first + count), packed."""
    import cpumoe
    from cpumoe import quant

    float_dtype = dtype if args.scheme in ("bf16", "fp16") else torch.float32
    pairs = [expert_weights(args, e, float_dtype) for e in range(first, first + count)]
    w1 = torch.stack([p[0] for p in pairs])
    w2 = torch.stack([p[1] for p in pairs])
    del pairs
    if args.scheme in ("bf16", "fp16"):
        return cpumoe.convert_weight_packed(w1), cpumoe.convert_weight_packed(w2), {}
    if args.scheme == "int8":
        (q1, s1), (q2, s2) = quant.quantize_int8_per_channel(w1), quant.quantize_int8_per_channel(w2)
        return (cpumoe.convert_weight_packed(q1), cpumoe.convert_weight_packed(q2),
                dict(moe_comp_method=1, w1_scale=s1, w2_scale=s2))
    if args.scheme == "fp8":
        (q1, s1), (q2, s2) = (quant.quantize_fp8_blockwise(w, FP8_BLOCK) for w in (w1, w2))
        return (cpumoe.convert_weight_packed(q1), cpumoe.convert_weight_packed(q2),
                dict(moe_comp_method=2, w1_scale=s1, w2_scale=s2, block_size=list(FP8_BLOCK)))
    if args.scheme == "mxfp4":
        (c1, s1), (c2, s2) = quant.quantize_mxfp4(w1), quant.quantize_mxfp4(w2)
        return (cpumoe.convert_weight_packed(c1), cpumoe.convert_weight_packed(c2),
                dict(moe_comp_method=4, w1_scale=cpumoe.convert_scale_packed(s1),
                     w2_scale=cpumoe.convert_scale_packed(s2)))
    group = int4_group(args)
    p1 = cpumoe.convert_weight_packed_scale_zp(*quant.quantize_int4(w1, group, "awq", dtype), 0)
    p2 = cpumoe.convert_weight_packed_scale_zp(*quant.quantize_int4(w2, group, "awq", dtype), 0)
    return p1[0], p2[0], dict(moe_comp_method=3, w1_scale=p1[2], w2_scale=p2[2],
                              w1_zero=p1[1], w2_zero=p2[1])


# Routings per M: one set of --repeats each for the sharded call, the local op and the
# one-process baseline.
TIMED_SETS = 3


def make_inputs(args, M: int, count: int, dtype: torch.dtype):
    """hidden_states [M, K] and ``count`` routings (topk distinct random experts per token,
    softmax weights), the same on every rank."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7 * M + 1)
    x = torch.randn(M, args.K, generator=g).to(dtype)
    routings = []
    for _ in range(count):
        ids = torch.rand(M, args.E, generator=g).topk(args.topk, dim=1).indices.to(torch.int32)
        weights = torch.randn(M, args.topk, generator=g).softmax(dim=1)
        routings.append((weights, ids))
    return x, routings


# ---------------------------------------------------------------------------------------
# One rank.


def timed(fn, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def warm(fn, barrier) -> None:
    """One untimed call: thread pools started, pages touched, code paged in."""
    barrier()
    fn()


def slowest(seconds: float, dist) -> float:
    """The largest of every rank's `seconds`."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Rank:
    """One rank's layer: its experts (w1, w2, kw), and on rank 0 every expert (full)."""

    def __init__(self, args, dist):
        import cpumoe.distributed as ep

        self.args, self.dist = args, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = torch.float16 if args.scheme == "fp16" else torch.bfloat16
        self.first, self.count = ep.expert_range(args.E, self.rank, self.world)
        self.full = None
        if self.rank == 0:  # every expert: the check and the baseline; its own are a view
            self.full = build_experts(args, 0, args.E, self.dtype)
            w1, w2, kw = self.full
            self.w1, self.w2 = (ep.shard_experts(w, 0, self.world) for w in (w1, w2))
            self.kw = {k: ep.shard_experts(v, 0, self.world) if isinstance(v, torch.Tensor)
                       else v for k, v in kw.items()}
        else:
            self.w1, self.w2, self.kw = build_experts(args, self.first, self.count, self.dtype)

    def say(self, *text) -> None:
        if self.rank == 0:
            print(*text, flush=True)

    def sharded(self, x, routing):
        import cpumoe.distributed as ep

        return ep.fused_experts(x, self.w1, self.w2, *routing, first_expert=self.first,
                                num_experts=self.args.E, **self.kw)

    def local_op(self, x, weights, local_ids):
        import cpumoe

        return cpumoe.fused_experts_fp32(x, self.w1, self.w2, weights, local_ids, **self.kw)

    def single(self, x, routing):
        import cpumoe

        w1, w2, kw = self.full
        return cpumoe.fused_experts(x, w1, w2, *routing, **kw)


def check(rank: Rank, M: int, x, routing) -> bool:
    """Every rank the same bits, each element within one rounding of one process."""
    import cpumoe
    import cpumoe.distributed as ep

    out = rank.sharded(x, routing)
    digests = [None] * rank.world
    rank.dist.all_gather_object(digests, digest(out))
    ok = True
    if rank.rank == 0:
        w1, w2, kw = rank.full
        tw, ti = routing
        single_fp32 = cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, **kw)
        single = rank.single(x, routing)
        bound = ep.reassociation_bound(ep.slot_terms(x, w1, w2, tw, ti, **kw), ti)
        inside = ep.within_one_rounding(out, single_fp32, bound)
        same_ranks = len(set(digests)) == 1
        ok = bool(inside.all()) and same_ranks and torch.equal(single_fp32.to(rank.dtype), single)
        rank.say(f"check M={M}: {int(inside.sum())} of {inside.numel()} elements within one "
                 f"rounding of one process, {int((out == single).sum())} bit-identical; every "
                 f"rank the same bits: {'yes' if same_ranks else 'NO'}; "
                 f"{'ok' if ok else 'FAILED'}")
    rank.dist.barrier()
    return ok


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def median_ms(samples) -> float:
    return 1e3 * statistics.median(samples)


def timings(rank: Rank, M: int, x, routings) -> tuple:
    """(M, one process ms or None, sharded call ms, local op ms, all-reduce ms): medians,
    each call on the next routing, every rank starting together, the slowest rank's time."""
    import cpumoe.distributed as ep

    dist, args = rank.dist, rank.args
    # Each timed set gets routings of its own: a set that reused another's would find the
    # experts it touches in the last-level cache (480 MiB on the development VM, against
    # a 1.2 GB bf16 layer) and look faster than the set before it.
    sets = [routings[i * args.repeats:(i + 1) * args.repeats] for i in range(TIMED_SETS)]
    local_ids = [ep._local_ids(ti, rank.first, rank.count, args.E) for _, ti in sets[1]]
    partial = torch.zeros(M, args.K)
    calls = {
        "sharded": [partial_call(rank.sharded, x, r) for r in sets[0]],
        "local": [partial_call(rank.local_op, x, r[0], ids) for r, ids in zip(sets[1], local_ids)],
        "all-reduce": [partial_call(dist.all_reduce, partial)] * args.repeats,
    }
    medians = []
    for fns in calls.values():
        warm(fns[0], dist.barrier)
        medians.append(median_ms([slowest(timed(fn, dist.barrier), dist) for fn in fns]))
    single_ms = None
    if not args.no_baseline:  # rank 0 alone, with every rank's threads; the others wait
        dist.barrier()
        if rank.rank == 0:
            torch.set_num_threads(rank.world * args.threads)
            fns = [partial_call(rank.single, x, r) for r in sets[2]]
            warm(fns[0], lambda: None)
            single_ms = median_ms([timed(fn, lambda: None) for fn in fns])
            torch.set_num_threads(args.threads)
        dist.barrier()
    return (M, single_ms, *medians)


def run_rank(args) -> int:
    import torch.distributed as dist

    import cpumoe

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rank = Rank(args, dist)
    dist.barrier()
    rank.say(f"cpumoe.distributed demo: layer E={args.E} topk={args.topk} K={args.K} "
             f"N={args.N}, {args.scheme} weights, {str(rank.dtype).replace('torch.', '')} "
             f"activations; {plural(rank.world, 'process')} x "
             f"{plural(args.threads, 'thread')}, tier {cpumoe.isa()}, gloo; weights made in "
             f"{time.perf_counter() - t0:.1f} s")
    ok, rows = True, []
    for M in args.tokens:
        x, routings = make_inputs(args, M, TIMED_SETS * args.repeats, rank.dtype)
        ok &= check(rank, M, x, routings[0])
        rows.append(timings(rank, M, x, routings))

    world, threads = rank.world, args.threads
    rank.say(f"\ntimings, ms, median of {args.repeats} calls, each on a fresh routing:")
    rank.say(f"| M | 1 process x {plural(world * threads, 'thread')} | "
             f"{plural(world, 'process')} x {plural(threads, 'thread')} | local op, slowest "
             f"rank | all-reduce alone, [M, {args.K}] fp32 |")
    rank.say("|---:|---:|---:|---:|---:|")
    for M, single_ms, whole_ms, local_ms, reduce_ms in rows:
        base = "-" if single_ms is None else f"{single_ms:.2f}"
        rank.say(f"| {M} | {base} | {whole_ms:.2f} | {local_ms:.2f} | {reduce_ms:.3f} |")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, or run_local below
        return run_rank(args)
    from ._launch import run_local

    cmd: List[str] = [sys.executable, "-m", "cpumoe.distributed.demo",
                      *(sys.argv[1:] if argv is None else argv)]
    results = run_local(cmd, args.world_size, threads=args.threads, timeout=args.timeout,
                        capture=False)
    failed = [r for r in results if r.returncode != 0]
    for r in failed:
        why = "stopped" if r.stopped else f"exit status {r.returncode}"
        print(f"rank {r.rank}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
