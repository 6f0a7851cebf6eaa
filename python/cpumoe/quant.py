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
