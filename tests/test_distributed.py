"""Expert parallelism (cpumoe.distributed) and the op under it, fused_experts_fp32_cpu:

* fused_experts_fp32_cpu: its float32 output, rounded once, is fused_experts_cpu's output
  bit for bit, on every tier, scheme and activation dtype, with biases, GELU, the clamped
  SwiGLU, skipped slots, several chunks of tokens and any thread count; its fake kernel
  (opcheck), its reference and its errors;
* the exactness argument, in one process: the shards' float32 partial sums, added in any
  order and rounded once, are within one rounding of one process holding every expert
  (cpumoe.distributed.within_one_rounding with the bound of reassociation_bound), on every
  tier and scheme, with uneven routing, ranks without tokens and a fused shared expert; and
  the check fails for partial sums rounded per rank;
* shard_experts, expert_range and cpumoe.distributed.fused_experts' argument errors;
* 2 and 4 processes joined by gloo over 127.0.0.1 (skipped where torch.distributed or gloo
  is missing): the same check for every case (every scheme, dtype and routing kind, the
  variants, one token, no token, a fused shared expert) on the best tier and the scalar
  one, every rank the same bits, the shared expert computed on every rank after the
  all-reduce; the run is stopped if it hangs;
* the demo (python -m cpumoe.distributed.demo), small, passes its own checks.

Run as a script (``--worker DIR``) this file is one rank of those processes.
"""

from __future__ import annotations

import math
import os
import sys
from datetime import timedelta

import pytest
import torch

import cpumoe
import cpumoe.distributed as ep
from cpumoe import reference
from cpumoe_testing import (
    DTYPES,
    INT4,
    MXFP4,
    Int4Weights,
    assert_elementwise_close,
    make_bias,
    make_mxfp4_weights,
    make_routing,
    make_scheme_weights,
    pack,
    raises,
    subprocess_env,
    use_isa,
)

SCHEMES = {"bf16": 0, "int8": 1, "fp8": 2, "int4": INT4, "mxfp4": MXFP4}
E, N, K, TOPK, M = 8, 64, 128, 3, 37
FACTOR = 2.5  # a routed scaling factor for the shared-expert cases


# ---------------------------------------------------------------------------------------
# Layers: full expert sets, packed, with their keyword arguments.


def make_layer(scheme: str, dtype: torch.dtype, experts: int = E, n: int = N, k: int = K,
               variant: str = "silu"):
    """(w1, w2, op keyword arguments) of `experts` packed experts; variant "silu", "gelu"
    (with biases) or "swiglu" (clamped SwiGLU with biases)."""
    method = SCHEMES[scheme]
    if method == INT4:
        w = Int4Weights(experts, n, k, 32)
        w1, w2, kw = w.p1[0], w.p2[0], w.op_kwargs()
    elif method == MXFP4:
        c1, s1, c2, s2 = make_mxfp4_weights(experts, n, k)
        w1, w2 = pack(c1), pack(c2)
        kw = dict(moe_comp_method=MXFP4, w1_scale=cpumoe.convert_scale_packed(s1),
                  w2_scale=cpumoe.convert_scale_packed(s2))
    else:
        u1, u2, kw = make_scheme_weights(method, experts, n, k, dtype, block=(32, 64))
        w1, w2 = pack(u1), pack(u2)
    if variant != "silu":
        kw["w1_bias"], kw["w2_bias"] = make_bias(experts, n, k)
    if variant == "gelu":
        kw["activation"] = "gelu"
    if variant == "swiglu":
        kw["alpha"], kw["limit"] = 1.702, 7.0
    return w1, w2, kw


def shard(w1, w2, kw, first: int, count: int):
    """Experts [first, first + count) of a layer: every per-expert tensor cut alike."""
    cut = {k: v[first:first + count] if isinstance(v, torch.Tensor) else v
           for k, v in kw.items()}
    return w1[first:first + count], w2[first:first + count], cut


def routing(kind: str, m: int, world: int, experts: int = E, topk: int = TOPK):
    """(topk_weights, topk_ids) of `m` tokens over `experts` split over `world` ranks:
    "random" (10 % of slots -1), "uneven" (every slot on rank 0's experts), "last_empty"
    (no slot on the last rank's experts)."""
    tw, ti = make_routing(m, experts, topk, drop_prob=0.1 if kind == "random" else 0.0)
    share = experts // world
    if kind == "uneven":
        ti = torch.randint(0, share, ti.shape, dtype=ti.dtype)
    elif kind == "last_empty":
        ti = torch.randint(0, experts - share, ti.shape, dtype=ti.dtype)
    return tw, ti


