"""Quantization helpers: turn float expert weights into each scheme's tensors.

They produce what a quantized checkpoint would hold (unpacked); pass the weights
through :func:`cpumoe.convert_weight_packed` once, then call the ops with
``is_vnni=True``.
"""

from __future__ import annotations

import torch


def quantize_int8_per_channel(weight: torch.Tensor):
    """Symmetric per output channel int8 quantization for INT8 W8A8.

    ``weight [..., OC, IC]`` (any float dtype) -> ``(q int8 [..., OC, IC], scale fp32
    [..., OC, 1])`` with ``scale = max|row| / 127`` (1e-10 for an all-zero row) and
    ``q = round(weight / scale)`` clamped to [-127, 127], so ``q * scale ~= weight``.
    The scale shape is what SGLang's INT8 layers pass as ``w13_weight_scale``.
    """
    w = weight.float()
    scale = (w.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-10)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


FP8_E4M3_MAX = 448.0


def quantize_fp8_blockwise(weight: torch.Tensor, block_size=(128, 128)):
    """Block-wise FP8 (e4m3fn) quantization for FP8 W8A16, DeepSeek-V3 style.

    ``weight [..., OC, IC]`` -> ``(q float8_e4m3fn [..., OC, IC], scale fp32
    [..., ceil(OC/block_n), ceil(IC/block_k)])`` with ``scale = max|block| / 448`` and
    ``q = fp8(weight / scale)``, so ``q * scale ~= weight`` (the scale is multiplied, like
    DeepSeek's ``weight_scale_inv``). Partial blocks at the edges are allowed.
    """
    block_n, block_k = block_size
    w = weight.float()
    oc, ic = w.shape[-2:]
    nb, kb = -(-oc // block_n), -(-ic // block_k)
    pad = torch.zeros(*w.shape[:-2], nb * block_n, kb * block_k)
    pad[..., :oc, :ic] = w
    blocks = pad.reshape(*w.shape[:-2], nb, block_n, kb, block_k)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_E4M3_MAX).clamp_min(1e-12)
    full = scale.repeat_interleave(block_n, -2).repeat_interleave(block_k, -1)[..., :oc, :ic]
    q = (w / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


INT4_AWQ, INT4_GPTQ = 0, 1
# AWQ stores the 8 output columns of an int32 word in nibble order 0,2,4,6,1,3,5,7:
# column j lives in nibble AWQ_NIBBLE_OF_COLUMN[j].
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


def _pack_nibbles(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int tensor of 0..15 -> int32 words of 8 nibbles along `dim` (element j of each 8 in
    nibble order[j])."""
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    shifts = torch.tensor([4 * n for n in order], dtype=torch.int64)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, fmt: str = "awq",
                  scales_dtype: torch.dtype = torch.float16):
    """Asymmetric 4-bit group quantization for INT4 W4A8, in AWQ or GPTQ checkpoint format.

    ``weight [..., OC, IC]`` (float) is cut into groups of ``group_size`` input features
    per output channel; each group gets ``scale = (max - min) / 15`` and an integer
    ``zero`` with ``w ~= (q - zero) * scale``, ``q`` in 0..15. Returns
    ``(qweight, qzeros, scales)`` as a checkpoint stores them:

    * ``fmt="awq"``: ``qweight`` int32 ``[..., IC, OC/8]`` (columns in AWQ's nibble order),
      ``qzeros`` int32 ``[..., G, OC/8]``, ``scales [..., G, OC]``;
    * ``fmt="gptq"``: ``qweight`` int32 ``[..., IC/8, OC]`` (8 consecutive input features
      per word), ``qzeros`` int32 ``[..., G, OC/8]`` holding ``zero - 1`` (GPTQ v1), so zero
      points are kept in 1..15; ``scales [..., G, OC]``.

    Feed them to :func:`cpumoe.convert_weight_packed_scale_zp` (0 for AWQ, 1 for GPTQ).
    Act-order (``g_idx``) checkpoints are not covered.
    """
    if fmt not in ("awq", "gptq"):
        raise ValueError(f"fmt must be 'awq' or 'gptq', got {fmt!r}")
    w = weight.float()
    *lead, oc, ic = w.shape
    if ic % group_size or oc % 8 or (fmt == "gptq" and ic % 8):
        raise ValueError(f"weight [{oc}, {ic}]: IC must be a multiple of group_size "
                         f"{group_size} (and of 8 for gptq), OC a multiple of 8")
    groups = w.reshape(*lead, oc, ic // group_size, group_size)
    lo = groups.amin(-1).clamp(max=0.0)
    hi = groups.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(scales_dtype).float()
    zero_min = 1 if fmt == "gptq" else 0
    zero = torch.round(-lo / scale).clamp(zero_min, 15)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15)
    q = q.reshape(*lead, oc, ic).to(torch.int32)
    zero = zero.to(torch.int32)  # [..., OC, G]
    scales = scale.transpose(-1, -2).contiguous().to(scales_dtype)  # [..., G, OC]
    zeros_gn = zero.transpose(-1, -2)  # [..., G, OC]
    q_kn = q.transpose(-1, -2)  # [..., IC, OC]
    if fmt == "awq":
        qweight = _pack_nibbles(q_kn, -1, AWQ_NIBBLE_OF_COLUMN)
        qzeros = _pack_nibbles(zeros_gn, -1, AWQ_NIBBLE_OF_COLUMN)
    else:
        qweight = _pack_nibbles(q_kn, -2)
        qzeros = _pack_nibbles(zeros_gn - 1, -1)
    return qweight.contiguous(), qzeros.contiguous(), scales


MXFP4_GROUP = 32  # input features per e8m0 scale
E2M1_MAX = 6.0
# The e2m1 magnitudes of codes 0..7 and the midpoints between neighbours
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_mxfp4(weight: torch.Tensor):
    """MXFP4 quantization (OCP MX fp4, gpt-oss's expert weights) for ``moe_comp_method=4``.

    ``weight [..., OC, IC]`` (finite floats, ``IC % 32 == 0``) is cut into groups of 32
    consecutive input features per output channel. Each group gets the e8m0 scale
    ``s = 127 + ceil(log2(amax / 6))`` (clamped to 0..254; an all-zero group gets 0), the
    choice of SGLang's test utility and NVIDIA modelopt's MXFP4 quantizer: the smallest
    power of two that brings the group's largest magnitude to at most 6, e2m1's largest.
    Each weight becomes the e2m1 code nearest to ``w / 2^(s - 127)`` (magnitudes 0, 0.5,
    1, 1.5, 2, 3, 4, 6; ties to the code with mantissa bit 0, as IEEE rounding does; bit 3
    the sign; magnitude 0 is code 0), so ``e2m1(code) * 2^(s - 127) ~= w``.
    (modelopt rounds ties toward zero and gives exact zeros code 8, -0; both decode alike.)

    Returns ``(codes uint8 [..., OC, IC/2], scales uint8 [..., OC, IC/32])`` as a checkpoint
    stores them: the code of input feature 2i in the low nibble of byte i, 2i + 1 in the
    high nibble. Pack them with :func:`cpumoe.convert_weight_packed` and
    :func:`cpumoe.convert_scale_packed`; :func:`cpumoe.reference.dequantize_mxfp4` decodes
    them.
    """
    w = weight.float()
    *lead, oc, ic = w.shape
    if ic % MXFP4_GROUP:
        raise ValueError(f"weight [..., {oc}, {ic}]: IC must be a multiple of {MXFP4_GROUP}")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_mxfp4: weight holds inf or NaN")
    groups = w.reshape(*lead, oc, ic // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)  # log2(0) = -inf
    y = groups / torch.exp2(exponent)  # exact: a power of two, |y| <= 6
    mag = y.abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS)
    index = (mag.unsqueeze(-1) > midpoints).sum(-1)  # ties counted down ...
    tie = mag == midpoints[index.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    index = index + (tie & (index % 2 == 1)).long()  # ... and moved to the even code
    codes = torch.where(index == 0, index, index | ((y < 0).long() << 3)).to(torch.uint8)
    codes = codes.reshape(*lead, oc, ic)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()
