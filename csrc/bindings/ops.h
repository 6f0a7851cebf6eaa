// The entry points of torch.ops.cpumoe.*, which registration.cpp registers under SGLang's
// CPU MoE schemas (docs/SGLANG.md has them and where we differ). Each is defined in the
// file named after it: fused_experts.cpp, shared_expert.cpp, packers.cpp, the routing
// ops in routing.cpp and the dense linear ops in linear.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
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

// fused_experts_cpu.bias: plus per-expert biases and the clamped activations (alpha and limit:
// swiglu; limit alone: silu).
at::Tensor fused_experts_cpu_bias(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, bool inplace,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni);

// fused_experts_cpu.activation: SGLang's current schema, plus `activation` ("silu" when None,
// or "gelu": erf-GELU times up).
at::Tensor fused_experts_cpu_activation(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, bool inplace,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni,
    std::optional<c10::string_view> activation);

// fused_experts_cpu.out: vLLM's schema, writing into `out` (which may be hidden_states);
// a1_scale (vLLM's own FP8 W8A8 activation scales) must be None.
void fused_experts_cpu_out(
    const at::Tensor &out, const at::Tensor &hidden_states, const at::Tensor &w1,
    const at::Tensor &w2, const at::Tensor &topk_weights, const at::Tensor &topk_ids,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, const std::optional<at::Tensor> &a1_scale,
    at::OptionalIntArrayRef block_size, const std::optional<at::Tensor> &w1_bias,
    const std::optional<at::Tensor> &w2_bias, std::optional<double> alpha,
    std::optional<double> limit, bool is_vnni);

// fused_experts_fp32_cpu (cpumoe only): fused_experts_cpu.activation without `inplace`,
// returning float32 [M, K]: the sum over slots before its one rounding to the activation
// dtype (expert parallelism adds the ranks' partial sums, then rounds once).
at::Tensor fused_experts_fp32_cpu(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, int64_t moe_comp_method,
    const std::optional<at::Tensor> &w1_scale, const std::optional<at::Tensor> &w2_scale,
    const std::optional<at::Tensor> &w1_zero, const std::optional<at::Tensor> &w2_zero,
    at::OptionalIntArrayRef block_size, const std::optional<at::Tensor> &w1_bias,
    const std::optional<at::Tensor> &w2_bias, std::optional<double> alpha,
    std::optional<double> limit, bool is_vnni, std::optional<c10::string_view> activation);

at::Tensor shared_expert_cpu(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const std::optional<at::Tensor> &fused_experts_out, std::optional<double> routed_scaling_factor,
    bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, at::OptionalIntArrayRef block_size, bool is_vnni);

// shared_expert_cpu.mxfp4: SGLang's newer schema (DeepSeek-V4): plus use_mxfp4 and the
// clamped activations (alpha and limit: swiglu; limit alone: silu).
at::Tensor shared_expert_cpu_mxfp4(const at::Tensor &hidden_states, const at::Tensor &w1,
                                   const at::Tensor &w2,
                                   const std::optional<at::Tensor> &fused_experts_out,
                                   std::optional<double> routed_scaling_factor, bool inplace,
                                   bool use_int8_w8a8, bool use_fp8_w8a16, bool use_mxfp4,
                                   const std::optional<at::Tensor> &w1_scale,
                                   const std::optional<at::Tensor> &w2_scale,
                                   at::OptionalIntArrayRef block_size, std::optional<double> alpha,
                                   std::optional<double> limit, bool is_vnni);

at::Tensor convert_weight_packed(const at::Tensor &weight);

at::Tensor convert_scale_packed(const at::Tensor &scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> convert_weight_packed_scale_zp(
    const at::Tensor &qweight, const at::Tensor &qzeros, const at::Tensor &scales,
    int64_t quant_method_4bit);

// The dense linear ops (linear.cpp): out [M, N] = mat1 [M, K] @ W [N, K]^T + bias, W packed.
at::Tensor weight_packed_linear(const at::Tensor &mat1, const at::Tensor &mat2,
                                const std::optional<at::Tensor> &bias, bool is_vnni);

at::Tensor int8_scaled_mm_with_quant(const at::Tensor &mat1, const at::Tensor &mat2,
                                     const at::Tensor &scales2,
                                     const std::optional<at::Tensor> &bias,
                                     at::ScalarType out_dtype, bool is_vnni);

at::Tensor fp8_scaled_mm_cpu(const at::Tensor &mat1, const at::Tensor &mat2,
                             const at::Tensor &scales2, at::IntArrayRef block_size,
                             const std::optional<at::Tensor> &bias, at::ScalarType out_dtype,
                             bool is_vnni);

at::Tensor int4_scaled_mm_cpu(const at::Tensor &x, const at::Tensor &w, const at::Tensor &w_zeros,
                              const at::Tensor &w_scales, const std::optional<at::Tensor> &bias);

// The routing ops: (topk_weights float32 [M, topk], topk_ids int32 [M, topk]).
std::tuple<at::Tensor, at::Tensor> topk_softmax_cpu(const at::Tensor &hidden_states,
                                                    const at::Tensor &gating_output, int64_t topk,
                                                    bool renormalize);

std::tuple<at::Tensor, at::Tensor> topk_sigmoid_cpu(const at::Tensor &hidden_states,
                                                    const at::Tensor &gating_output, int64_t topk,
                                                    bool renormalize);

std::tuple<at::Tensor, at::Tensor> grouped_topk_cpu(
    const at::Tensor &hidden_states, const at::Tensor &gating_output, int64_t topk,
    bool renormalize, int64_t num_expert_group, int64_t topk_group,
    int64_t num_fused_shared_experts, std::optional<double> routed_scaling_factor,
    const std::optional<at::Tensor> &num_token_non_padded);

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_cpu(
    const at::Tensor &hidden_states, const at::Tensor &gating_output,
    const at::Tensor &correction_bias, int64_t topk, bool renormalize, int64_t num_expert_group,
    int64_t topk_group, int64_t num_fused_shared_experts,
    std::optional<double> routed_scaling_factor,
    const std::optional<at::Tensor> &num_token_non_padded);

// vLLM's schema (its CPU build's routing for DeepSeek-V4)
std::tuple<at::Tensor, at::Tensor> biased_topk_cpu(
    const at::Tensor &hidden_states, const at::Tensor &gating_output,
    const at::Tensor &correction_bias, int64_t topk, bool renormalize,
    const std::string &scoring_func, int64_t num_fused_shared_experts,
    std::optional<double> routed_scaling_factor, bool apply_routed_scaling_factor_on_output);

// both libraries' schema (DeepSeek-V4's hash-routed layers: experts from a token-id table)
std::tuple<at::Tensor, at::Tensor> hash_topk_cpu(const at::Tensor &gating_output,
                                                 const at::Tensor &tid2eid, int64_t topk,
                                                 const std::string &scoring_func,
                                                 int64_t num_fused_shared_experts,
                                                 int64_t num_experts, double routed_scaling_factor);

}  // namespace cpumoe::bindings