def with_fused_shared(tw, ti, experts: int):
    """The routing plus a last slot for a shared expert of id `experts`, weighted as the
    routing ops' fused shared experts are: the routed weights' sum / FACTOR."""
    shared_w = tw.sum(1, keepdim=True) / FACTOR
    shared_id = torch.full_like(ti[:, :1], experts)
    return torch.cat([tw, shared_w], 1), torch.cat([ti, shared_id], 1)


def ranges(experts: int, world: int, extra_on_last: int = 0):
    """Each rank's (first, count): an even split, the last rank holding `extra_on_last`
    more experts (a fused shared expert)."""
    out = [ep.expert_range(experts, r, world) for r in range(world)]
    first, count = out[-1]
    out[-1] = (first, count + extra_on_last)
    return out


def rank_partials(x, w1, w2, tw, ti, kw, rank_ranges, num_experts):
    """What each rank's op computes: its float32 partial sum."""
    parts = []
    for first, count in rank_ranges:
        lw1, lw2, lkw = shard(w1, w2, kw, first, count)
        ids = ep._local_ids(ti, first, count, num_experts)
        parts.append(cpumoe.fused_experts_fp32(x, lw1, lw2, tw, ids, **lkw))
    return parts


def add_in_order(parts, order: str) -> torch.Tensor:
    """An fp32 sum of the partials in one of the orders an all-reduce may take."""
    if order == "reversed":
        parts = parts[::-1]
    if order == "tree":
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        return parts[0]
    total = torch.zeros_like(parts[0])
    for p in parts:
        total += p
    return total


def single_process(x, w1, w2, tw, ti, kw):
    """(fp32 sum, the op's output, the bound) of one process holding every expert."""
    fp32 = cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, **kw)
    out = cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)
    bound = ep.reassociation_bound(ep.slot_terms(x, w1, w2, tw, ti, **kw), ti)
    return fp32, out, bound


def outside(out, fp32, bound) -> int:
    return int((~ep.within_one_rounding(out, fp32, bound)).sum())


# ---------------------------------------------------------------------------------------
# fused_experts_fp32_cpu


@pytest.mark.parametrize("variant", ["silu", "gelu", "swiglu"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fp32_rounded_once_is_the_op(isa, scheme, dt, variant):
    """fused_experts_fp32(...).to(dtype) is fused_experts(...) bit for bit: the only
    difference between the two is the reduce stage's last rounding."""
    dtype = DTYPES[dt]
    w1, w2, kw = make_layer(scheme, dtype, variant=variant)
    for m in (1, 4, M):
        x = torch.randn(m, K).to(dtype)
        tw, ti = make_routing(m, E, TOPK, drop_prob=0.2)
        fp32 = cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, **kw)
        assert fp32.dtype == torch.float32 and fp32.shape == (m, K)
        assert torch.equal(fp32.to(dtype), cpumoe.fused_experts(x, w1, w2, tw, ti, **kw)), m


def test_fp32_several_chunks_and_threads(isa):
    """1100 tokens (two chunks of the pipeline), 1 and 2 threads: the same bits, and the
    rounding of them is the op's output."""
    w1, w2, kw = make_layer("int8", torch.bfloat16, n=32, k=64)
    x = torch.randn(1100, 64).to(torch.bfloat16)
    tw, ti = make_routing(1100, E, 2, drop_prob=0.1)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, **kw))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0].bfloat16(), cpumoe.fused_experts(x, w1, w2, tw, ti, **kw))


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_fp32_against_reference(dt):
    """Against reference.fused_experts_fp32 (torch's summation order), within the
    tolerance of the rounded op (the fp32 sums differ by fp32 noise; rounding both to the
    activation dtype puts them within one output ulp)."""
    dtype = DTYPES[dt]
    u1, u2, kw = make_scheme_weights(0, E, N, K, dtype)
    b1, b2 = make_bias(E, N, K)
    x = torch.randn(M, K).to(dtype)
    tw, ti = make_routing(M, E, TOPK, drop_prob=0.1)
    got = cpumoe.fused_experts_fp32(x, pack(u1), pack(u2), tw, ti, w1_bias=b1, w2_bias=b2)
    want = reference.fused_experts_fp32(x, u1, u2, tw, ti, w1_bias=b1, w2_bias=b2)
    assert want.dtype == torch.float32
    assert_elementwise_close(got.to(dtype), want.to(dtype), {dtype: dict(atol=1e-2, rtol=1e-2)})
    assert torch.equal(want.to(dtype), reference.fused_experts(x, u1, u2, tw, ti, w1_bias=b1,
                                                               w2_bias=b2))


