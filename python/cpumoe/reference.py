"""Pure-torch reference of every cpumoe op: the executable specification.

Readable first, fast never. Each function takes the same arguments as the op it
describes, with unpacked weights, and reproduces its rounding points:

* GEMMs in float32 (products of 16-bit values are exact in fp32);
* the activation output rounded to the activation dtype (as a bf16/fp16 model
  stores it before the down projection);
* the topk weight applied after w2 (and after its bias), in float32;
* the sum over the topk slots, and any residual, in float32, rounded once.

Summation order inside a GEMM differs from the kernels', so tests compare with
a tolerance per scheme (see tests/), never bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """`[gate; up]` halves along the last dim: silu(gate) * up."""
    n = h.shape[-1] // 2
    return F.silu(h[..., :n]) * h[..., n:]


def swiglu_clamp(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS activation: gate = h[..., 0::2], up = h[..., 1::2] (interleaved rows);
    gate is clamped above at `limit`, up to [-limit, limit];
    out = gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> torch.Tensor:
    """One expert on rows x [T, K] (16-bit): returns y [T, K] in float32, before the
    topk weight. w1 [2N, K], w2 [K, N] unpacked, same dtype as x."""
    h = x.float() @ w1.float().t()
    if b1 is not None:
        h = h + b1.float()
    a = swiglu_clamp(h, alpha, limit) if alpha is not None else silu_and_mul(h)
    a = a.to(x.dtype).float()  # the intermediate is stored in the activation dtype
    y = a @ w2.float().t()
    if b2 is not None:
        y = y + b2.float()
    return y


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> torch.Tensor:
    """Reference of `fused_experts_cpu` with moe_comp_method=0 and unpacked weights.

    hidden_states [M, K] bf16/fp16; w1 [E, 2N, K]; w2 [E, K, N]; topk_weights and
    topk_ids [M, topk]; an id of -1 skips its slot. Returns [M, K] in the dtype of
    hidden_states.
    """
    M, K = hidden_states.shape
    out = torch.zeros(M, K, dtype=torch.float32)
    ids = topk_ids.long()
    weights = topk_weights.float()
    for e in ids.unique().tolist():
        if e < 0:
            continue
        rows, slots = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp(
            hidden_states[rows],
            w1[e],
            w2[e],
            None if w1_bias is None else w1_bias[e],
            None if w2_bias is None else w2_bias[e],
            alpha,
            limit,
        )
        contrib = torch.zeros(M, ids.shape[1], K, dtype=torch.float32)
        contrib[rows, slots] = y * weights[rows, slots, None]
        out += contrib.sum(1)
    return out.to(hidden_states.dtype)


def shared_expert(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    fused_experts_out: Optional[torch.Tensor] = None,
    routed_scaling_factor: Optional[float] = None,
) -> torch.Tensor:
    """Reference of `shared_expert_cpu` with 16-bit unpacked weights w1 [2N, K], w2 [K, N]:
    mlp(x) + routed_scaling_factor * fused_experts_out, in float32, rounded once."""
    y = expert_mlp(hidden_states, w1, w2)
    if fused_experts_out is not None:
        y = y + routed_scaling_factor * fused_experts_out.float()
    return y.to(hidden_states.dtype)


def pack_vnni2(weight: torch.Tensor) -> torch.Tensor:
    """Reference of `convert_weight_packed` for 16-bit weights [..., OC, IC]: blocks of
    32 rows (the last may hold 16), each stored as [IC/2][rows][2] (docs/FORMATS.md)."""
    *lead, oc, ic = weight.shape
    w = weight.reshape(-1, oc, ic)
    blocks = []
    for r0 in range(0, oc, 32):
        blk = w[:, r0 : r0 + 32, :]  # [B, nsz, IC]
        nsz = blk.shape[1]
        blocks.append(blk.reshape(-1, nsz, ic // 2, 2).permute(0, 2, 1, 3).reshape(-1, nsz * ic))
    return torch.cat(blocks, dim=1).reshape(*lead, oc, ic)
