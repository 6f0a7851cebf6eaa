"""``import cpumoe.sglang``: SGLang's CPU MoE ops, served by cpumoe.

Importing this module registers, under ``torch.ops.sgl_kernel``, the ops SGLang's CPU MoE
path calls, with SGLang's schemas, each forwarding to the ``torch.ops.cpumoe`` op of the
same arguments (docs/SGLANG.md, "The one-line switch"):

* ``fused_experts_cpu``: SGLang's current schema (17 arguments and ``str? activation=None``)
  and ``fused_experts_cpu.no_bias``, the 13-argument one before the GPT-OSS arguments;
* ``shared_expert_cpu`` (12 arguments) and ``shared_expert_cpu.mxfp4`` (DeepSeek-V4's,
  with ``use_mxfp4``, ``alpha``, ``limit``);
* ``convert_weight_packed``, ``convert_weight_packed_scale_zp``, and ``convert_scale_packed``
  (MXFP4 scales) when cpumoe has it;
* the routing: ``topk_softmax_cpu``, ``topk_sigmoid_cpu``, ``grouped_topk_cpu``,
  ``biased_grouped_topk_cpu``, and ``hash_topk_cpu`` (DeepSeek-V4's hash-routed layers);
* the dense linear ops a model's other layers call on the same packed weights:
  ``weight_packed_linear``, ``int8_scaled_mm_with_quant``, ``fp8_scaled_mm_cpu``,
  ``int4_scaled_mm_cpu``.

Precedence: SGLang's own kernels win. If the ``sgl_kernel`` package is installed it is
imported first (so its library is loaded before ours could take a name it defines, which
would abort the process when it loads later), and any op name ``torch.ops.sgl_kernel``
already has is left alone; one ``UserWarning`` names those. :data:`registration` records
what was registered and what was left. Importing again does nothing.

Why Python's ``torch.library`` and not a C++ ``TORCH_LIBRARY_FRAGMENT(sgl_kernel, ...)`` in
cpumoe's extension: the C++ block runs whenever the extension loads, unconditionally, so
``import cpumoe`` alone would claim SGLang's names and abort any process that loads the real
library afterwards; the choice per op, at the user's request, needs code that runs after
looking. The cost stays one dispatcher call more than calling cpumoe directly: the kernel
registered for each op is the ``torch.ops.cpumoe`` overload object itself (same arguments
in the same order), so no Python function body runs per call.

Fake kernels are registered too (the same cpumoe overloads, which run cpumoe's fake
kernels), so the ops trace under ``torch.compile``. SGLang's CPU graph runner registers its
own fakes for ``fused_experts_cpu``, ``shared_expert_cpu`` and the four routing ops; torch
builds whose ``register_fake`` refuses to replace a fake get none from us for those ops'
default overloads, so that SGLang's registration still succeeds there.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

import torch

import cpumoe  # noqa: F401  (registers torch.ops.cpumoe.*)

from ._switch import Forward, describe_error, register

NAMESPACE = "sgl_kernel"

# SGLang's schemas (its sgl-kernel/csrc/cpu/torch_extension_cpu.cpp), by op name.
SCHEMAS = {
    "fused_experts_cpu": (
        "fused_experts_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
        "Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, "
        "Tensor? w2_scale, Tensor? w1_zero, Tensor? w2_zero, int[]? block_size, "
        "Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? limit, bool is_vnni, "
        "str? activation=None) -> Tensor"),
    "fused_experts_cpu.no_bias": (
        "fused_experts_cpu.no_bias(Tensor hidden_states, Tensor w1, Tensor w2, "
        "Tensor topk_weights, Tensor topk_ids, bool inplace, int moe_comp_method, "
        "Tensor? w1_scale, Tensor? w2_scale, Tensor? w1_zero, Tensor? w2_zero, "
        "int[]? block_size, bool is_vnni) -> Tensor"),
    "shared_expert_cpu": (
        "shared_expert_cpu(Tensor hidden_states, Tensor w1, Tensor w2, "
        "Tensor? fused_experts_out, float? routed_scaling_factor, bool inplace, "
        "bool use_int8_w8a8, bool use_fp8_w8a16, Tensor? w1_scale, Tensor? w2_scale, "
        "int[]? block_size, bool is_vnni) -> Tensor"),
    "shared_expert_cpu.mxfp4": (
        "shared_expert_cpu.mxfp4(Tensor hidden_states, Tensor w1, Tensor w2, "
        "Tensor? fused_experts_out, float? routed_scaling_factor, bool inplace, "
        "bool use_int8_w8a8, bool use_fp8_w8a16, bool use_mxfp4, Tensor? w1_scale, "
        "Tensor? w2_scale, int[]? block_size, float? alpha, float? limit, "
        "bool is_vnni) -> Tensor"),
    "convert_weight_packed": "convert_weight_packed(Tensor weight) -> Tensor",
    "convert_weight_packed_scale_zp": (
        "convert_weight_packed_scale_zp(Tensor weight, Tensor qzeros, Tensor scales, "
        "int quant_method_4bit) -> (Tensor, Tensor, Tensor)"),
    "convert_scale_packed": "convert_scale_packed(Tensor scale) -> Tensor",
    "topk_softmax_cpu": (
        "topk_softmax_cpu(Tensor hidden_states, Tensor gating_output, int topk, "
        "bool renormalize) -> (Tensor, Tensor)"),
    "topk_sigmoid_cpu": (
        "topk_sigmoid_cpu(Tensor hidden_states, Tensor gating_output, int topk, "
        "bool renormalize) -> (Tensor, Tensor)"),
    "grouped_topk_cpu": (
        "grouped_topk_cpu(Tensor hidden_states, Tensor gating_output, int topk, "
        "bool renormalize, int num_expert_group, int topk_group, "
        "int num_fused_shared_experts, float? routed_scaling_factor, "
        "Tensor? num_token_non_padded) -> (Tensor, Tensor)"),
    "biased_grouped_topk_cpu": (
        "biased_grouped_topk_cpu(Tensor hidden_states, Tensor gating_output, "
        "Tensor correction_bias, int topk, bool renormalize, int num_expert_group, "
        "int topk_group, int num_fused_shared_experts, float? routed_scaling_factor, "
        "Tensor? num_token_non_padded) -> (Tensor, Tensor)"),
    "hash_topk_cpu": (
        "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
        "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) "
        "-> (Tensor, Tensor)"),
    "weight_packed_linear": (
        "weight_packed_linear(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni) -> Tensor"),
    "int8_scaled_mm_with_quant": (
        "int8_scaled_mm_with_quant(Tensor mat1, Tensor mat2, Tensor scales2, Tensor? bias, "
        "ScalarType out_dtype, bool is_vnni) -> Tensor"),
    "fp8_scaled_mm_cpu": (
        "fp8_scaled_mm_cpu(Tensor mat1, Tensor mat2, Tensor scales2, int[] block_size, "
        "Tensor? bias, ScalarType out_dtype, bool is_vnni) -> Tensor"),
    "int4_scaled_mm_cpu": (
        "int4_scaled_mm_cpu(Tensor x, Tensor w, Tensor w_zeros, Tensor w_scales, Tensor? bias) "
        "-> Tensor"),
}

# The ops whose default overload SGLang's CPU graph runner gives a fake kernel itself.
FAKED_BY_SGLANG = frozenset({"fused_experts_cpu", "shared_expert_cpu", "topk_softmax_cpu",
                             "topk_sigmoid_cpu", "grouped_topk_cpu", "biased_grouped_topk_cpu"})


def forwards():
    """The ops to register, each with the cpumoe overload it forwards to."""
    ops = torch.ops.cpumoe
    targets = {
        "fused_experts_cpu": ops.fused_experts_cpu.activation,
        "fused_experts_cpu.no_bias": ops.fused_experts_cpu.default,
        "shared_expert_cpu": ops.shared_expert_cpu.default,
        "shared_expert_cpu.mxfp4": ops.shared_expert_cpu.mxfp4,
        "convert_weight_packed": ops.convert_weight_packed.default,
        "convert_weight_packed_scale_zp": ops.convert_weight_packed_scale_zp.default,
        "convert_scale_packed": ops.convert_scale_packed.default,
        "topk_softmax_cpu": ops.topk_softmax_cpu.default,
        "topk_sigmoid_cpu": ops.topk_sigmoid_cpu.default,
        "grouped_topk_cpu": ops.grouped_topk_cpu.default,
        "biased_grouped_topk_cpu": ops.biased_grouped_topk_cpu.default,
        "hash_topk_cpu": ops.hash_topk_cpu.default,
        "weight_packed_linear": ops.weight_packed_linear.default,
        "int8_scaled_mm_with_quant": ops.int8_scaled_mm_with_quant.default,
        "fp8_scaled_mm_cpu": ops.fp8_scaled_mm_cpu.default,
        "int4_scaled_mm_cpu": ops.int4_scaled_mm_cpu.default,
    }
    return [Forward(SCHEMAS[name], target) for name, target in targets.items()]


def _load_sgl_kernel() -> None:
    """Imports the real ``sgl_kernel`` package when it is installed and not yet imported:
    its library must define its ops before we look at the namespace."""
    if "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is None:
        return
    try:
        importlib.import_module("sgl_kernel")
    except Exception as e:  # noqa: BLE001 - any failure: report it, serve the ops ourselves
        warnings.warn(f"cpumoe.sglang: the sgl_kernel package is installed but importing it "
                      f"failed ({describe_error(e)}); cpumoe serves the ops it lacks",
                      UserWarning, stacklevel=3)


_load_sgl_kernel()
registration = register(NAMESPACE, forwards(), "cpumoe.sglang",
                        fakes_left_to_caller=FAKED_BY_SGLANG)
