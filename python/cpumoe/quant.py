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
