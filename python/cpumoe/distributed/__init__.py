"""Expert parallelism: one MoE layer whose experts are spread over processes (one per socket,
or per machine), summed with ``torch.distributed``.

Each rank holds a contiguous range of the layer's experts, packed as usual
(:func:`shard_experts` cuts any per-expert tensor: weights, scales, zero points, biases), and
every rank gets the same tokens and the same routing. :func:`fused_experts` runs the local
experts' slots (the other ids become ``-1``) with the float32 output of
:func:`cpumoe.fused_experts_fp32`, adds the ranks' float32 partial sums with one
``all_reduce`` and rounds the total once to the activation dtype::

    import torch.distributed as dist
    import cpumoe.distributed as ep

    dist.init_process_group("gloo")                      # torchrun, or env:// by hand
    rank, world = dist.get_rank(), dist.get_world_size()
    first, _ = ep.expert_range(E, rank, world)
    w1_local = ep.shard_experts(w1_packed, rank, world)  # [E / world, 2N, K]
    w2_local = ep.shard_experts(w2_packed, rank, world)
    out = ep.fused_experts(x, w1_local, w2_local, topk_weights, topk_ids,
                           first_expert=first, num_experts=E)

**Exactness.** Every rank computes each of its slots' terms ``y[m, j]`` with the same bits as
one process holding every expert would (a slot's term depends only on its token and its
expert's tokens, which are the same), sums its slots in slot order in fp32, and the
all-reduce adds the partial sums in some order: the result is the single-process fp32 sum
up to reassociation, rounded once. So, per element, with ``n`` the token's slots that are
not ``-1`` and ``u = 2^-24``: ``out`` is the activation-dtype rounding of a value within

    delta = 2 * gamma(n - 1) * sum_j |y[m, j]|,   gamma(k) = k u / (1 - k u)

of the single process's fp32 sum ``S``, whose rounding is the single process's output
(:func:`within_one_rounding` checks exactly this; docs/NUMERICS.md has the argument). In
particular ``|out - out_single| <= delta + (ulp(out) + ulp(out_single)) / 2``, and a token
with one slot gets the same bits.

**A shared expert** (DeepSeek's) is computed once, on one rank, or on every rank, as the
caller chooses:

* *once, on one rank, inside the one rounding*: make it one more routed expert, global id
  ``E``, held by the last rank (whose range then ends at ``E + 1``), and give every token a
  slot for it, as the routing ops' fused shared experts do
  (``biased_grouped_topk(..., num_fused_shared_experts=1, routed_scaling_factor=f)``: id
  ``E``, weight ``sum of the routed weights / f``). The last rank appends the shared
  expert's packed weights to its shard (``torch.cat([shard, shared[None]])``, and its scales
  alike) and every rank passes ``num_experts=E + 1``. Its ``N`` must be the routed experts'
  (DeepSeek-V3: 2048 both);
* *on every rank, after the all-reduce*: ``cpumoe.shared_expert(x, sw1, sw2, out, f)`` with
  the result of :func:`fused_experts`, exactly the single-process sequence
  (``fused_experts_cpu`` then ``shared_expert_cpu``); any shared expert size, and every rank
  holds a copy of its weights.

Every rank must pass the same ``hidden_states``, ``topk_weights`` and ``topk_ids`` (one M),
and call :func:`fused_experts` the same number of times: it is a collective.
``python -m cpumoe.distributed.demo`` runs a sharded layer and times it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops import fused_experts_fp32

_OP = "cpumoe.distributed.fused_experts"
UNIT_ROUNDOFF = 2.0 ** -24  # fp32, round to nearest


def expert_range(num_experts: int, rank: int, world_size: int) -> Tuple[int, int]:
    """``(first_expert, count)`` of ``rank``'s experts when ``num_experts`` are split evenly
    over ``world_size`` ranks in order: rank r holds ``[r * E / world, (r + 1) * E / world)``.
    A RuntimeError when they do not divide evenly or rank is not in ``[0, world_size)``."""
    name = "expert_range"
    if world_size < 1:
        raise RuntimeError(f"{name}: world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"{name}: rank must be in [0, world_size = {world_size}), got {rank}")
    if num_experts < 1 or num_experts % world_size:
        raise RuntimeError(
            f"{name}: num_experts = {num_experts} experts do not split evenly over "
            f"world_size = {world_size} ranks (give each rank its own range and pass "
            f"first_expert to cpumoe.distributed.fused_experts)")
    count = num_experts // world_size
    return rank * count, count


def shard_experts(tensor: Optional[torch.Tensor], rank: int,
                  world_size: int) -> Optional[torch.Tensor]:
    """Rank ``rank``'s share of a per-expert tensor ``[E, ...]``: rows
    ``[rank * E / world_size, (rank + 1) * E / world_size)`` along dim 0, as a view
    (``.clone()`` it to let the full tensor go). Works for every tensor of an expert set,
    packed or not: ``w1``, ``w2``, their scales, zero points and biases (each has E first);
    ``None`` gives ``None``. A RuntimeError naming ``tensor`` when E does not divide evenly."""
    if tensor is None:
        return None
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise RuntimeError(f"shard_experts: tensor must hold the experts on dim 0, got shape "
                           f"{list(tensor.shape)}")
    E = tensor.shape[0]
    if world_size >= 1 and E % world_size:
        raise RuntimeError(
            f"shard_experts: tensor has E = {E} experts (dim 0 of shape {list(tensor.shape)}), "
            f"which do not split evenly over world_size = {world_size} ranks")
    first, count = expert_range(E, rank, world_size)
    return tensor[first:first + count]


def _local_ids(topk_ids: torch.Tensor, first_expert: int, local_experts: int,
               num_experts: int) -> torch.Tensor:
    """topk_ids with the local experts' ids shifted to ``[0, local_experts)`` and every
    other slot ``-1``; ids outside ``[0, num_experts)`` other than -1 are an error."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{_OP}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bad.any():
        pos = tuple(bad.nonzero()[0].tolist())
        raise RuntimeError(
            f"{_OP}: topk_ids{list(pos)} = {int(topk_ids[pos])} is outside [0, num_experts = "
            f"{num_experts}) (only -1, meaning 'skip this slot', may lie outside)")
    local = topk_ids - first_expert
    return local.masked_fill((local < 0) | (local >= local_experts), -1)


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, first_expert: int,
                  num_experts: int, group=None, **op_kwargs) -> torch.Tensor:
    """One MoE layer with its experts spread over the ranks of ``group`` (default: the
    world). Collective: every rank of the group calls it with the same ``hidden_states``,
    ``topk_weights`` and ``topk_ids`` (global expert ids in ``[0, num_experts)``, or -1).

    Args:
        w1, w2: this rank's experts ``[first_expert, first_expert + w1.shape[0])``, packed as
            for :func:`cpumoe.fused_experts` (any scheme), with their scales, zero points
            and biases in ``op_kwargs`` cut alike (:func:`shard_experts`).
        first_expert: the global id of this rank's first expert.
        num_experts: the experts of the whole layer (ids at or above are an error).
        group: a ``torch.distributed`` process group.
        op_kwargs: any keyword argument of :func:`cpumoe.fused_experts`
            (``moe_comp_method``, scales, zeros, ``block_size``, biases, ``alpha``/``limit``,
            ``activation``, ``is_vnni``, ``inplace``).

    Returns:
        ``[M, K]`` in the dtype of ``hidden_states`` (written into it with ``inplace=True``):
        the float32 partial sums of all ranks added by one ``all_reduce`` and rounded once;
        within the bound of this module's docstring of the single-process result.
    """
    import torch.distributed as dist

    inplace = bool(op_kwargs.pop("inplace", False))
    if w1.dim() < 1:
        raise RuntimeError(f"{_OP}: w1 must have the experts on dim 0, got a 0-D tensor")
    local_experts = w1.shape[0]
    if num_experts < 1:
        raise RuntimeError(f"{_OP}: num_experts must be at least 1, got {num_experts}")
    if first_expert < 0 or first_expert + local_experts > num_experts:
        raise RuntimeError(
            f"{_OP}: first_expert = {first_expert} with w1.shape[0] = {local_experts} local "
            f"experts is not a range within [0, num_experts = {num_experts})")
    local_ids = _local_ids(topk_ids, first_expert, local_experts, num_experts)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_OP}: torch.distributed is not initialized (call "
                           f"torch.distributed.init_process_group first)")
    partial = fused_experts_fp32(hidden_states, w1, w2, topk_weights, local_ids, **op_kwargs)
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    out = partial.to(hidden_states.dtype)
    return hidden_states.copy_(out) if inplace else out


