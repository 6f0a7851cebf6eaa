"""Pure-torch reference of every cpumoe op: the executable specification.

Readable first, fast never. Each function takes the same arguments as the op it
describes, with unpacked weights, and reproduces its rounding points:

* GEMMs in float32 (products of 16-bit values are exact in fp32);
* the activation output rounded to the activation dtype (as a bf16/fp16 model
  stores it before the down projection);
* the topk weight applied after w2 (and after its bias), in float32;
* the sum over the topk slots, and any residual, in float32, rounded once.

INT8 W8A8 (moe_comp_method=1) quantizes each GEMM input row to int8 on the fly
(:func:`quantize_rows_int8`), multiplies exactly in integers and dequantizes with
``(acc * row_scale) * channel_scale`` in fp32 — the kernels' exact operation order.

Summation order inside a 16-bit GEMM differs from the kernels', so tests compare with
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


INT8_MIN_AMAX = 1e-7  # floor of a row's absmax before quantizing (all-zero rows)


def quantize_rows_int8(x: torch.Tensor):
    """Dynamic symmetric per-row quantization of fp32 rows ``x [T, L]``:
    ``amax = max(max|x|, 1e-7)``, ``q = clamp(round_half_even(x * (127 / amax)), -127, 127)``.
    Returns ``(q, scale)`` with q as float32 integers and ``scale = amax / 127`` [T].
    The kernels store ``q + 128`` as uint8. A row holding NaN gets a NaN scale."""
    x = x.float()
    amax = x.abs().amax(-1).clamp_min(INT8_MIN_AMAX)
    # 127 / amax as one fp32 division, like the kernels' 127.0f / amax. (The Python
    # expression `127 / amax` is Tensor.__rtruediv__, i.e. reciprocal(amax) * 127: two
    # roundings, one fp32 ulp off in a quarter of the rows, which moves some q by one.)
    inv_scale = torch.full_like(amax, 127.0) / amax
    q = torch.round(x * inv_scale[:, None]).clamp(-127, 127)
    return torch.nan_to_num(q, nan=0.0), amax / 127


def int8_linear(q: torch.Tensor, row_scale: torch.Tensor, w: torch.Tensor,
                channel_scale: torch.Tensor) -> torch.Tensor:
    """``(q @ w.T)`` summed exactly (integers), then ``(acc * row_scale) * channel_scale``
    in fp32. q [T, L] integer-valued, w int8 [OC, L], scales fp32 [T] and [OC]."""
    acc = (q.double() @ w.double().t()).float()
    return (acc * row_scale[:, None]) * channel_scale.reshape(-1).float()[None, :]


def expert_mlp_int8(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> torch.Tensor:
    """One INT8 W8A8 expert on rows x [T, K] (16-bit): int8 w1 [2N, K], w2 [K, N] (unpacked)
    with per output channel scales; both GEMM inputs quantized per row. Returns fp32 [T, K]."""
    q, s = quantize_rows_int8(x.float())
    h = int8_linear(q, s, w1, w1_scale)
    if b1 is not None:
        h = h + b1.float()
    a = swiglu_clamp(h, alpha, limit) if alpha is not None else silu_and_mul(h)
    a = a.to(x.dtype).float()
    q2, s2 = quantize_rows_int8(a)
    y = int8_linear(q2, s2, w2, w2_scale)
    if b2 is not None:
        y = y + b2.float()
    return y


def dequantize_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, block_n: int,
                          block_k: int) -> torch.Tensor:
    """FP8 W8A16 weights as the kernels use them: ``w`` float8_e4m3fn [..., OC, IC] decoded
    exactly (torch's conversion; zero and subnormals included) times its block's scale
    ``scale [..., ceil(OC/block_n), ceil(IC/block_k)]`` (multiplied, DeepSeek's
    ``weight_scale_inv``), rounded once to fp32."""
    oc, ic = w.shape[-2:]
    s = scale.float().repeat_interleave(block_n, -2)[..., :oc, :]
    s = s.repeat_interleave(block_k, -1)[..., :ic]
    return w.float() * s


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
    moe_comp_method: int = 0,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_size: Optional[list] = None,
) -> torch.Tensor:
    """Reference of `fused_experts_cpu` with unpacked weights.

    hidden_states [M, K] bf16/fp16; w1 [E, 2N, K]; w2 [E, K, N] (16-bit for method 0,
    int8 with per output channel scales w1_scale [E, 2N(, 1)], w2_scale [E, K(, 1)] for
    method 1; float8_e4m3fn with block scales and ``block_size=[block_n, block_k]`` for
    method 2); topk_weights and topk_ids [M, topk]; an id of -1 skips its slot.
    Returns [M, K] in the dtype of hidden_states.
    """
    if moe_comp_method == 2:  # FP8: fp32 GEMMs on the dequantized weights
        w1 = dequantize_fp8_blocks(w1, w1_scale, *block_size)
        w2 = dequantize_fp8_blocks(w2, w2_scale, *block_size)
        moe_comp_method = 0
    M, K = hidden_states.shape
    out = torch.zeros(M, K, dtype=torch.float32)
    ids = topk_ids.long()
    weights = topk_weights.float()
    for e in ids.unique().tolist():
        if e < 0:
            continue
        rows, slots = (ids == e).nonzero(as_tuple=True)
        b1 = None if w1_bias is None else w1_bias[e]
        b2 = None if w2_bias is None else w2_bias[e]
        if moe_comp_method == 1:
            y = expert_mlp_int8(hidden_states[rows], w1[e], w1_scale[e], w2[e], w2_scale[e],
                                b1, b2, alpha, limit)
        else:
            y = expert_mlp(hidden_states[rows], w1[e], w2[e], b1, b2, alpha, limit)
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
    use_int8_w8a8: bool = False,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    use_fp8_w8a16: bool = False,
    block_size: Optional[list] = None,
) -> torch.Tensor:
    """Reference of `shared_expert_cpu` with unpacked weights w1 [2N, K], w2 [K, N]
    (16-bit, or int8 with scales [2N(, 1)], [K(, 1)]):
    mlp(x) + routed_scaling_factor * fused_experts_out, in float32, rounded once."""
    if use_int8_w8a8:
        y = expert_mlp_int8(hidden_states, w1, w1_scale, w2, w2_scale)
    elif use_fp8_w8a16:
        y = expert_mlp(hidden_states, dequantize_fp8_blocks(w1, w1_scale, *block_size),
                       dequantize_fp8_blocks(w2, w2_scale, *block_size))
    else:
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


def pack_vnni4_int8(weight: torch.Tensor) -> torch.Tensor:
    """Reference of `convert_weight_packed` for int8 [..., OC, IC] -> [..., OC, IC + 4]: blocks
    of 32 rows, each 32*IC bytes stored [IC/4][32][4], then int32 comp[32] = 128 * row sums
    (docs/FORMATS.md)."""
    *lead, oc, ic = weight.shape
    w = weight.reshape(-1, oc // 32, 32, ic)
    body = w.reshape(w.shape[0], oc // 32, 32, ic // 4, 4).permute(0, 1, 3, 2, 4)
    body = body.reshape(w.shape[0], oc // 32, 32 * ic)
    comp = (128 * w.to(torch.int32).sum(-1)).to(torch.int32)  # [B, blocks, 32]
    comp_bytes = comp.contiguous().view(torch.int8).reshape(w.shape[0], oc // 32, 128)
    return torch.cat([body, comp_bytes], dim=-1).reshape(*lead, oc, ic + 4)
