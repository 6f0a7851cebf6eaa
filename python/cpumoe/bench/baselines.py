"""The PyTorch code a user would run instead of cpumoe (:data:`BASELINES`): the eager
per-expert loop (:func:`baseline_moe`) and the same loop over torch's weight-only int8 and
int4 matmuls, with the checks of whether this torch has them; and :func:`_rel_diff`, how
far cpumoe's output is from a baseline's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from .peers import PEER_ROWS
from .shapes import DTYPES, Routing

if TYPE_CHECKING:  # only for annotations: schemes imports this module
    from .schemes import ExpertWeights


def _per_expert_loop(x: torch.Tensor, N: int, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, mm1, mm2) -> torch.Tensor:
    """The eager MoE loop over the experts that received tokens (HF transformers' Mixtral /
    Qwen-MoE block): ``h = mm1(e, rows)``, ``y = mm2(e, silu(gate) * up)``, weighted, summed."""
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token, slot = torch.where(ids == e)
        h = mm1(e, x[token])  # [T, 2N]
        y = mm2(e, F.silu(h[:, :N]) * h[:, N:])  # [T, K]
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def baseline_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """What a user runs in PyTorch eager without cpumoe: the per-expert loop in the
    activation dtype, with unpacked weights ``w1 [E, 2N, K]``, ``w2 [E, K, N]``."""
    return _per_expert_loop(x, w2.shape[2], topk_weights, topk_ids,
                            lambda e, a: a @ w1[e].T, lambda e, a: a @ w2[e].T)


def baseline_int8pack_moe(x: torch.Tensor, q1: torch.Tensor, s1: torch.Tensor,
                          q2: torch.Tensor, s2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """The same per-expert loop as :func:`baseline_moe` with both GEMMs done by
    ``torch._weight_int8pack_mm(A [T, K], B int8 [OC, K], scales [OC])`` (torch's
    weight-only int8 matmul; activations stay in ``x``'s dtype): ``q1 [E, 2N, K]``,
    ``q2 [E, K, N]`` int8, ``s1 [E, 2N]``, ``s2 [E, K]`` in ``x``'s dtype."""
    return _per_expert_loop(x, q2.shape[2], topk_weights, topk_ids,
                            lambda e, a: torch._weight_int8pack_mm(a, q1[e], s1[e]),
                            lambda e, a: torch._weight_int8pack_mm(a, q2[e], s2[e]))


def baseline_int4pack_moe(x: torch.Tensor, p1: torch.Tensor, sz1: torch.Tensor,
                          p2: torch.Tensor, sz2: torch.Tensor, group_size: int,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The same per-expert loop as :func:`baseline_moe` with both GEMMs done by
    ``torch._weight_int4pack_mm_for_cpu(A [T, K], B, group_size, scales_and_zeros)``
    (torch's weight-only int4 matmul; activations stay in ``x``'s dtype): ``p1 [E, 2N, K/2]``
    and ``p2 [E, K, N/2]`` from ``torch._convert_weight_to_int4pack_for_cpu``,
    ``sz1 [E, K/gs, 2N, 2]``, ``sz2 [E, N/gs, K, 2]`` (scale, zero) in ``x``'s dtype."""
    mm = torch._weight_int4pack_mm_for_cpu
    return _per_expert_loop(x, 2 * p2.shape[2], topk_weights, topk_ids,
                            lambda e, a: mm(a, p1[e], group_size, sz1[e]),
                            lambda e, a: mm(a, p2[e], group_size, sz2[e]))


_TORCH_OP_REASON: Dict[tuple, Optional[str]] = {}


def _torch_op_unavailable(names: Sequence[str], dtype, check: Callable[[torch.dtype], bool]
                          ) -> Optional[str]:
    """None when torch has every function in ``names`` and ``check(dtype)`` (a tiny product
    with a known result) passes; else why not. Checked once per (names, dtype)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    key = (tuple(names), dtype)
    if key not in _TORCH_OP_REASON:
        missing = [n for n in names if getattr(torch, n, None) is None]
        reason = None
        if missing:
            reason = f"torch {torch.__version__} has no torch.{missing[0]}"
        else:
            try:
                if not check(dtype):
                    reason = f"torch.{names[-1]} gave a wrong result on a test product"
            except Exception as e:  # any failure means "not usable here"
                reason = f"torch.{names[-1]}: {type(e).__name__}: {str(e).splitlines()[0]}"
        _TORCH_OP_REASON[key] = reason
    return _TORCH_OP_REASON[key]


def int8pack_unavailable(dtype) -> Optional[str]:
    """None when ``torch._weight_int8pack_mm`` works here for activations of ``dtype``."""
    def check(dt: torch.dtype) -> bool:
        y = torch._weight_int8pack_mm(torch.ones(2, 64, dtype=dt),
                                      torch.full((32, 64), 2, dtype=torch.int8),
                                      torch.full((32,), 0.5, dtype=dt))
        return tuple(y.shape) == (2, 32) and bool((y.float() == 64).all())

    return _torch_op_unavailable(["_weight_int8pack_mm"], dtype, check)


def int4pack_unavailable(dtype) -> Optional[str]:
    """None when ``torch._weight_int4pack_mm_for_cpu`` (with
    ``torch._convert_weight_to_int4pack_for_cpu``) works here for activations of ``dtype``."""
    def check(dt: torch.dtype) -> bool:
        packed = torch._convert_weight_to_int4pack_for_cpu(
            torch.full((32, 64), 9, dtype=torch.int32), 2)
        sz = torch.tensor([0.5, 0.25], dtype=dt).expand(2, 32, 2).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(torch.ones(2, 64, dtype=dt), packed, 32, sz)
        # each weight is (9 - 8) * 0.5 + 0.25
        return tuple(y.shape) == (2, 32) and bool((y.float() == 48).all())

    return _torch_op_unavailable(["_convert_weight_to_int4pack_for_cpu",
                                  "_weight_int4pack_mm_for_cpu"], dtype, check)


@dataclass(frozen=True)
class Baseline:
    """A PyTorch implementation a user would run instead: a row of :data:`BASELINES`."""

    key: str  # JSON prefix: {key}_ms, {key}_iters, rel_diff_vs_{key}, ...
    column: str  # table columns "{column} ms" and "vs {column}"
    text: str  # what it is, for the table header
    unavailable: Callable[[torch.dtype], Optional[str]]
    # (weights, x) -> the call on one routing (a peer's may be {label: call}: see peers)
    make_call: Callable[[ExpertWeights, torch.Tensor], Callable[[Routing], torch.Tensor]]
    # peers only: (weights) -> the PeerFormat of that row, or why the peer has none
    format: Optional[Callable] = None


def _eager_call(w: ExpertWeights, x: torch.Tensor):
    return lambda r: baseline_moe(x, w.w1, w.w2, r.topk_weights, r.topk_ids)


def _int8pack_call(w: ExpertWeights, x: torch.Tensor):
    q1, s1, q2, s2 = w.torch_data
    s1 = s1.squeeze(-1).to(x.dtype)  # _weight_int8pack_mm wants [OC] in A's dtype
    s2 = s2.squeeze(-1).to(x.dtype)
    return lambda r: baseline_int8pack_moe(x, q1, s1, q2, s2, r.topk_weights, r.topk_ids)


def _int4pack_call(w: ExpertWeights, x: torch.Tensor):
    p1, sz1, p2, sz2, gs = w.torch_data
    return lambda r: baseline_int4pack_moe(x, p1, sz1, p2, sz2, gs, r.topk_weights, r.topk_ids)


BASELINES: Dict[str, Baseline] = {b.key: b for b in (
    Baseline("baseline", "eager", "the eager per-expert PyTorch loop in the activation dtype "
             "(quantized schemes: over the dequantized weights)", lambda dt: None, _eager_call),
    Baseline("int8pack", "int8pack", "a per-expert loop over torch._weight_int8pack_mm (int8 "
             "weights, 16-bit activations), int8 rows", int8pack_unavailable, _int8pack_call),
    Baseline("int4pack", "int4pack", "a per-expert loop over torch._weight_int4pack_mm_for_cpu "
             "(the same int4 weights and groups, 16-bit activations), int4 rows",
             int4pack_unavailable, _int4pack_call),
    *(Baseline(p.key, p.column, p.text, p.unavailable, p.make_call, p.format)
      for p in PEER_ROWS),
)}

# The rows above that are other libraries' kernels (bench/peers): they run only when
# --peers names them.
PEERS = tuple(p.key for p in PEER_ROWS)



def _rel_diff(out: torch.Tensor, ref: Optional[torch.Tensor]) -> Optional[float]:
    if ref is None:
        return None
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _speedup_key(key: str) -> str:
    """JSON key of a baseline's ratio: ``speedup`` (eager), ``speedup_int8pack``, ..."""
    return "speedup" if key == "baseline" else f"speedup_{key}"