# ---------------------------------------------------------------------------------------
# The error bound, as code: what the tests and the demo check.


def slot_terms(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               **op_kwargs) -> torch.Tensor:
    """The float32 terms ``y[j, m] = g[m, j] * (W2[e] . act(W1[e] . x[m] + b1) + b2)`` of
    every slot, ``[topk, M, K]``, with the bits the op sums (0 for slots with id -1): one
    :func:`cpumoe.fused_experts_fp32` call per slot index j with every other slot's weight
    set to 0, so every expert still gets the same tokens (and on every tier the same
    kernels), and the sum ``+0 + ... + y + ... + 0`` is exactly ``y``. Costs topk calls."""
    terms = []
    for j in range(topk_ids.shape[1]):
        weights = torch.zeros_like(topk_weights)
        weights[:, j] = topk_weights[:, j]
        terms.append(fused_experts_fp32(hidden_states, w1, w2, weights, topk_ids, **op_kwargs))
    return torch.stack(terms)


def reassociation_bound(terms: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, K]``: how far apart two fp32 sums of the same terms in different orders
    can be, ``2 gamma(n - 1) sum_j |y[j, m]|`` with ``n`` the token's slots that are not
    -1, ``gamma(k) = k u / (1 - k u)``, ``u = 2^-24`` (each sum is within
    ``gamma(n - 1) sum |y|`` of the exact sum, whatever its order: Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., section 4.2). Sums of one term are exact."""
    n = (topk_ids != -1).sum(1).double()
    k = (n - 1).clamp(min=0) * UNIT_ROUNDOFF
    gamma = k / (1 - k)
    return 2 * gamma[:, None] * terms.double().abs().sum(0)


def within_one_rounding(out: torch.Tensor, fp32_sum: torch.Tensor,
                        bound: torch.Tensor) -> torch.Tensor:
    """Elementwise: whether ``out`` (bf16 or fp16) is the rounding, to nearest, of some value
    within ``bound`` of ``fp32_sum``: whether the interval of values that round to ``out``,
    ``[out - gap below / 2, out + gap above / 2]``, meets
    ``[fp32_sum - bound, fp32_sum + bound]`` (in float64, where all of this is exact)."""
    up = torch.nextafter(out, torch.full_like(out, float("inf")))
    down = torch.nextafter(out, torch.full_like(out, float("-inf")))
    v = out.double()
    lo = v - (v - down.double()) / 2
    hi = v + (up.double() - v) / 2
    s = fp32_sum.double()
    return (lo <= s + bound) & (hi >= s - bound)
