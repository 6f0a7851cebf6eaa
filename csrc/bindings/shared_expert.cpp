// torch.ops.cpumoe.shared_expert_cpu, both overloads (SGLang's schemas, docs/SGLANG.md): one
// dense MLP over every token, optionally added to fused_experts' output. Its flags select a
// scheme row (schemes.h), which checks and describes the 2-D weights and their scales; the C
// core runs it as a fused MoE with one expert and one slot per token.
#include <tuple>

#include "checks.h"
#include "ops.h"
#include "runtime.h"
#include "schemes.h"

namespace cpumoe::bindings {

// The .mxfp4 overload is the full form; the default one passes use_mxfp4=false and no
// alpha/limit.
at::Tensor shared_expert_cpu_mxfp4(const at::Tensor &hidden_states, const at::Tensor &w1,
                                   const at::Tensor &w2,
                                   const std::optional<at::Tensor> &fused_experts_out,
                                   std::optional<double> routed_scaling_factor, bool inplace,
                                   bool use_int8_w8a8, bool use_fp8_w8a16, bool use_mxfp4,
                                   const std::optional<at::Tensor> &w1_scale,
                                   const std::optional<at::Tensor> &w2_scale,
                                   at::OptionalIntArrayRef block_size, std::optional<double> alpha,
                                   std::optional<double> limit, bool is_vnni) {
  const char *op = "shared_expert_cpu";
  const SchemeTraits &scheme =
      scheme_for_shared_expert(use_int8_w8a8, use_fp8_w8a16, use_mxfp4, op);
  check_dense(hidden_states, "hidden_states", op, 2);
  cpumoe_moe_problem problem{};
  problem.act_dtype = activation_dtype(hidden_states, op);
  const at::ScalarType dtype = hidden_states.scalar_type();
  problem.scheme = scheme.scheme;
  // messages name this op's flags, not moe_comp_method
  const char *label = scheme.shared_expert.label;
  std::tie(problem.block_n, problem.block_k) =
      check_scale_args(scheme, label, w1_scale, w2_scale, block_size, op);

  problem.M = hidden_states.size(0), problem.K = hidden_states.size(1);
  check_cpu_tensor(w1, "w1", op);
  TORCH_CHECK(w1.dim() == 2, op, ": w1 must be a 2-D tensor [2N, K], got shape ", w1.sizes());
  problem.N = w1.size(0) / 2;
  TORCH_CHECK(w1.size(0) % 2 == 0 && problem.N > 0, op,
              ": w1.size(0) must be 2N (gate and up rows), a positive even number, got ",
              w1.size(0));
  check_mlp_sizes(problem.K, problem.N, op);
  const std::optional<at::Tensor> no_zero_points;
  const WeightOperands operands{.w1 = w1,
                                .w2 = w2,
                                .w1_scale = w1_scale,
                                .w2_scale = w2_scale,
                                .w1_zero = no_zero_points,
                                .w2_zero = no_zero_points,
                                .activation_dtype = dtype,
                                .is_vnni = is_vnni,
                                .label = label,
                                .op = op};
  // held until the problem has run: with is_vnni=False these are the only packed copies
  const DescribedWeights weights = describe_dense_weights(scheme, operands, {}, problem);

  TORCH_CHECK(fused_experts_out.has_value() == routed_scaling_factor.has_value(), op,
              ": fused_experts_out and routed_scaling_factor must be given together (got only ",
              fused_experts_out.has_value() ? "fused_experts_out" : "routed_scaling_factor", ")");
  if (fused_experts_out.has_value()) {
    check_dense(*fused_experts_out, "fused_experts_out", op, 2);
    TORCH_CHECK(fused_experts_out->scalar_type() == dtype, op,
                ": fused_experts_out must have the dtype of hidden_states (", dtype_name(dtype),
                "), got ", dtype_name(fused_experts_out->scalar_type()));
    TORCH_CHECK(fused_experts_out->sizes() == hidden_states.sizes(), op,
                ": fused_experts_out must have the shape of hidden_states ", hidden_states.sizes(),
                ", got ", fused_experts_out->sizes());
  }
  set_activation(problem, std::nullopt, alpha, limit, op);
  at::Tensor out = inplace ? hidden_states : new_output_like(hidden_states);
  problem.E = 1, problem.topk = 1;
  problem.x = hidden_states.data_ptr();
  if (fused_experts_out.has_value()) {
    problem.residual = fused_experts_out->data_ptr();
    problem.residual_scale = static_cast<float>(*routed_scaling_factor);
  }
  problem.out = out.data_ptr();
  run_problem(problem, op);
  return out;
}

at::Tensor shared_expert_cpu(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const std::optional<at::Tensor> &fused_experts_out, std::optional<double> routed_scaling_factor,
    bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, at::OptionalIntArrayRef block_size, bool is_vnni) {
  return shared_expert_cpu_mxfp4(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor,
                                 inplace, use_int8_w8a8, use_fp8_w8a16, false, w1_scale, w2_scale,
                                 block_size, std::nullopt, std::nullopt, is_vnni);
}

}  // namespace cpumoe::bindings