def test_fp32_empty_and_all_skipped():
    w1, w2, kw = make_layer("bf16", torch.bfloat16)
    empty = cpumoe.fused_experts_fp32(torch.zeros(0, K, dtype=torch.bfloat16), w1, w2,
                                      torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert empty.shape == (0, K) and empty.dtype == torch.float32
    x = torch.randn(5, K).to(torch.bfloat16)
    out = cpumoe.fused_experts_fp32(x, w1, w2, torch.ones(5, 2),
                                    torch.full((5, 2), -1, dtype=torch.int32))
    assert torch.equal(out, torch.zeros(5, K))


def test_fp32_opcheck():
    w1, w2, kw = make_layer("bf16", torch.bfloat16, variant="gelu")
    x = torch.randn(3, K).to(torch.bfloat16)
    tw, ti = make_routing(3, E, 2)
    args = (x, w1, w2, tw, ti, 0, None, None, None, None, None, kw["w1_bias"], kw["w2_bias"],
            None, None, True, "gelu")
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_fp32_cpu.default, args)


def test_fp32_errors_name_the_op():
    """fused_experts_fp32_cpu runs fused_experts_cpu's checks; its messages name it."""
    w1, w2, _ = make_layer("bf16", torch.bfloat16)
    x = torch.randn(4, K).to(torch.bfloat16)
    tw, ti = make_routing(4, E, 2)
    with raises(r"^fused_experts_fp32_cpu: hidden_states must be bfloat16 or float16"):
        cpumoe.fused_experts_fp32(x.float(), w1, w2, tw, ti)
    with raises(r"^fused_experts_fp32_cpu: topk_ids\[1, 0\] = 8 is outside \[0, 8\)"):
        bad = ti.clone()
        bad[1, 0] = E
        cpumoe.fused_experts_fp32(x, w1, w2, tw, bad)
    with raises(r"^fused_experts_fp32_cpu: alpha needs limit"):
        cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, alpha=1.0)
    with raises(r"^fused_experts_fp32_cpu: moe_comp_method must be 0"):
        cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, moe_comp_method=9)


# ---------------------------------------------------------------------------------------
# The bound, in one process: shards added in fp32, rounded once.


