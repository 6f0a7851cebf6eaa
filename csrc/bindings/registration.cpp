// Registration of the extension: the op schemas under torch.ops.cpumoe (SGLang's CPU MoE
// schemas, docs/SGLANG.md), their CPU kernels (ops.h), and the Python module cpumoe._C with
// the ISA, workspace and probe helpers (runtime.h). Nothing is computed or checked here.
#include <torch/extension.h>
#include <torch/library.h>

#include "ops.h"
#include "runtime.h"

TORCH_LIBRARY(cpumoe, m) {
  m.def(
      "fused_experts_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
      "Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, "
      "Tensor? w1_zero, Tensor? w2_zero, int[]? block_size, bool is_vnni) -> Tensor");
  m.def(
      "fused_experts_cpu.bias(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
      "Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, "
      "Tensor? w1_zero, Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, "
      "float? alpha, float? limit, bool is_vnni) -> Tensor");
  m.def(
      "fused_experts_cpu.activation(Tensor hidden_states, Tensor w1, Tensor w2, Tensor "
      "topk_weights, Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? "
      "w2_scale, Tensor? w1_zero, Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? "
      "w2_bias, float? alpha, float? limit, bool is_vnni, str? activation=None) -> Tensor");
  // vLLM's out-variant (its CPU build's _C::fused_experts_cpu)
  m.def(
      "fused_experts_cpu.out(Tensor(a0!) out, Tensor hidden_states, Tensor w1, Tensor w2, Tensor "
      "topk_weights, Tensor topk_ids, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, "
      "Tensor? w1_zero, Tensor? w2_zero, Tensor? a1_scale, int[]? block_size, Tensor? w1_bias, "
      "Tensor? w2_bias, float? alpha, float? limit, bool is_vnni) -> ()");
  // cpumoe only: the fp32 sum before its one rounding (expert parallelism, docs/SGLANG.md)
  m.def(
      "fused_experts_fp32_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
      "Tensor topk_ids, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, Tensor? w1_zero, "
      "Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, float? alpha, float? "
      "limit, bool is_vnni, str? activation=None) -> Tensor");
  m.def(
      "shared_expert_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor? fused_experts_out, "
      "float? routed_scaling_factor, bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, "
      "Tensor? w1_scale, Tensor? w2_scale, int[]? block_size, bool is_vnni) -> Tensor");
  m.def(
      "shared_expert_cpu.mxfp4(Tensor hidden_states, Tensor w1, Tensor w2, Tensor? "
      "fused_experts_out, float? routed_scaling_factor, bool inplace, bool use_int8_w8a8, bool "
      "use_fp8_w8a16, bool use_mxfp4, Tensor? w1_scale, Tensor? w2_scale, int[]? block_size, "
      "float? alpha, float? limit, bool is_vnni) -> Tensor");
  m.def("convert_weight_packed(Tensor weight) -> Tensor");
  m.def("convert_scale_packed(Tensor scale) -> Tensor");
  m.def(
      "convert_weight_packed_scale_zp(Tensor weight, Tensor qzeros, Tensor scales, int "
      "quant_method_4bit) -> (Tensor, Tensor, Tensor)");
  // dense linear layers on the experts' kernels: SGLang's four ops
  m.def("weight_packed_linear(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni) -> Tensor");
  m.def(
      "int8_scaled_mm_with_quant(Tensor mat1, Tensor mat2, Tensor scales2, Tensor? bias, "
      "ScalarType out_dtype, bool is_vnni) -> Tensor");
  m.def(
      "fp8_scaled_mm_cpu(Tensor mat1, Tensor mat2, Tensor scales2, int[] block_size, Tensor? "
      "bias, ScalarType out_dtype, bool is_vnni) -> Tensor");
  m.def(
      "int4_scaled_mm_cpu(Tensor x, Tensor w, Tensor w_zeros, Tensor w_scales, Tensor? bias) -> "
      "Tensor");
  // routing before the experts: SGLang's four ops, vLLM's biased_topk_cpu, both's hash_topk_cpu
  m.def(
      "topk_softmax_cpu(Tensor hidden_states, Tensor gating_output, int topk, bool renormalize) "
      "-> (Tensor, Tensor)");
  m.def(
      "topk_sigmoid_cpu(Tensor hidden_states, Tensor gating_output, int topk, bool renormalize) "
      "-> (Tensor, Tensor)");
  m.def(
      "grouped_topk_cpu(Tensor hidden_states, Tensor gating_output, int topk, bool renormalize, "
      "int num_expert_group, int topk_group, int num_fused_shared_experts, float? "
      "routed_scaling_factor, Tensor? num_token_non_padded) -> (Tensor, Tensor)");
  m.def(
      "biased_grouped_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor "
      "correction_bias, int topk, bool renormalize, int num_expert_group, int topk_group, int "
      "num_fused_shared_experts, float? routed_scaling_factor, Tensor? num_token_non_padded) -> "
      "(Tensor, Tensor)");
  m.def(
      "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int "
      "topk, bool renormalize, str scoring_func, int num_fused_shared_experts, float? "
      "routed_scaling_factor, bool apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)");
  m.def(
      "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, int "
      "num_fused_shared_experts, int num_experts, float routed_scaling_factor) -> (Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(cpumoe, CPU, m) {
  namespace ops = cpumoe::bindings;
  m.impl("fused_experts_cpu", &ops::fused_experts_cpu);
  m.impl("fused_experts_cpu.bias", &ops::fused_experts_cpu_bias);
  m.impl("fused_experts_cpu.activation", &ops::fused_experts_cpu_activation);
  m.impl("fused_experts_cpu.out", &ops::fused_experts_cpu_out);
  m.impl("fused_experts_fp32_cpu", &ops::fused_experts_fp32_cpu);
  m.impl("shared_expert_cpu", &ops::shared_expert_cpu);
  m.impl("shared_expert_cpu.mxfp4", &ops::shared_expert_cpu_mxfp4);
  m.impl("convert_weight_packed", &ops::convert_weight_packed);
  m.impl("convert_scale_packed", &ops::convert_scale_packed);
  m.impl("convert_weight_packed_scale_zp", &ops::convert_weight_packed_scale_zp);
  m.impl("weight_packed_linear", &ops::weight_packed_linear);
  m.impl("int8_scaled_mm_with_quant", &ops::int8_scaled_mm_with_quant);
  m.impl("fp8_scaled_mm_cpu", &ops::fp8_scaled_mm_cpu);
  m.impl("int4_scaled_mm_cpu", &ops::int4_scaled_mm_cpu);
  m.impl("topk_softmax_cpu", &ops::topk_softmax_cpu);
  m.impl("topk_sigmoid_cpu", &ops::topk_sigmoid_cpu);
  m.impl("grouped_topk_cpu", &ops::grouped_topk_cpu);
  m.impl("biased_grouped_topk_cpu", &ops::biased_grouped_topk_cpu);
  m.impl("biased_topk_cpu", &ops::biased_topk_cpu);
  m.impl("hash_topk_cpu", &ops::hash_topk_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace rt = cpumoe::bindings;
  m.doc() = "cpumoe native helpers (the ops themselves are torch.ops.cpumoe.*)";
  m.def("active_isa", &rt::active_isa, "ISA tier the ops use");
  m.def("best_isa", &rt::best_isa, "best ISA tier this CPU and build support");
  m.def("set_isa", &rt::set_isa,
        "cap the active tier at a built tier (or its nearest ancestor this CPU runs)");
  m.def("isa_reason", &rt::isa_reason);
  m.def("cpu_features", &rt::cpu_features);
  m.def("built_isas", &rt::built_isas, "tiers compiled in, worst first (rank order)");
  m.def("supported_isas", &rt::supported_isas, "the built tiers this CPU runs, worst first");
  m.def("numerics_class", &rt::numerics_class,
        "numerics class of a tier's results: tiers of one class give the same bits");
  m.def("release_workspace", &rt::release_workspace,
        "free the calling thread's cached op workspace");
  m.def("workspace_bytes", &rt::workspace_bytes,
        "bytes of the calling thread's cached op workspace");
  m.def("workspace_address", &rt::workspace_address,
        "address of the calling thread's cached op workspace (0 without one)");
  m.def("new_weight_buffer", &rt::new_weight_buffer,
        "uninitialized uint8 tensor of `nbytes`, allocated as packed weights are (huge pages)");
  m.def("probe_read", &rt::probe_read, "stream a buffer `passes` times on torch's threads");
  m.def("probe_int8", &rt::probe_int8,
        "u8*s8 ops done by `iterations` of the int8 peak loop per thread (VNNI on avx512)");
  m.def("probe_int4", &rt::probe_int4,
        "int4 ops done by `iterations` of the loop the INT4 kernels run, per thread "
        "(vpmaddubsw of nibbles on avx2, the int8 loop elsewhere)");
  m.def("probe_fma", &rt::probe_fma, "flops done by `iterations` of the FMA peak loop per thread");
  m.def("probe_bf16", &rt::probe_bf16,
        "bf16 ops done by `iterations` of the bf16 peak loop per thread (AMX on amx)");
  m.def("activation_values", &rt::activation_values, pybind11::arg("name"), pybind11::arg("gate"),
        pybind11::arg("up"), pybind11::arg("alpha") = 0.0, pybind11::arg("limit") = 0.0,
        "the active tier's activation kernel on fp32 gate/up: silu, gelu, swiglu or "
        "silu_clamp (tests)");
  m.def("forward_to_cpumoe", &rt::forward_to_cpumoe, pybind11::arg("namespace"),
        pybind11::arg("overload"), pybind11::arg("target"),
        "give namespace::overload a CPU kernel that calls torch.ops.cpumoe's `target` overload "
        "with the same arguments, in C++");
  m.def("runner_threads", &rt::runner_threads,
        "distinct OS threads that torch's runner gives `workers` workers");
}
