// torch.ops.cpumoe.topk_softmax_cpu, topk_sigmoid_cpu, grouped_topk_cpu and
// biased_grouped_topk_cpu (SGLang's schemas), biased_topk_cpu (vLLM's) and hash_topk_cpu
// (both's): the router's top-k before the experts, run by the C core's cpumoe_gating
// (docs/MATH.md, "Routing"). Each op checks its arguments in the order docs/ERRORS.md lists
// them and returns (topk_weights float32 [M, topk], topk_ids int32 [M, topk]); hidden_states
// only gives M (hash_topk_cpu has none: gating_output's rows do).
#include <ATen/EmptyTensor.h>

#include <cmath>
#include <string>
#include <tuple>

#include "checks.h"
#include "ops.h"
#include "runtime.h"

namespace cpumoe::bindings {
namespace {

using RoutingResult = std::tuple<at::Tensor, at::Tensor>;

// A float tensor the core reads as logits or bias: float32, bfloat16 or float16.
bool core_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// The common arguments: hidden_states [M, *] (only its row count is used; NULL for an op
// without it, whose M is gating_output's rows) and gating_output [M, E] (made contiguous;
// the returned tensor holds the copy). Sets M, E and the logits.
at::Tensor check_logits(const at::Tensor *hidden_states, const at::Tensor &gating_output,
                        cpumoe_gating_problem &p, const char *op) {
  if (hidden_states) {
    check_cpu_tensor(*hidden_states, "hidden_states", op);
    TORCH_CHECK(hidden_states->dim() == 2, op,
                ": hidden_states must be a 2-D tensor [M, K], got shape ", hidden_states->sizes());
  }
  check_cpu_tensor(gating_output, "gating_output", op);
  TORCH_CHECK(gating_output.dim() == 2, op,
              ": gating_output must be a 2-D tensor [M, E], got shape ", gating_output.sizes());
  TORCH_CHECK(core_float(gating_output.scalar_type()), op,
              ": gating_output must be float32, bfloat16 or float16, got ",
              dtype_name(gating_output.scalar_type()));
  p.M = hidden_states ? hidden_states->size(0) : gating_output.size(0);
  TORCH_CHECK(gating_output.size(0) == p.M, op,
              ": gating_output must have M = hidden_states.size(0) = ", p.M, " rows, got shape ",
              gating_output.sizes());
  p.E = gating_output.size(1);
  TORCH_CHECK(p.E >= 1, op,
              ": gating_output must have at least one column (one per expert), "
              "got shape ",
              gating_output.sizes());
  TORCH_CHECK(p.E <= INT32_MAX, op, ": gating_output has E = ", p.E,
              " columns; int32 ids allow at most 2^31 - 1 experts");
  at::Tensor logits = gating_output.contiguous();
  p.M_valid = p.M;
  p.groups = p.topk_groups = 1;
  p.logits = logits.data_ptr();
  p.logits_dtype = core_dtype(logits.scalar_type());
  return logits;
}

// correction_bias: E values (any shape), float32, bfloat16 or float16; made contiguous.
at::Tensor check_bias(const at::Tensor &bias, cpumoe_gating_problem &p, const char *op) {
  check_cpu_tensor(bias, "correction_bias", op);
  TORCH_CHECK(core_float(bias.scalar_type()), op,
              ": correction_bias must be float32, bfloat16 or float16, got ",
              dtype_name(bias.scalar_type()));
  TORCH_CHECK(bias.numel() == p.E, op, ": correction_bias must hold E = ", p.E,
              " values (one per routed expert), got shape ", bias.sizes());
  at::Tensor b = bias.contiguous();
  p.bias = b.data_ptr();
  p.bias_dtype = core_dtype(b.scalar_type());
  return b;
}

void check_groups(int64_t num_expert_group, int64_t topk_group, cpumoe_gating_problem &p,
                  const char *op) {
  TORCH_CHECK(num_expert_group >= 1, op, ": num_expert_group must be at least 1, got ",
              num_expert_group);
  TORCH_CHECK(p.E % num_expert_group == 0, op, ": num_expert_group = ", num_expert_group,
              " must divide the number of experts E = ", p.E);
  TORCH_CHECK(topk_group >= 1 && topk_group <= num_expert_group, op,
              ": topk_group must lie in [1, num_expert_group = ", num_expert_group, "], got ",
              topk_group);
  p.groups = num_expert_group;
  p.topk_groups = topk_group;
}

// routed_scaling_factor (finite, non-zero) and the fused shared experts, which need it.
void check_scaling(int64_t num_fused_shared_experts, std::optional<double> routed_scaling_factor,
                   cpumoe_gating_problem &p, const char *op) {
  if (routed_scaling_factor.has_value()) {
    const float f = static_cast<float>(*routed_scaling_factor);
    TORCH_CHECK(std::isfinite(f) && f != 0.0f, op,
                ": routed_scaling_factor must be a finite non-zero float32, got ",
                *routed_scaling_factor);
    p.has_routed_scaling_factor = 1;
    p.routed_scaling_factor = f;
  }
  TORCH_CHECK(num_fused_shared_experts >= 0, op, ": num_fused_shared_experts must be >= 0, got ",
              num_fused_shared_experts);
  TORCH_CHECK(num_fused_shared_experts <= INT32_MAX - p.E + 1, op,
              ": num_fused_shared_experts = ", num_fused_shared_experts,
              " gives shared expert ids beyond int32");
  TORCH_CHECK(num_fused_shared_experts == 0 || routed_scaling_factor.has_value(), op,
              ": num_fused_shared_experts = ", num_fused_shared_experts,
              " needs routed_scaling_factor (the shared slot's weight is the routed weights' sum "
              "divided by it)");
  p.num_shared = num_fused_shared_experts;
}

// topk leaves 1 .. (experts of the chosen groups) routed slots beside a fused shared slot.
void check_topk(int64_t topk, cpumoe_gating_problem &p, const char *op) {
  TORCH_CHECK(topk >= 1, op, ": topk must be at least 1, got ", topk);
  TORCH_CHECK(p.num_shared == 0 || topk >= 2, op, ": topk = ", topk,
              " leaves no routed slot (num_fused_shared_experts = ", p.num_shared,
              " takes the last slot)");
  const int64_t routed = topk - (p.num_shared > 0);
  const int64_t candidates = p.topk_groups * (p.E / p.groups);
  const std::string slots =
      p.num_shared > 0 ? " (" + std::to_string(routed) + " routed slots and a shared one)" : "";
  const std::string experts =
      p.groups > 1 ? " experts of the topk_group = " + std::to_string(p.topk_groups) +
                         " groups it keeps (" + std::to_string(p.E / p.groups) + " each)"
                   : " experts (E = gating_output.size(1))";
  TORCH_CHECK(routed <= candidates, op, ": topk = ", topk, slots, " exceeds the ", candidates,
              experts);
  p.topk = topk;
}

// num_token_non_padded: one int32/int64 value n; rows from n on are padding (ids -1).
void check_non_padded(const std::optional<at::Tensor> &num_token_non_padded,
                      cpumoe_gating_problem &p, const char *op) {
  if (!num_token_non_padded.has_value()) return;
  const at::Tensor &n = *num_token_non_padded;
  check_cpu_tensor(n, "num_token_non_padded", op);
  TORCH_CHECK(n.numel() == 1 && (n.scalar_type() == at::kInt || n.scalar_type() == at::kLong), op,
              ": num_token_non_padded must hold one int32 or int64 value, got ",
              dtype_name(n.scalar_type()), " of shape ", n.sizes());
  const int64_t v = n.scalar_type() == at::kInt ? n.item<int32_t>() : n.item<int64_t>();
  p.M_valid = v < 0 ? 0 : (v > p.M ? p.M : v);
}

RoutingResult run(cpumoe_gating_problem &p, const char *op) {
  at::Tensor weights = at::detail::empty_cpu({p.M, p.topk}, at::kFloat, /*pin_memory=*/false,
                                             at::MemoryFormat::Contiguous);
  at::Tensor ids = at::detail::empty_cpu({p.M, p.topk}, at::kInt, /*pin_memory=*/false,
                                         at::MemoryFormat::Contiguous);
  p.topk_weights = weights.data_ptr<float>();
  p.topk_ids = ids.data_ptr<int32_t>();
  run_gating_problem(p, op);
  return {weights, ids};
}

// topk_softmax_cpu and topk_sigmoid_cpu: no groups, no bias.
RoutingResult plain_topk(const at::Tensor &hidden_states, const at::Tensor &gating_output,
                         int64_t topk, bool renormalize, cpumoe_gating_score score,
                         const char *op) {
  cpumoe_gating_problem p{};
  const at::Tensor logits = check_logits(&hidden_states, gating_output, p, op);
  check_topk(topk, p, op);
  p.score = score;
  p.renormalize = renormalize;
  return run(p, op);
}

// grouped_topk_cpu (softmax, groups by their best logit) and biased_grouped_topk_cpu (with a
// correction bias: sigmoid, groups by the sum of their two best); the factor, given, scales
// the output.
RoutingResult grouped_topk(const at::Tensor &hidden_states, const at::Tensor &gating_output,
                           const at::Tensor *correction_bias, int64_t topk, bool renormalize,
                           int64_t num_expert_group, int64_t topk_group,
                           int64_t num_fused_shared_experts,
                           std::optional<double> routed_scaling_factor,
                           const std::optional<at::Tensor> &num_token_non_padded, const char *op) {
  cpumoe_gating_problem p{};
  const at::Tensor logits = check_logits(&hidden_states, gating_output, p, op);
  const at::Tensor bias = correction_bias ? check_bias(*correction_bias, p, op) : at::Tensor();
  check_groups(num_expert_group, topk_group, p, op);
  check_scaling(num_fused_shared_experts, routed_scaling_factor, p, op);
  check_topk(topk, p, op);
  check_non_padded(num_token_non_padded, p, op);
  p.score = correction_bias ? CPUMOE_SCORE_SIGMOID : CPUMOE_SCORE_SOFTMAX;
  p.group_score = correction_bias ? CPUMOE_GROUP_TOP2_SUM : CPUMOE_GROUP_MAX;
  p.renormalize = renormalize;
  p.scale_output = p.has_routed_scaling_factor;
  return run(p, op);
}

}  // namespace

RoutingResult topk_softmax_cpu(const at::Tensor &hidden_states, const at::Tensor &gating_output,
                               int64_t topk, bool renormalize) {
  return plain_topk(hidden_states, gating_output, topk, renormalize, CPUMOE_SCORE_SOFTMAX,
                    "topk_softmax_cpu");
}

RoutingResult topk_sigmoid_cpu(const at::Tensor &hidden_states, const at::Tensor &gating_output,
                               int64_t topk, bool renormalize) {
  return plain_topk(hidden_states, gating_output, topk, renormalize, CPUMOE_SCORE_SIGMOID,
                    "topk_sigmoid_cpu");
}

RoutingResult grouped_topk_cpu(const at::Tensor &hidden_states, const at::Tensor &gating_output,
                               int64_t topk, bool renormalize, int64_t num_expert_group,
                               int64_t topk_group, int64_t num_fused_shared_experts,
                               std::optional<double> routed_scaling_factor,
                               const std::optional<at::Tensor> &num_token_non_padded) {
  return grouped_topk(hidden_states, gating_output, nullptr, topk, renormalize, num_expert_group,
                      topk_group, num_fused_shared_experts, routed_scaling_factor,
                      num_token_non_padded, "grouped_topk_cpu");
}

RoutingResult biased_grouped_topk_cpu(const at::Tensor &hidden_states,
                                      const at::Tensor &gating_output,
                                      const at::Tensor &correction_bias, int64_t topk,
                                      bool renormalize, int64_t num_expert_group,
                                      int64_t topk_group, int64_t num_fused_shared_experts,
                                      std::optional<double> routed_scaling_factor,
                                      const std::optional<at::Tensor> &num_token_non_padded) {
  return grouped_topk(hidden_states, gating_output, &correction_bias, topk, renormalize,
                      num_expert_group, topk_group, num_fused_shared_experts, routed_scaling_factor,
                      num_token_non_padded, "biased_grouped_topk_cpu");
}

RoutingResult biased_topk_cpu(const at::Tensor &hidden_states, const at::Tensor &gating_output,
                              const at::Tensor &correction_bias, int64_t topk, bool renormalize,
                              const std::string &scoring_func, int64_t num_fused_shared_experts,
                              std::optional<double> routed_scaling_factor,
                              bool apply_routed_scaling_factor_on_output) {
  const char *op = "biased_topk_cpu";
  cpumoe_gating_problem p{};
  const at::Tensor logits = check_logits(&hidden_states, gating_output, p, op);
  const at::Tensor bias = check_bias(correction_bias, p, op);
  TORCH_CHECK(scoring_func == "sigmoid" || scoring_func == "sqrtsoftplus", op,
              ": scoring_func must be 'sigmoid' or 'sqrtsoftplus', got '", scoring_func, "'");
  check_scaling(num_fused_shared_experts, routed_scaling_factor, p, op);
  TORCH_CHECK(!apply_routed_scaling_factor_on_output || routed_scaling_factor.has_value(), op,
              ": apply_routed_scaling_factor_on_output=True needs routed_scaling_factor");
  check_topk(topk, p, op);
  p.score = scoring_func == "sigmoid" ? CPUMOE_SCORE_SIGMOID : CPUMOE_SCORE_SQRTSOFTPLUS;
  p.group_score = CPUMOE_GROUP_MAX;
  p.renormalize = renormalize;
  p.scale_output = apply_routed_scaling_factor_on_output;
  return run(p, op);
}

RoutingResult hash_topk_cpu(const at::Tensor &gating_output, const at::Tensor &tid2eid,
                            int64_t topk, const std::string &scoring_func,
                            int64_t num_fused_shared_experts, int64_t num_experts,
                            double routed_scaling_factor) {
  const char *op = "hash_topk_cpu";
  cpumoe_gating_problem p{};
  const at::Tensor logits = check_logits(nullptr, gating_output, p, op);
  TORCH_CHECK(num_experts == p.E, op, ": num_experts = ", num_experts,
              " must equal gating_output.size(1) = ", p.E);
  TORCH_CHECK(
      scoring_func == "softmax" || scoring_func == "sigmoid" || scoring_func == "sqrtsoftplus", op,
      ": scoring_func must be 'softmax', 'sigmoid' or 'sqrtsoftplus', got '", scoring_func, "'");
  // the factor only weighs a fused shared slot; without one it is not read
  check_scaling(
      num_fused_shared_experts,
      num_fused_shared_experts > 0 ? std::optional<double>(routed_scaling_factor) : std::nullopt, p,
      op);
  TORCH_CHECK(topk >= 1, op, ": topk must be at least 1, got ", topk);
  TORCH_CHECK(p.num_shared == 0 || topk >= 2, op, ": topk = ", topk,
              " leaves no routed slot (num_fused_shared_experts = ", p.num_shared,
              " takes the last slot)");
  p.topk = topk;
  const int64_t routed = topk - (p.num_shared > 0);
  check_cpu_tensor(tid2eid, "tid2eid", op);
  TORCH_CHECK(tid2eid.scalar_type() == at::kInt, op, ": tid2eid must be int32, got ",
              dtype_name(tid2eid.scalar_type()));
  TORCH_CHECK(tid2eid.dim() == 2 && tid2eid.size(0) == p.M && tid2eid.size(1) == routed, op,
              ": tid2eid must have shape [M, ", routed, "] = [gating_output.size(0), topk",
              p.num_shared > 0 ? " - 1" : "", "], got ", tid2eid.sizes());
  const at::Tensor table = tid2eid.contiguous();
  p.tid2eid = table.data_ptr<int32_t>();
  p.score = scoring_func == "softmax"   ? CPUMOE_SCORE_SOFTMAX
            : scoring_func == "sigmoid" ? CPUMOE_SCORE_SIGMOID
                                        : CPUMOE_SCORE_SQRTSOFTPLUS;
  p.group_score = CPUMOE_GROUP_MAX;
  p.renormalize = p.score != CPUMOE_SCORE_SOFTMAX;  // softmax weights already sum to 1 over E
  return run(p, op);
}

}  // namespace cpumoe::bindings