@pytest.mark.parametrize("kind", ["random", "uneven", "last_empty"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_shards_within_one_rounding(isa, scheme, dt, kind):
    """2 and 4 shards, their partial sums added in three orders: every element is the
    rounding of a value within reassociation_bound of the single process's fp32 sum."""
    dtype = DTYPES[dt]
    w1, w2, kw = make_layer(scheme, dtype, variant="gelu" if kind == "random" else "silu")
    x = torch.randn(M, K).to(dtype)
    for world in (2, 4):
        tw, ti = routing(kind, M, world)
        fp32, single, bound = single_process(x, w1, w2, tw, ti, kw)
        assert torch.equal(fp32.to(dtype), single)
        parts = rank_partials(x, w1, w2, tw, ti, kw, ranges(E, world), E)
        if kind != "random":  # ranks with no token return exact zeros
            assert all(torch.equal(p, torch.zeros_like(p)) for p in parts[1 if kind == "uneven"
                                                                         else world - 1:])
        for order in ("rank", "reversed", "tree"):
            out = add_in_order(parts, order).to(dtype)
            assert outside(out, fp32, bound) == 0, (world, order)


def test_fused_shared_expert_on_the_last_rank(isa):
    """The shared expert as expert E on the last rank, one more slot per token (weight: the
    routed weights' sum / factor): within one rounding of one process with E + 1 experts."""
    w1, w2, kw = make_layer("fp8", torch.bfloat16, experts=E + 1)
    x = torch.randn(M, K).to(torch.bfloat16)
    tw, ti = with_fused_shared(*make_routing(M, E, TOPK), E)
    fp32, _, bound = single_process(x, w1, w2, tw, ti, kw)
    for world in (2, 4):
        parts = rank_partials(x, w1, w2, tw, ti, kw, ranges(E, world, extra_on_last=1), E + 1)
        assert outside(add_in_order(parts, "rank").bfloat16(), fp32, bound) == 0


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_check_catches_rounding_per_rank(isa, dt):
    """The check can fail: partial sums rounded to the activation dtype on each rank before
    they are added (a second rounding) fall outside the bound, on every scheme."""
    dtype = DTYPES[dt]
    x = torch.randn(64, K).to(dtype)
    for scheme in SCHEMES:
        w1, w2, kw = make_layer(scheme, dtype)
        tw, ti = make_routing(64, E, TOPK)
        fp32, _, bound = single_process(x, w1, w2, tw, ti, kw)
        parts = rank_partials(x, w1, w2, tw, ti, kw, ranges(E, 2), E)
        assert outside(add_in_order(parts, "rank").to(dtype), fp32, bound) == 0
        rounded_per_rank = add_in_order([p.to(dtype).float() for p in parts], "rank")
        assert outside(rounded_per_rank.to(dtype), fp32, bound) > 0, scheme


def test_bound_arithmetic():
    """reassociation_bound and within_one_rounding on hand-made values."""
    ids = torch.tensor([[0, -1, -1], [0, 1, 2]])
    terms = torch.tensor([[[1.0], [1.0]], [[0.0], [-2.0]], [[0.0], [4.0]]])  # [topk, M, K]
    bound = ep.reassociation_bound(terms, ids)
    assert bound[0, 0] == 0  # one term: exact
    u = 2.0 ** -24
    assert bound[1, 0] == pytest.approx(2 * (2 * u / (1 - 2 * u)) * 7, rel=1e-12)
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    s = torch.tensor([1.0 + 2.0 ** -8])  # the midpoint between 1 and its bf16 neighbour
    zero = torch.zeros(1, dtype=torch.float64)
    assert ep.within_one_rounding(one, s, zero).all()  # ties may go either way
    assert not ep.within_one_rounding(one, s + 2.0 ** -20, zero).any()
    assert ep.within_one_rounding(one, s + 2.0 ** -20, zero + 2.0 ** -20).all()
    nxt = torch.tensor([1.0 + 2.0 ** -7], dtype=torch.bfloat16)
    assert ep.within_one_rounding(nxt, s + 2.0 ** -20, zero).all()
    below = torch.tensor([1.0 - 2.0 ** -9 - 2.0 ** -20])  # the gap below 1 is half as wide
    assert not ep.within_one_rounding(one, below, zero).any()
    assert ep.within_one_rounding(one, below + 2.0 ** -20, zero).all()


# ---------------------------------------------------------------------------------------
# Arguments


def test_shard_experts():
    t = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(ep.shard_experts(t, 1, 4), t[2:4])
    assert ep.shard_experts(t, 0, 1) is not None and ep.shard_experts(t, 0, 1).shape == (8, 3)
    assert ep.shard_experts(None, 0, 2) is None
    assert ep.expert_range(128, 3, 4) == (96, 32)
    with raises(r"^shard_experts: tensor has E = 8 experts .* world_size = 3 ranks"):
        ep.shard_experts(t, 0, 3)
    with raises(r"^shard_experts: tensor must hold the experts on dim 0"):
        ep.shard_experts(torch.tensor(1.0), 0, 1)
    with raises(r"^expert_range: rank must be in \[0, world_size = 4\), got 4"):
        ep.shard_experts(t, 4, 4)
    with raises(r"^expert_range: world_size must be at least 1"):
        ep.expert_range(8, 0, 0)


def test_fused_experts_argument_errors():
    w1, w2, _ = make_layer("bf16", torch.bfloat16)
    x = torch.randn(4, K).to(torch.bfloat16)
    tw, ti = make_routing(4, 2 * E, 2)
    call = ep.fused_experts
    with raises(r"^cpumoe.distributed.fused_experts: first_expert = 9 with w1.shape\[0\] = 8 "):
        call(x, w1, w2, tw, ti, first_expert=9, num_experts=2 * E)
    with raises(r"^cpumoe.distributed.fused_experts: num_experts must be at least 1"):
        call(x, w1, w2, tw, ti, first_expert=0, num_experts=0)
    bad = ti.clone()
    bad[2, 1] = 2 * E
    with raises(r"^cpumoe.distributed.fused_experts: topk_ids\[2, 1\] = 16 is outside"):
        call(x, w1, w2, tw, bad, first_expert=8, num_experts=2 * E)
    with raises(r"^cpumoe.distributed.fused_experts: topk_ids must be int32 or int64"):
        call(x, w1, w2, tw, ti.float(), first_expert=8, num_experts=2 * E)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        with raises(r"^cpumoe.distributed.fused_experts: torch.distributed is not initialized"):
            call(x, w1, w2, tw, ti, first_expert=8, num_experts=2 * E)


def test_local_ids():
    ti = torch.tensor([[0, 3, 4, -1], [7, 5, 2, 4]], dtype=torch.int64)
    want = torch.tensor([[-1, -1, 0, -1], [-1, 1, -1, 0]], dtype=torch.int64)
    assert torch.equal(ep._local_ids(ti, 4, 2, 8), want)
    assert torch.equal(ep._local_ids(ti.int(), 4, 2, 8), want.int())


# ---------------------------------------------------------------------------------------
# Processes: 2 and 4 ranks over gloo on 127.0.0.1.

WORKER_TIMEOUT = 150.0  # seconds before a stuck run is stopped (it takes a few seconds)
PROCESS_GROUP_TIMEOUT = 60.0
# The tiers the processes run every case on: the best and the portable one (the tests above
# hold every tier to the bound in one process; what processes add is gloo's sum).
PROCESS_TIERS = list(dict.fromkeys([cpumoe.best_isa(), "scalar"]))


def gloo_missing():
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch has no torch.distributed"
    if not dist.is_gloo_available():
        return "this torch.distributed has no gloo backend"
    return None


def process_cases(world: int) -> list:
    """The cases every rank runs: each scheme and dtype with each routing kind, the
    variants, one token, no token, a fused shared expert (on the last rank) and a shared
    expert computed on every rank after the all-reduce."""
    cases, layers = [], {}

    def add(name, scheme, dt, kind="random", variant="silu", m=M, fused_shared=False,
            shared=False):
        dtype = DTYPES[dt]
        experts = E + 1 if fused_shared else E
        key = (scheme, dt, experts, variant)  # the routing kinds share a layer
        if key not in layers:
            layers[key] = make_layer(scheme, dtype, experts=experts, variant=variant)
        w1, w2, kw = layers[key]
        tw, ti = routing(kind, m, world)
        if fused_shared:
            tw, ti = with_fused_shared(tw, ti, E)
        case = dict(name=name, dt=dt, x=torch.randn(m, K).to(dtype), w1=w1, w2=w2, kw=kw,
                    tw=tw, ti=ti, num_experts=experts, extra_on_last=int(fused_shared))
        if shared:
            s1, s2, _ = make_layer("bf16", dtype, experts=1, n=2 * N)
            case.update(shared_w1=s1[0], shared_w2=s2[0])
        cases.append(case)

    for scheme in SCHEMES:
        for dt in DTYPES:
            for kind in ("random", "uneven", "last_empty"):
                add(f"{scheme}-{dt}-{kind}", scheme, dt, kind)
    add("bf16-gelu-bias", "bf16", "bf16", variant="gelu")
    add("int8-swiglu-bias", "int8", "fp16", variant="swiglu")
    add("int4-one-token", "int4", "bf16", m=1)
    add("fp8-no-token", "fp8", "bf16", m=0)
    add("fp8-fused-shared", "fp8", "bf16", fused_shared=True)
    add("bf16-shared-replicated", "bf16", "bf16", shared=True)
    return cases


def case_ranges(case, world):
    return ranges(E, world, case["extra_on_last"])


def worker_main(directory: str) -> None:
    """One rank: every case on every tier, saved for the test to check."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT))
    spec = torch.load(os.path.join(directory, "cases.pt"))
    results = {}
    for tier in spec["tiers"]:
        cpumoe.set_isa(tier)
        for case in spec["cases"]:
            first, count = case_ranges(case, world)[rank]
            w1, w2, kw = shard(case["w1"], case["w2"], case["kw"], first, count)
            x, tw, ti = case["x"], case["tw"], case["ti"]
            out = ep.fused_experts(x, w1, w2, tw, ti, first_expert=first,
                                   num_experts=case["num_experts"], **kw)
            results[f"{tier}/{case['name']}"] = out
            if "shared_w1" in case:
                results[f"{tier}/{case['name']}/shared"] = cpumoe.shared_expert(
                    x, case["shared_w1"], case["shared_w2"], out, FACTOR)
            if tier == spec["tiers"][0]:  # the mistake the check must catch
                ids = ep._local_ids(ti, first, count, case["num_experts"])
                partial = cpumoe.fused_experts_fp32(x, w1, w2, tw, ids, **kw)
                rounded = partial.to(x.dtype).float()
                dist.all_reduce(rounded)
                results[f"per-rank rounding/{case['name']}"] = rounded.to(x.dtype)
    torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The gap above each value of a bf16/fp16 tensor, in float64."""
    return torch.nextafter(t, torch.full_like(t, math.inf)).double() - t.double()


@pytest.mark.skipif(gloo_missing() is not None, reason=str(gloo_missing()))
@pytest.mark.parametrize("world", [2, 4])
def test_processes(world, tmp_path):
    from cpumoe.distributed._launch import run_local

    cases = process_cases(world)
    torch.save(dict(tiers=PROCESS_TIERS, cases=cases), tmp_path / "cases.pt")
    results = run_local([sys.executable, os.path.abspath(__file__), "--worker", str(tmp_path)],
                        world, threads=1, timeout=WORKER_TIMEOUT, env=subprocess_env())
    for r in results:
        assert r.returncode == 0 and not r.stopped, (
            f"rank {r.rank} {'was stopped' if r.stopped else f'failed ({r.returncode})'}:\n"
            f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for key in outs[0]:
        for r in range(1, world):
            assert torch.equal(outs[r][key], outs[0][key]), f"rank {r} differs from 0: {key}"
    caught = 0
    for tier in PROCESS_TIERS:
        with use_isa(tier):
            for case in cases:
                x, w1, w2, kw, tw, ti = (case[k] for k in ("x", "w1", "w2", "kw", "tw", "ti"))
                fp32, single, bound = single_process(x, w1, w2, tw, ti, kw)
                out = outs[0][f"{tier}/{case['name']}"]
                assert out.shape == x.shape and out.dtype == x.dtype
                assert outside(out, fp32, bound) == 0, f"{tier}/{case['name']}"
                if tier == PROCESS_TIERS[0]:
                    caught += outside(outs[0][f"per-rank rounding/{case['name']}"], fp32, bound)
                if "shared_w1" in case:  # the single-process sequence, on every rank
                    got = outs[0][f"{tier}/{case['name']}/shared"]
                    want = cpumoe.shared_expert(x, case["shared_w1"], case["shared_w2"], single,
                                                FACTOR)
                    # shared_expert adds FACTOR * its input and rounds once
                    slack = FACTOR * (out.double() - single.double()).abs()
                    assert ((got.double() - want.double()).abs()
                            <= slack + (ulp(got) + ulp(want)) / 2).all()
                    assert torch.equal(got, want) or not torch.equal(out, single)
    assert caught > 0, "partial sums rounded per rank passed the check"


@pytest.mark.skipif(gloo_missing() is not None, reason=str(gloo_missing()))
@pytest.mark.parametrize("scheme", ["bf16", "mxfp4"])
def test_demo_runs_and_checks(scheme):
    """The README's example, small: it starts its processes, its checks pass (exit 0, an
    'ok' line per M) and it prints its timing table with every column filled."""
    import subprocess

    cmd = [sys.executable, "-m", "cpumoe.distributed.demo", "--world-size", "2", "--scheme",
           scheme, "--E", "8", "--topk", "2", "--K", "256", "--N", "128", "--tokens", "1,9",
           "--repeats", "2", "--timeout", str(WORKER_TIMEOUT)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(),
                         timeout=2 * WORKER_TIMEOUT)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    lines = run.stdout.splitlines()
    assert sum(line.startswith("check M=") and line.endswith("ok") for line in lines) == 2
    rows = [line.split("|")[1:-1] for line in lines if line.startswith(("| 1 |", "| 9 |"))]
    assert len(rows) == 2 and all(float(cell) >= 0 for row in rows for cell in row), run.stdout


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker_main(sys.argv[2])
