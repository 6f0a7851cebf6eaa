// The entry points of torch.ops.cpumoe.*, which registration.cpp registers under SGLang's
// CPU MoE schemas (docs/SGLANG.md has them and where we differ). Each is defined in the
// file named after it: fused_experts.cpp, shared_expert.cpp, packers.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace cpumoe::bindings {

// fused_experts_cpu: the 13-argument overload, no bias and the silu-mul activation.
at::Tensor fused_experts_cpu(const at::Tensor &hidden_states, const at::Tensor &w1,
                             const at::Tensor &w2, const at::Tensor &topk_weights,
                             const at::Tensor &topk_ids, bool inplace, int64_t moe_comp_method,
                             const std::optional<at::Tensor> &w1_scale,
                             const std::optional<at::Tensor> &w2_scale,
                             const std::optional<at::Tensor> &w1_zero,
                             const std::optional<at::Tensor> &w2_zero,
                             at::OptionalIntArrayRef block_size, bool is_vnni);

// fused_experts_cpu.bias: plus per-expert biases and the clamped swiglu (alpha, limit).
at::Tensor fused_experts_cpu_bias(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, bool inplace,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni);

at::Tensor shared_expert_cpu(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const std::optional<at::Tensor> &fused_experts_out, std::optional<double> routed_scaling_factor,
    bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, at::OptionalIntArrayRef block_size, bool is_vnni);

at::Tensor convert_weight_packed(const at::Tensor &weight);

std::tuple<at::Tensor, at::Tensor, at::Tensor> convert_weight_packed_scale_zp(
    const at::Tensor &qweight, const at::Tensor &qzeros, const at::Tensor &scales,
    int64_t quant_method_4bit);

}  // namespace cpumoe::bindings
