"""``import cpumoe.vllm``: the ops of vLLM's CPU MoE path, served by cpumoe.

Importing this module registers, under ``torch.ops._C`` (vLLM's namespace), the ops vLLM's
CPU MoE layers and router call, with vLLM's schemas, each forwarding to the
``torch.ops.cpumoe`` op of the same arguments (docs/SGLANG.md, "The one-line switch"):

* ``fused_experts_cpu``, vLLM's out-variant (``Tensor(a0!) out`` first, ``a1_scale`` for
  vLLM's own FP8 W8A8 MoE, which cpumoe rejects, returns nothing);
* ``convert_weight_packed``, ``convert_weight_packed_scale_zp``, and ``convert_scale_packed``
  (MXFP4 scales) when cpumoe has it;
* ``biased_topk_cpu`` and ``hash_topk_cpu`` (the routings of DeepSeek-V4 in vLLM's CPU
  router: its learned layers and its hash-routed first layers; its other routings are plain
  torch).

vLLM's CPU build registers these itself only where it is compiled for AVX512-BF16 (its
``_C.abi3.so``); its AVX2 and AVX-512 builds, or no vLLM at all, lack them, and then this
module supplies them. Which MoE path vLLM picks is vLLM's decision (it asks for AMX before
using these ops).

Precedence: vLLM's own kernels win. If vLLM is installed, its kernel library is loaded first
(through ``vllm._custom_ops``, as vLLM loads it; if vllm cannot be imported, the build vLLM
would pick for this CPU is loaded directly), since loading it after we took one of its names
would abort the process. Any op name ``torch.ops._C`` then has is left alone; one
``UserWarning`` names those. :data:`registration` records what was registered and what was
left. Importing again does nothing. In vLLM the import must run in every process that runs
the model (its workers), e.g. at the top of the script that starts vLLM or in a vLLM plugin.

Python ``torch.library`` registration rather than C++ for the reason given in
:mod:`cpumoe.sglang`; each op's kernel is the cpumoe overload itself, so a call costs one
more dispatcher call than calling cpumoe directly, and fake kernels (the same overloads) let
the ops trace under ``torch.compile``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

import torch

import cpumoe

from ._switch import Forward, defined, describe_error, register, vllm_kernel_file

NAMESPACE = "_C"

# vLLM's schemas (its csrc/cpu/torch_bindings.cpp), by op name.
SCHEMAS = {
    "fused_experts_cpu": (
        "fused_experts_cpu(Tensor(a0!) out, Tensor hidden_states, Tensor w1, Tensor w2, "
        "Tensor topk_weights, Tensor topk_ids, int moe_comp_method, Tensor? w1_scale, "
        "Tensor? w2_scale, Tensor? w1_zero, Tensor? w2_zero, Tensor? a1_scale, "
        "int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? limit, "
        "bool is_vnni) -> ()"),
    "convert_weight_packed": "convert_weight_packed(Tensor! weight) -> Tensor",
    "convert_scale_packed": "convert_scale_packed(Tensor! scale) -> Tensor",
    "convert_weight_packed_scale_zp": (
        "convert_weight_packed_scale_zp(Tensor weight, Tensor qzeros, Tensor scales, "
        "int quant_method_4bit) -> (Tensor, Tensor, Tensor)"),
    "biased_topk_cpu": (
        "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, "
        "int topk, bool renormalize, str scoring_func, int num_fused_shared_experts, "
        "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) "
        "-> (Tensor, Tensor)"),
    "hash_topk_cpu": (
        "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
        "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) "
        "-> (Tensor, Tensor)"),
}

# An op every build of vLLM's kernel library registers: its presence means the library is
# loaded.
VLLM_MARKER_OP = "rms_norm"


def forwards():
    """The ops to register, each with the cpumoe overload it forwards to."""
    ops = torch.ops.cpumoe
    targets = {
        "fused_experts_cpu": ops.fused_experts_cpu.out,
        "convert_weight_packed": ops.convert_weight_packed.default,
        "convert_weight_packed_scale_zp": ops.convert_weight_packed_scale_zp.default,
        "convert_scale_packed": ops.convert_scale_packed.default,
        "biased_topk_cpu": ops.biased_topk_cpu.default,
        "hash_topk_cpu": ops.hash_topk_cpu.default,
    }
    return [Forward(SCHEMAS[name], target) for name, target in targets.items()]


def _load_vllm_kernels() -> None:
    """Makes sure vLLM's kernel library, when vLLM is installed, is loaded before we look at
    ``torch.ops._C``."""
    if defined(NAMESPACE, VLLM_MARKER_OP):
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return
    try:
        importlib.import_module("vllm._custom_ops")  # loads the library, registers its fakes
        return
    except Exception as e:  # noqa: BLE001 - any failure: fall back to loading the library
        why = describe_error(e)
    if defined(NAMESPACE, VLLM_MARKER_OP):  # loaded before the import failed
        return
    filename = vllm_kernel_file(cpumoe.cpu_features())
    if filename is None:
        loaded = "no build of its kernel library runs on this CPU"
    else:
        path = os.path.join(os.path.dirname(spec.origin), filename)
        try:
            torch.ops.load_library(path)
            loaded = f"loaded {path} directly"
        except Exception as e:  # noqa: BLE001 - it cannot load later either
            loaded = f"loading {path} failed too ({describe_error(e)})"
    warnings.warn(f"cpumoe.vllm: vLLM is installed but importing vllm._custom_ops failed "
                  f"({why}); {loaded}", UserWarning, stacklevel=3)


_load_vllm_kernels()
registration = register(NAMESPACE, forwards(), "cpumoe.vllm")
