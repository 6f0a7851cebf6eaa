"""Pure-torch reference of every cpumoe op: the executable specification.

Readable first, fast never. Each function takes the same arguments as the op it
describes, with unpacked weights, and reproduces its rounding points:

* GEMMs in float32 (products of 16-bit values are exact in fp32);
* the activation output rounded to the activation dtype (as a bf16/fp16 model
  stores it before the down projection);
* the topk weight applied after w2 (and after its bias), in float32;
* the sum over the topk slots, and any residual, in float32, rounded once.

The dense linear ops (``weight_packed_linear`` ...) are the first GEMM of an expert on all
rows, plus bias, with one rounding.

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


def gelu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """`[gate; up]` halves along the last dim: gelu(gate) * up, gelu in its erf form
    x * Phi(x) (not the tanh approximation)."""
    n = h.shape[-1] // 2
    return F.gelu(h[..., :n]) * h[..., n:]


def swiglu_clamp(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS activation: gate = h[..., 0::2], up = h[..., 1::2] (interleaved rows);
    gate is clamped above at `limit`, up to [-limit, limit];
    out = gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def silu_clamp(h: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4 activation: `[gate; up]` halves along the last dim (not interleaved);
    gate is clamped above at `limit`, up to [-limit, limit]; out = silu(gate) * up. No
    alpha. ``limit`` must be >= 0 (+inf clamps nothing); a NaN gate or up stays NaN, as
    torch.clamp passes NaN on."""
    n = h.shape[-1] // 2
    gate = h[..., :n].clamp(max=limit)
    up = h[..., n:].clamp(min=-limit, max=limit)
    return F.silu(gate) * up


# the values of fused_experts_cpu's `activation` (None is "silu")
ACTIVATIONS = ("silu", "gelu")


def activate(h: torch.Tensor, alpha: Optional[float] = None, limit: Optional[float] = None,
             activation: Optional[str] = None) -> torch.Tensor:
    """The activation of the first GEMM's output h [T, 2N] -> [T, N]: GPT-OSS's clamped
    SwiGLU when ``alpha`` and ``limit`` are given, DeepSeek-V4's clamped SiLU·mul when only
    ``limit`` is, else ``activation`` ("silu" or "gelu") of the gate half times the up
    half. The clamped ones replace the activation: ``activation`` must then be None or
    "silu"."""
    if activation not in (None,) + ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    if alpha is not None and limit is None:
        raise ValueError("alpha needs limit")
    if limit is not None and activation == "gelu":
        raise ValueError("limit selects a clamped activation; activation must be None or silu")
    if alpha is not None:
        return swiglu_clamp(h, alpha, limit)
    if limit is not None:
        if not limit >= 0:
            raise ValueError(f"limit must be >= 0 (not NaN), got {limit}")
        return silu_clamp(h, limit)
    return gelu_and_mul(h) if activation == "gelu" else silu_and_mul(h)


def expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """One expert on rows x [T, K] (16-bit): returns y [T, K] in float32, before the
    topk weight. w1 [2N, K], w2 [K, N] unpacked, same dtype as x."""
    h = x.float() @ w1.float().t()
    if b1 is not None:
        h = h + b1.float()
    a = activate(h, alpha, limit, activation)
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
    activation: Optional[str] = None,
) -> torch.Tensor:
    """One INT8 W8A8 expert on rows x [T, K] (16-bit): int8 w1 [2N, K], w2 [K, N] (unpacked)
    with per output channel scales; both GEMM inputs quantized per row. Returns fp32 [T, K]."""
    return _row_quantized_expert(x, lambda q, s: int8_linear(q, s, w1, w1_scale),
                                 lambda q, s: int8_linear(q, s, w2, w2_scale), b1, b2, alpha,
                                 limit, activation)


def _row_quantized_expert(x, linear1, linear2, b1, b2, alpha, limit,
                          activation=None) -> torch.Tensor:
    """The expert MLP of the schemes with int8 activations (INT8 W8A8, INT4 W4A8): each GEMM
    input row quantized (quantize_rows_int8), then linear(q, row_scale) -> fp32."""
    q, s = quantize_rows_int8(x.float())
    h = linear1(q, s)
    if b1 is not None:
        h = h + b1.float()
    a = activate(h, alpha, limit, activation)
    a = a.to(x.dtype).float()
    q2, s2 = quantize_rows_int8(a)
    y = linear2(q2, s2)
    if b2 is not None:
        y = y + b2.float()
    return y


