// torch.ops.cpumoe.fused_experts_cpu, its overloads (SGLang's three schemas and vLLM's
// out-variant, docs/SGLANG.md), and cpumoe's fused_experts_fp32_cpu (the same layer, its fp32
// sum before the one rounding). The scheme's row (schemes.h) checks and describes the weights
// and their scales; this file checks what every scheme shares (hidden_states, routing,
// biases, activation) in the order docs/ERRORS.md gives, and runs the problem.
#include <ATen/MemoryOverlap.h>

#include <tuple>

#include "checks.h"
#include "ops.h"
#include "runtime.h"
#include "schemes.h"

namespace cpumoe::bindings {
namespace {

// topk_weights and topk_ids [M, topk], as the contiguous copies the problem points into.
struct Routing {
  at::Tensor weights, ids;
};

Routing check_routing(const at::Tensor &topk_weights, const at::Tensor &topk_ids, int64_t M,
                      const char *op) {
  check_cpu_tensor(topk_weights, "topk_weights", op);
  check_cpu_tensor(topk_ids, "topk_ids", op);
  TORCH_CHECK(topk_weights.dim() == 2, op, ": topk_weights must be 2-D [M, topk], got shape ",
              topk_weights.sizes());
  TORCH_CHECK(topk_ids.dim() == 2, op, ": topk_ids must be 2-D [M, topk], got shape ",
              topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_weights and topk_ids must have the same shape, got ", topk_weights.sizes(),
              " vs ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.size(0) == M, op, ": topk_ids must have M = hidden_states.size(0) = ", M,
              " rows, got shape ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.size(1) >= 1, op, ": topk = topk_ids.size(1) must be at least 1, got shape ",
              topk_ids.sizes());
  const at::ScalarType ids_dtype = topk_ids.scalar_type();
  TORCH_CHECK(ids_dtype == at::kInt || ids_dtype == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", dtype_name(ids_dtype));
  const at::ScalarType weights_dtype = topk_weights.scalar_type();
  TORCH_CHECK(weights_dtype == at::kFloat || weights_dtype == at::kDouble ||
                  weights_dtype == at::kBFloat16 || weights_dtype == at::kHalf,
              op, ": topk_weights must be float32, float64, bfloat16 or float16, got ",
              dtype_name(weights_dtype));
  return {topk_weights.contiguous(), topk_ids.contiguous()};
}

// w1_bias [E, 2N] and w2_bias [E, K], fp32, both or neither.
void check_biases(const std::optional<at::Tensor> &w1_bias,
                  const std::optional<at::Tensor> &w2_bias, int64_t E, int64_t N, int64_t K,
                  const char *op) {
  TORCH_CHECK(w1_bias.has_value() == w2_bias.has_value(), op,
              ": w1_bias and w2_bias must be given together (got only ",
              w1_bias.has_value() ? "w1_bias" : "w2_bias", ")");
  if (!w1_bias.has_value()) return;
  for (const auto &[bias, name, cols] :
       {std::tuple{*w1_bias, "w1_bias", 2 * N}, std::tuple{*w2_bias, "w2_bias", K}}) {
    check_dense(bias, name, op, 2);
    TORCH_CHECK(bias.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
                dtype_name(bias.scalar_type()));
    TORCH_CHECK(bias.size(0) == E && bias.size(1) == cols, op, ": ", name, " must have shape [", E,
                ", ", cols, "], got ", bias.sizes());
  }
}

// Where the result goes: a new tensor in the activation dtype, hidden_states itself
// (inplace), or a new float32 tensor holding the sum before its one rounding.
enum class Output { kNew, kInPlace, kFloat32 };

// Every overload of fused_experts_cpu and fused_experts_fp32_cpu: `op` names the op in the
// messages.
at::Tensor run_fused_experts(
    const char *op, Output output, const at::Tensor &hidden_states, const at::Tensor &w1,
    const at::Tensor &w2, const at::Tensor &topk_weights, const at::Tensor &topk_ids,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni,
    std::optional<c10::string_view> activation) {
  const SchemeTraits &scheme = scheme_for_method(moe_comp_method, op);
  check_dense(hidden_states, "hidden_states", op, 2);
  cpumoe_moe_problem problem{};
  problem.scheme = scheme.scheme;
  problem.act_dtype = activation_dtype(hidden_states, op);
  if (!scheme.takes_zero_points()) {
    check_unused(w1_zero, "w1_zero", op, scheme.label);
    check_unused(w2_zero, "w2_zero", op, scheme.label);
  }
  std::tie(problem.block_n, problem.block_k) =
      check_scale_args(scheme, scheme.label, w1_scale, w2_scale, block_size, op);

  problem.M = hidden_states.size(0), problem.K = hidden_states.size(1);
  check_cpu_tensor(w1, "w1", op);
  check_cpu_tensor(w2, "w2", op);
  const WeightOperands operands{.w1 = w1,
                                .w2 = w2,
                                .w1_scale = w1_scale,
                                .w2_scale = w2_scale,
                                .w1_zero = w1_zero,
                                .w2_zero = w2_zero,
                                .activation_dtype = hidden_states.scalar_type(),
                                .is_vnni = is_vnni,
                                .label = scheme.label,
                                .op = op};
  // held until the problem has run: with is_vnni=False these are the only packed copies
  const DescribedWeights weights = scheme.describe_experts(scheme, operands, problem);

  const Routing routing = check_routing(topk_weights, topk_ids, problem.M, op);
  check_biases(w1_bias, w2_bias, problem.E, problem.N, problem.K, op);
  set_activation(problem, activation, alpha, limit, op);

  at::Tensor out =
      output == Output::kInPlace ? hidden_states
      : output == Output::kFloat32
          ? at::empty({problem.M, problem.K}, hidden_states.options().dtype(at::kFloat))
          : new_output_like(hidden_states);
  problem.out_f32 = output == Output::kFloat32;
  problem.topk = routing.ids.size(1);
  problem.x = hidden_states.data_ptr();
  problem.topk_ids = routing.ids.data_ptr();
  problem.topk_ids_dtype = core_dtype(routing.ids.scalar_type());
  problem.topk_weights = routing.weights.data_ptr();
  problem.topk_weights_dtype = core_dtype(routing.weights.scalar_type());
  problem.w1_bias = w1_bias.has_value() ? w1_bias->data_ptr<float>() : nullptr;
  problem.w2_bias = w2_bias.has_value() ? w2_bias->data_ptr<float>() : nullptr;
  problem.out = out.data_ptr();
  run_problem(problem, op);
  return out;
}

}  // namespace

at::Tensor fused_experts_cpu_activation(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, bool inplace,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni,
    std::optional<c10::string_view> activation) {
  return run_fused_experts("fused_experts_cpu", inplace ? Output::kInPlace : Output::kNew,
                           hidden_states, w1, w2, topk_weights, topk_ids, moe_comp_method, w1_scale,
                           w2_scale, w1_zero, w2_zero, block_size, w1_bias, w2_bias, alpha, limit,
                           is_vnni, activation);
}

at::Tensor fused_experts_fp32_cpu(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, int64_t moe_comp_method,
    const std::optional<at::Tensor> &w1_scale, const std::optional<at::Tensor> &w2_scale,
    const std::optional<at::Tensor> &w1_zero, const std::optional<at::Tensor> &w2_zero,
    at::OptionalIntArrayRef block_size, const std::optional<at::Tensor> &w1_bias,
    const std::optional<at::Tensor> &w2_bias, std::optional<double> alpha,
    std::optional<double> limit, bool is_vnni, std::optional<c10::string_view> activation) {
  return run_fused_experts("fused_experts_fp32_cpu", Output::kFloat32, hidden_states, w1, w2,
                           topk_weights, topk_ids, moe_comp_method, w1_scale, w2_scale, w1_zero,
                           w2_zero, block_size, w1_bias, w2_bias, alpha, limit, is_vnni,
                           activation);
}

at::Tensor fused_experts_cpu_bias(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, bool inplace,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni) {
  return fused_experts_cpu_activation(
      hidden_states, w1, w2, topk_weights, topk_ids, inplace, moe_comp_method, w1_scale, w2_scale,
      w1_zero, w2_zero, block_size, w1_bias, w2_bias, alpha, limit, is_vnni, std::nullopt);
}

at::Tensor fused_experts_cpu(const at::Tensor &hidden_states, const at::Tensor &w1,
                             const at::Tensor &w2, const at::Tensor &topk_weights,
                             const at::Tensor &topk_ids, bool inplace, int64_t moe_comp_method,
                             const std::optional<at::Tensor> &w1_scale,
                             const std::optional<at::Tensor> &w2_scale,
                             const std::optional<at::Tensor> &w1_zero,
                             const std::optional<at::Tensor> &w2_zero,
                             at::OptionalIntArrayRef block_size, bool is_vnni) {
  return fused_experts_cpu_bias(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                                moe_comp_method, w1_scale, w2_scale, w1_zero, w2_zero, block_size,
                                std::nullopt, std::nullopt, std::nullopt, std::nullopt, is_vnni);
}

// vLLM's out-variant: the .bias overload's problem, written into `out`. An `out` that is
// hidden_states itself is the inplace call; any other `out` (vLLM passes its own buffer)
// receives a copy of the result, so it may also overlap hidden_states in part.
void fused_experts_cpu_out(
    const at::Tensor &out, const at::Tensor &hidden_states, const at::Tensor &w1,
    const at::Tensor &w2, const at::Tensor &topk_weights, const at::Tensor &topk_ids,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, const std::optional<at::Tensor> &a1_scale,
    at::OptionalIntArrayRef block_size, const std::optional<at::Tensor> &w1_bias,
    const std::optional<at::Tensor> &w2_bias, std::optional<double> alpha,
    std::optional<double> limit, bool is_vnni) {
  const char *op = "fused_experts_cpu";
  TORCH_CHECK(!a1_scale.has_value(), op,
              ": a1_scale must be None: cpumoe has no FP8 W8A8 scheme with precomputed per-token "
              "activation scales (vLLM's); it quantizes activations itself for "
              "moe_comp_method 1 and 3");
  scheme_for_method(moe_comp_method, op);
  check_dense(hidden_states, "hidden_states", op, 2);
  const at::ScalarType dtype = hidden_states.scalar_type();
  activation_dtype(hidden_states, op);
  check_dense(out, "out", op, 2);
  TORCH_CHECK(out.scalar_type() == dtype, op, ": out must have the dtype of hidden_states (",
              dtype_name(dtype), "), got ", dtype_name(out.scalar_type()));
  TORCH_CHECK(out.sizes() == hidden_states.sizes(), op,
              ": out must have the shape of hidden_states ", hidden_states.sizes(), ", got ",
              out.sizes());
  const bool into_hidden_states =
      at::get_overlap_status(out, hidden_states) == at::MemOverlapStatus::Full;
  const at::Tensor result = fused_experts_cpu_bias(
      hidden_states, w1, w2, topk_weights, topk_ids, into_hidden_states, moe_comp_method, w1_scale,
      w2_scale, w1_zero, w2_zero, block_size, w1_bias, w2_bias, alpha, limit, is_vnni);
  if (!into_hidden_states) out.copy_(result);
}

}  // namespace cpumoe::bindings