def dequantize_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, block_n: int,
                          block_k: int) -> torch.Tensor:
    """FP8 W8A16 weights as they are meant: ``w`` float8_e4m3fn [..., OC, IC] decoded
    exactly (torch's conversion; zero and subnormals included) times its block's scale
    ``scale [..., ceil(OC/block_n), ceil(IC/block_k)]`` (multiplied, DeepSeek's
    ``weight_scale_inv``), rounded once to fp32. (The kernels apply the scale to each K
    block's fp32 sum instead of to each weight; tests/exact_reference.py fp8_block_linear
    is that exact order.)"""
    oc, ic = w.shape[-2:]
    s = scale.float().repeat_interleave(block_n, -2)[..., :oc, :]
    s = s.repeat_interleave(block_k, -1)[..., :ic]
    return w.float() * s


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0)  # codes 0..15; both zero codes are +0, as the kernels decode them


def mxfp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., IC/2]`` (two e2m1 codes a byte) -> int64 ``[..., IC]`` codes 0..15: input
    feature 2i is the low nibble of byte i, 2i + 1 the high nibble."""
    b = codes.to(torch.int64)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights as they are meant: uint8 codes ``[..., OC, IC/2]`` and e8m0 scales
    ``uint8 [..., OC, IC/32]`` (unpacked, as :func:`cpumoe.quant.quantize_mxfp4` returns
    them) -> fp32 ``[..., OC, IC]``, each weight ``e2m1(code) * 2^(scale - 127)``, computed
    exactly (float64) and then rounded to fp32: exact wherever the value is below 2^128
    (every such value is a bf16 number too, scales 0 and 1 giving denormals), +-inf beyond;
    both zero codes give +0 and any scale, 255 included, is a power of two (docs/MATH.md)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[mxfp4_codes(codes)]
    scale = torch.exp2(scales.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return (values * scale).float()


def pack_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    """Reference of `convert_weight_packed` for MXFP4 codes uint8 ``[..., OC, IC/2]``: blocks
    of 32 rows, each ``[IC/2][32]`` bytes; byte j of block column c holds in its low nibble
    the nibble j % 2 of row j // 2's byte c, in its high nibble that of row 16 + j // 2
    (docs/FORMATS.md)."""
    *lead, oc, cols = codes.shape
    b = codes.reshape(-1, oc // 32, 32, cols).to(torch.int64)  # [B, blocks, 32 rows, cols]
    nibbles = torch.stack([b & 15, b >> 4], dim=-1)  # [B, blocks, 32, cols, 2]
    low = nibbles[:, :, :16].permute(0, 1, 3, 2, 4)  # [B, blocks, cols, 16 rows, 2]
    high = nibbles[:, :, 16:].permute(0, 1, 3, 2, 4)
    out = low.reshape(*low.shape[:3], 32) | (high.reshape(*high.shape[:3], 32) << 4)
    return out.to(torch.uint8).reshape(*lead, oc, cols)


def pack_e8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """Reference of `convert_scale_packed`: ``[..., OC, G]`` -> the same shape, blocks of 32
    rows stored ``[G][32]``: packed[b][g][n] = scales[32 b + n][g]."""
    *lead, oc, groups = scales.shape
    s = scales.reshape(-1, oc // 32, 32, groups).transpose(-1, -2)
    return s.contiguous().reshape(*lead, oc, groups)


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor,
                   block_size: Optional[list]) -> torch.Tensor:
    """:func:`dequantize_fp8_blocks` with ``block_size = [block_n, block_k]``; with None,
    per-tensor scales: one per matrix, ``scale`` shaped ``w.shape[:-2]`` (or with two
    trailing ones)."""
    if block_size is None:
        return w.float() * scale.float().reshape(*w.shape[:-2], 1, 1)
    return dequantize_fp8_blocks(w, scale, *block_size)


def unpack_int4_checkpoint(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                           quant_method_4bit: int):
    """AWQ (0) or GPTQ (1) checkpoint tensors (see :func:`cpumoe.quant.quantize_int4`) ->
    ``(w, zero, scale)``: nibbles ``w`` int32 ``[..., OC, IC]`` in 0..15, zero points int32
    ``[..., OC, G]`` (GPTQ's stored ``zero - 1`` plus one) and scales fp32 ``[..., OC, G]``;
    the real weight is ``(w - zero) * scale`` of the element's group."""
    from .quant import AWQ_NIBBLE_OF_COLUMN

    def nibbles(words: torch.Tensor, dim: int, order) -> torch.Tensor:
        shifts = torch.tensor([4 * n for n in order], dtype=torch.int64)
        v = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 15  # [..., words, 8] last
        v = v.movedim(dim - 1 if dim < 0 else dim, -2)
        return v.reshape(*v.shape[:-2], -1).movedim(-1, dim)

    if quant_method_4bit == 0:
        w = nibbles(qweight, -1, AWQ_NIBBLE_OF_COLUMN)  # [..., IC, OC]
        zero = nibbles(qzeros, -1, AWQ_NIBBLE_OF_COLUMN)  # [..., G, OC]
    else:
        w = nibbles(qweight, -2, range(8))  # [..., IC, OC]
        zero = nibbles(qzeros, -1, range(8)) + 1
    return (w.transpose(-1, -2).to(torch.int32), zero.transpose(-1, -2).to(torch.int32),
            scales.float().transpose(-1, -2))


def int4_block_k(group: int) -> int:
    """k per packed INT4 block: min(group, 128)."""
    return min(group, 128)


def pack_int4(w: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor):
    """Reference of `convert_weight_packed_scale_zp` after unpacking (docs/FORMATS.md):
    ``w [..., OC, IC]`` nibbles, ``zero``/``scale [..., OC, G]`` -> ``(packed uint8
    [..., OC/32, IC/bk, 16*bk + 128], zeros int8 [..., OC/32, G, 32], scales fp32
    [..., OC/32, G, 32])``. Per block of 32 columns x bk k: byte ``kk*64 + 4*l + b`` holds
    k = 4kk+b of column c(l) in its low nibble and of column c(l)+8 in its high nibble
    (c(l) = l for l < 8, l + 8 after); then int32 comp[32] = sum over the block of
    (w - zero)."""
    *lead, oc, ic = w.shape
    groups = zero.shape[-1]
    group = ic // groups
    bk = int4_block_k(group)
    wb = w.reshape(-1, oc // 32, 32, ic // bk, bk).to(torch.int32)  # [B, tiles, 32, kb, bk]
    lane_cols = torch.tensor([c if c < 8 else c + 8 for c in range(16)])
    low = wb[:, :, lane_cols]  # [B, tiles, 16, kb, bk]
    high = wb[:, :, lane_cols + 8]
    byte = (low | (high << 4)).to(torch.uint8)
    # -> [B, tiles, kb, bk/4, 16 lanes, 4]
    byte = byte.reshape(*byte.shape[:4], bk // 4, 4).permute(0, 1, 3, 4, 2, 5)
    body = byte.reshape(*byte.shape[:3], 16 * bk)
    zero_k = zero.reshape(-1, oc // 32, 32, groups).repeat_interleave(group, -1)
    comp = (wb - zero_k.reshape(wb.shape)).sum(-1)  # [B, tiles, 32, kb]
    comp_bytes = comp.permute(0, 1, 3, 2).contiguous().to(torch.int32).view(torch.uint8)
    packed = torch.cat([body, comp_bytes.reshape(*body.shape[:3], 128)], dim=-1)
    tiles = lambda t: t.reshape(-1, oc // 32, 32, groups).transpose(-1, -2).contiguous()  # noqa: E731
    return (packed.reshape(*lead, oc // 32, ic // bk, 16 * bk + 128),
            tiles(zero).to(torch.int8).reshape(*lead, oc // 32, groups, 32),
            tiles(scale).float().reshape(*lead, oc // 32, groups, 32))


def dequantize_int4(w: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(w - zero) * scale`` in fp32 for ``w [..., OC, IC]``, ``zero``/``scale [..., OC, G]``."""
    group = w.shape[-1] // zero.shape[-1]
    return (w - zero.repeat_interleave(group, -1)).float() * scale.repeat_interleave(group, -1)


def fmaf(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """C's fmaf on fp32 tensors (broadcasting), exactly: a*b is exact in float64 (24 + 24
    bits), the sum p + c is rounded to float64 (s) with its exact error e (TwoSum), and s
    is rounded to fp32. That double rounding can only go wrong when s lands exactly on a
    midpoint between two fp32 values while e != 0; then the true sum lies on e's side."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    e = (p - (s - bb)) + (cd - bb)
    f = s.float()
    fd = f.double()
    inf = torch.full_like(f, float("inf"))
    toward = torch.where(fd < s, inf, -inf)
    other = torch.nextafter(f, toward)
    od = other.double()
    tie = (fd != s) & (fd + od == 2 * s)
    return torch.where(tie & ((od - fd) * e > 0), other, f)


def int4_linear(q: torch.Tensor, row_scale: torch.Tensor, w: torch.Tensor, zero: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    """INT4 W4A8 GEMM in the kernels' order: per block of bk = min(group, 128) k, the exact
    integer sum ``t = q[:, blk] @ (w - zero)[:, blk].T``, folded as ``c = fmaf(t, scale, c)``
    in fp32 (:func:`fmaf`, exact); finally ``c * row_scale``.
    q [T, L] integer-valued (quantize_rows_int8), w/zero/scale as :func:`dequantize_int4`."""
    oc, ic = w.shape
    group = ic // zero.shape[-1]
    bk = int4_block_k(group)
    wz = (w - zero.repeat_interleave(group, -1)).double()
    c = torch.zeros(q.shape[0], oc, dtype=torch.float32)
    for k0 in range(0, ic, bk):
        t = (q[:, k0:k0 + bk].double() @ wz[:, k0:k0 + bk].t()).float()
        s = scale[:, k0 // group].float()
        c = fmaf(t, s[None, :], c)
    return c * row_scale[:, None]


def expert_mlp_int4(x, w1, z1, s1, w2, z2, s2, b1=None, b2=None, alpha=None, limit=None,
                    activation=None):
    """One INT4 W4A8 expert on rows x [T, K] (16-bit): nibbles w1 [2N, K], w2 [K, N] with
    zero points and scales [.., G] (as :func:`unpack_int4_checkpoint` gives them); both
    GEMM inputs quantized per row like INT8. Returns fp32 [T, K]."""
    return _row_quantized_expert(x, lambda q, s: int4_linear(q, s, w1, z1, s1),
                                 lambda q, s: int4_linear(q, s, w2, z2, s2), b1, b2, alpha,
                                 limit, activation)


# Each takes the activation as `act` = (alpha, limit, activation), activate()'s arguments.
def _expert_unquant(x, e, w, b1, b2, act):
    return expert_mlp(x, w["w1"][e], w["w2"][e], b1, b2, *act)


def _expert_int8(x, e, w, b1, b2, act):
    return expert_mlp_int8(x, w["w1"][e], w["w1_scale"][e], w["w2"][e], w["w2_scale"][e], b1,
                           b2, *act)


def _expert_fp8(x, e, w, b1, b2, act):
    """fp32 GEMMs on the dequantized weights (decoding e4m3 is exact)."""
    w1 = dequantize_fp8(w["w1"][e], w["w1_scale"][e], w["block_size"])
    w2 = dequantize_fp8(w["w2"][e], w["w2_scale"][e], w["block_size"])
    return expert_mlp(x, w1, w2, b1, b2, *act)


def _expert_int4(x, e, w, b1, b2, act):
    return expert_mlp_int4(x, w["w1"][e], w["w1_zero"][e], w["w1_scale"][e], w["w2"][e],
                           w["w2_zero"][e], w["w2_scale"][e], b1, b2, *act)


def _expert_mxfp4(x, e, w, b1, b2, act):
    """fp32 GEMMs on the decoded weights (decoding MXFP4 is exact)."""
    return expert_mlp(x, dequantize_mxfp4(w["w1"][e], w["w1_scale"][e]),
                      dequantize_mxfp4(w["w2"][e], w["w2_scale"][e]), b1, b2, *act)


# moe_comp_method -> one expert's MLP on the rows routed to it: the only place the
# reference tells schemes apart.
_SCHEME_EXPERTS = {0: _expert_unquant, 1: _expert_int8, 2: _expert_fp8, 3: _expert_int4,
                   4: _expert_mxfp4}


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
    w1_zero: Optional[torch.Tensor] = None,
    w2_zero: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Reference of `fused_experts_cpu` with unpacked weights.

    hidden_states [M, K] bf16/fp16; w1 [E, 2N, K]; w2 [E, K, N] (16-bit for method 0,
    int8 with per output channel scales w1_scale [E, 2N(, 1)], w2_scale [E, K(, 1)] for
    method 1; float8_e4m3fn with block scales and ``block_size=[block_n, block_k]``, or
    per-tensor scales [E] and ``block_size=None``, for method 2; 4-bit nibbles with zero
    points ``w*_zero`` and scales ``w*_scale`` of shape [E, OC, G], as
    :func:`unpack_int4_checkpoint` returns them, for method 3; uint8 e2m1 codes w1 [E, 2N,
    K/2], w2 [E, K, N/2] with unpacked e8m0 scales w1_scale [E, 2N, K/32], w2_scale [E, K,
    N/32], as :func:`cpumoe.quant.quantize_mxfp4` returns them, for method 4); topk_weights
    and topk_ids [M, topk]; an id of -1 skips its slot. The activation: :func:`activate`.
    Returns [M, K] in the dtype of hidden_states: :func:`fused_experts_fp32` rounded once.
    """
    return fused_experts_fp32(hidden_states, w1, w2, topk_weights, topk_ids, w1_bias, w2_bias,
                              alpha, limit, moe_comp_method, w1_scale, w2_scale, block_size,
                              w1_zero, w2_zero, activation).to(hidden_states.dtype)


def fused_experts_fp32(
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
    w1_zero: Optional[torch.Tensor] = None,
    w2_zero: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Reference of `fused_experts_fp32_cpu`: :func:`fused_experts` before its one rounding,
    the float32 [M, K] sum over the slots (here summed per expert, in torch's order).
    Arguments as :func:`fused_experts`."""
    if moe_comp_method not in _SCHEME_EXPERTS:
        raise ValueError(f"unknown moe_comp_method {moe_comp_method}")
    expert = _SCHEME_EXPERTS[moe_comp_method]
    w = dict(w1=w1, w2=w2, w1_scale=w1_scale, w2_scale=w2_scale, w1_zero=w1_zero,
             w2_zero=w2_zero, block_size=block_size)
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
        y = expert(hidden_states[rows], e, w, b1, b2, (alpha, limit, activation))
        contrib = torch.zeros(M, ids.shape[1], K, dtype=torch.float32)
        contrib[rows, slots] = y * weights[rows, slots, None]
        out += contrib.sum(1)
    return out


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
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    use_mxfp4: bool = False,
) -> torch.Tensor:
    """Reference of `shared_expert_cpu` (both overloads) with unpacked weights w1 [2N, K],
    w2 [K, N] (16-bit, int8 with scales [2N(, 1)], [K(, 1)], fp8 with block scales, or MXFP4
    codes [2N, K/2], [K, N/2] with unpacked e8m0 scales [2N, K/32], [K, N/32]):
    mlp(x) + routed_scaling_factor * fused_experts_out, in float32, rounded once; ``alpha``
    and ``limit`` select the clamped swiglu, ``limit`` alone the clamped silu, as in
    :func:`fused_experts`."""
    if use_mxfp4:
        y = expert_mlp(hidden_states, dequantize_mxfp4(w1, w1_scale),
                       dequantize_mxfp4(w2, w2_scale), alpha=alpha, limit=limit)
    elif use_int8_w8a8:
        y = expert_mlp_int8(hidden_states, w1, w1_scale, w2, w2_scale, alpha=alpha,
                            limit=limit)
    elif use_fp8_w8a16:
        y = expert_mlp(hidden_states, dequantize_fp8(w1, w1_scale, block_size),
                       dequantize_fp8(w2, w2_scale, block_size), alpha=alpha, limit=limit)
    else:
        y = expert_mlp(hidden_states, w1, w2, alpha=alpha, limit=limit)
    if fused_experts_out is not None:
        y = y + routed_scaling_factor * fused_experts_out.float()
    return y.to(hidden_states.dtype)


# ---------------------------------------------------------------------------------------
# Dense linear ops (weight_packed_linear, int8_scaled_mm_with_quant, fp8_scaled_mm_cpu,
# int4_scaled_mm_cpu): the first GEMM of an expert (as in fused_experts) on all rows of x,
# then ``+ bias`` in float32 and one rounding to x's dtype. Weights unpacked, [N, K].


def _linear_out(h: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
    """h [M, N] fp32 plus the fp32 bias, rounded once to the activation dtype."""
    if bias is not None:
        h = h + bias.float()[None, :]
    return h.to(dtype)


def weight_packed_linear(mat1: torch.Tensor, mat2: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of ``weight_packed_linear``: ``mat1 [M, K] @ mat2 [N, K].T`` in fp32
    (products of 16-bit values are exact), ``+ bias``, rounded to mat1's dtype."""
    return _linear_out(mat1.float() @ mat2.float().t(), bias, mat1.dtype)


def int8_scaled_mm_with_quant(mat1: torch.Tensor, mat2: torch.Tensor, scales2: torch.Tensor,
                              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of ``int8_scaled_mm_with_quant``: rows of mat1 quantized
    (:func:`quantize_rows_int8`), the exact integer GEMM with int8 ``mat2 [N, K]`` dequantized
    by :func:`int8_linear` (the kernels' order: bit-exact), ``+ bias``, rounded."""
    q, s = quantize_rows_int8(mat1.float())
    return _linear_out(int8_linear(q, s, mat2, scales2), bias, mat1.dtype)


def fp8_scaled_mm(mat1: torch.Tensor, mat2: torch.Tensor, scales2: torch.Tensor,
                  block_size: list, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of ``fp8_scaled_mm_cpu``: float8_e4m3fn ``mat2 [N, K]`` times its block
    scales (:func:`dequantize_fp8_blocks`), an fp32 GEMM, ``+ bias``, rounded."""
    w = dequantize_fp8_blocks(mat2, scales2, *block_size)
    return _linear_out(mat1.float() @ w.t(), bias, mat1.dtype)


def int4_scaled_mm(x: torch.Tensor, w: torch.Tensor, w_zeros: torch.Tensor,
                   w_scales: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of ``int4_scaled_mm_cpu`` with the unpacked weight of
    :func:`unpack_int4_checkpoint` (nibbles ``w [N, K]``, zero points and scales ``[N, G]``):
    rows of x quantized, :func:`int4_linear` (the kernels' order: bit-exact), ``+ bias``,
    rounded."""
    q, s = quantize_rows_int8(x.float())
    return _linear_out(int4_linear(q, s, w, w_zeros, w_scales), bias, x.dtype)


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


# ---------------------------------------------------------------------------------------
# Routing: the ops before the experts (topk_softmax_cpu, topk_sigmoid_cpu, grouped_topk_cpu,
# biased_grouped_topk_cpu, biased_topk_cpu, hash_topk_cpu). Every step is written in the kernels' fp32
# operation order; only the three score functions below are torch's. Swapped for the
# kernels' own (tests/exact_reference.py, kernel_gating), this reference gives their bits.


def routing_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of the softmax (the kernels: common/numeric.h cm_expf)."""
    return torch.exp(x)


def routing_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid score (the kernels: 1 / (1 + cm_expf(-x)))."""
    return torch.sigmoid(x)


def routing_sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)), DeepSeek-V4's score (the kernels: cm_sqrtsoftplusf)."""
    return torch.sqrt(F.softplus(x))


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _sum_in_order(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in index order, fp32, from +0 (the kernels' order)."""
    total = torch.zeros(t.shape[:-1], dtype=torch.float32)
    for i in range(t.shape[-1]):
        total = total + t[..., i]
    return total


def routing_scores(x: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Per expert scores of fp32 logits x [M, E]: softmax as exp(x - max) times
    (1 / sum) with the sum in expert order, sigmoid, or sqrt(softplus)."""
    if scoring_func == "softmax":
        e = routing_exp(x - x.amax(-1, keepdim=True))  # amax: NaN if the row has one
        inv = torch.ones(x.shape[0]) / _sum_in_order(e)
        return e * inv[:, None]
    if scoring_func == "sigmoid":
        return routing_sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        return routing_sqrtsoftplus(x)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


def best_first(rank: torch.Tensor) -> torch.Tensor:
    """Indices of rank [M, n] best first: higher rank first, equal ranks (and NaN, which
    ranks as -inf) by lower index."""
    rank = torch.where(torch.isnan(rank), float("-inf"), rank)
    return torch.sort(rank, dim=-1, descending=True, stable=True).indices


def route(
    gating_output: torch.Tensor,
    topk: int,
    *,
    scoring_func: str = "softmax",
    correction_bias: Optional[torch.Tensor] = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    group_score: str = "max",
    renormalize: bool = False,
    num_fused_shared_experts: int = 0,
    routed_scaling_factor: Optional[float] = None,
    scale_output: bool = False,
    num_token_non_padded: Optional[int] = None,
):
    """The routing every op runs, on logits ``gating_output [M, E]``; returns
    ``(topk_weights float32 [M, topk], topk_ids int32 [M, topk])``. Per token:

    1. scores ``s`` (:func:`routing_scores`) of the logits in fp32;
    2. ranks: the logits without a bias (the order of the exact scores), ``s + bias`` with
       one; NaN ranks as -inf, equal ranks go to the lower expert index;
    3. with ``num_expert_group`` G > 1, group g holds experts [g E/G, (g + 1) E/G) and
       scores its best rank (``group_score="max"``) or the sum of its two best
       (``"top2_sum"``; its only one for a group of one expert); the ``topk_group`` best
       groups (ties: lower index) hold the candidates;
    4. the R best candidates, best first, with weight ``s[id]``; R = topk, or topk - 1 with
       fused shared experts, whose slot is last: id ``E + m % num_fused_shared_experts``
       (m the token's row), weight (sum of the R weights in slot order) /
       ``routed_scaling_factor``;
    5. every weight times ``f / S`` with ``renormalize`` (S that sum), else times f, where
       f = ``routed_scaling_factor`` with ``scale_output``, else 1.

    Rows from ``num_token_non_padded`` on get ids -1 and weights 0.
    """
    x = gating_output.float()
    M, E = x.shape
    s = routing_scores(x, scoring_func)
    rank = x if correction_bias is None else s + correction_bias.float().reshape(1, E)
    rank = torch.where(torch.isnan(rank), float("-inf"), rank)
    order = best_first(rank)
    if num_expert_group > 1 and topk_group < num_expert_group:
        r = rank.reshape(M, num_expert_group, E // num_expert_group)
        if group_score == "max" or r.shape[-1] == 1:
            gscore = r.amax(-1)
        else:
            gscore = r.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros(M, num_expert_group, dtype=torch.int32)
        keep.scatter_(1, best_first(gscore)[:, :topk_group], 1)
        kept = keep.repeat_interleave(E // num_expert_group, dim=1)
        # kept experts first, each part in rank order (stable sorts: lexicographic)
        order = order.gather(1, best_first(kept.gather(1, order).float()))
    routed = topk - (num_fused_shared_experts > 0)
    ids = order[:, :routed]
    w = s.gather(1, ids)
    total = _sum_in_order(w)
    if num_fused_shared_experts > 0:
        shared = (torch.arange(M) % num_fused_shared_experts + E)[:, None]
        ids = torch.cat([ids, shared], dim=1)
        w = torch.cat([w, (total / _f32(routed_scaling_factor))[:, None]], dim=1)
    f = _f32(routed_scaling_factor if scale_output else 1.0)
    c = f / total if renormalize else f.expand(M)
    w = w * c[:, None]
    ids = ids.to(torch.int32)
    if num_token_non_padded is not None:
        pad = torch.arange(M) >= num_token_non_padded
        w[pad], ids[pad] = 0.0, -1
    return w, ids


def topk_softmax(hidden_states, gating_output, topk, renormalize):
    """Reference of ``topk_softmax_cpu``: softmax scores, ranked by logit."""
    assert hidden_states.shape[0] == gating_output.shape[0]
    return route(gating_output, topk, renormalize=renormalize)


def topk_sigmoid(hidden_states, gating_output, topk, renormalize):
    """Reference of ``topk_sigmoid_cpu``: sigmoid scores, ranked by logit."""
    assert hidden_states.shape[0] == gating_output.shape[0]
    return route(gating_output, topk, scoring_func="sigmoid", renormalize=renormalize)


def _non_padded(n: Optional[torch.Tensor]) -> Optional[int]:
    return None if n is None else int(n.item())


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group,
                 num_fused_shared_experts=0, routed_scaling_factor=None,
                 num_token_non_padded=None):
    """Reference of ``grouped_topk_cpu`` (DeepSeek-V2): softmax scores; groups by their best
    logit; ``routed_scaling_factor`` scales the output weights."""
    assert hidden_states.shape[0] == gating_output.shape[0]
    return route(gating_output, topk, num_expert_group=num_expert_group, topk_group=topk_group,
                 renormalize=renormalize, num_fused_shared_experts=num_fused_shared_experts,
                 routed_scaling_factor=routed_scaling_factor,
                 scale_output=routed_scaling_factor is not None,
                 num_token_non_padded=_non_padded(num_token_non_padded))


def biased_grouped_topk(hidden_states, gating_output, correction_bias, topk, renormalize,
                        num_expert_group, topk_group, num_fused_shared_experts=0,
                        routed_scaling_factor=None, num_token_non_padded=None):
    """Reference of ``biased_grouped_topk_cpu`` (DeepSeek-V3): sigmoid scores, ranked with
    the correction bias, groups by the sum of their two best; weights from the unbiased
    scores; ``routed_scaling_factor`` scales the output weights."""
    assert hidden_states.shape[0] == gating_output.shape[0]
    return route(gating_output, topk, scoring_func="sigmoid", correction_bias=correction_bias,
                 num_expert_group=num_expert_group, topk_group=topk_group,
                 group_score="top2_sum", renormalize=renormalize,
                 num_fused_shared_experts=num_fused_shared_experts,
                 routed_scaling_factor=routed_scaling_factor,
                 scale_output=routed_scaling_factor is not None,
                 num_token_non_padded=_non_padded(num_token_non_padded))


def biased_topk(hidden_states, gating_output, correction_bias, topk, renormalize, scoring_func,
                num_fused_shared_experts, routed_scaling_factor,
                apply_routed_scaling_factor_on_output):
    """Reference of ``biased_topk_cpu`` (vLLM; DeepSeek-V4): sigmoid or sqrtsoftplus scores
    ranked with the correction bias, no groups; ``routed_scaling_factor`` scales the output
    weights only with ``apply_routed_scaling_factor_on_output``."""
    assert hidden_states.shape[0] == gating_output.shape[0]
    return route(gating_output, topk, scoring_func=scoring_func, correction_bias=correction_bias,
                 renormalize=renormalize, num_fused_shared_experts=num_fused_shared_experts,
                 routed_scaling_factor=routed_scaling_factor,
                 scale_output=apply_routed_scaling_factor_on_output)


def hash_topk(gating_output, tid2eid, topk, scoring_func, num_fused_shared_experts,
              num_experts, routed_scaling_factor):
    """Reference of ``hash_topk_cpu`` (DeepSeek-V4's hash-routed layers): the routed experts
    of token m are ``tid2eid[m]`` (R = topk, or topk - 1 with a fused shared expert), not
    a top-k. Per token:

    1. scores ``s`` (:func:`routing_scores`) of the logits in fp32;
    2. slot j < R: id ``tid2eid[m, j]``, weight ``s[id]``;
    3. sigmoid and sqrtsoftplus (not softmax): with S the weights' sum in slot order, every
       weight times ``1 / S`` when S > 0;
    4. with fused shared experts, the last slot: id ``E + m % num_fused_shared_experts``,
       weight (sum of the R weights after step 3, in slot order) /
       ``routed_scaling_factor``.
    """
    x = gating_output.float()
    M, E = x.shape
    assert num_experts == E
    s = routing_scores(x, scoring_func)
    ids = tid2eid.long()
    w = s.gather(1, ids)
    if scoring_func != "softmax":
        total = _sum_in_order(w)
        one = _f32(1.0)
        c = torch.where(total > 0, one / total, one)
        w = w * c[:, None]
    if num_fused_shared_experts > 0:
        shared = (torch.arange(M) % num_fused_shared_experts + E)[:, None]
        ids = torch.cat([ids, shared], dim=1)
        shared_w = _sum_in_order(w) / _f32(routed_scaling_factor)
        w = torch.cat([w, shared_w[:, None]], dim=1)
    assert w.shape[1] == topk
    return w, ids.to(torch.int32)
