// Argument checks shared by every op (declared in checks.h, messages in docs/ERRORS.md).
#include "checks.h"

#include <string>

namespace cpumoe::bindings {

const char *dtype_name(at::ScalarType dtype) {
  return c10::toString(dtype);
}

cpumoe_dtype core_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return CPUMOE_DTYPE_BF16;
    case at::kHalf: return CPUMOE_DTYPE_F16;
    case at::kFloat: return CPUMOE_DTYPE_F32;
    case at::kDouble: return CPUMOE_DTYPE_F64;
    case at::kChar: return CPUMOE_DTYPE_I8;
    case at::kByte: return CPUMOE_DTYPE_U8;
    case at::kFloat8_e4m3fn: return CPUMOE_DTYPE_F8E4M3;
    case at::kInt: return CPUMOE_DTYPE_I32;
    case at::kLong: return CPUMOE_DTYPE_I64;
    default: TORCH_INTERNAL_ASSERT(false, "no C-core dtype for ", dtype_name(dtype));
  }
}

void check_status(cpumoe_status status, const char *op) {
  TORCH_CHECK(status == CPUMOE_OK, op, ": ", cpumoe_last_error());
}

void check_cpu_tensor(const at::Tensor &tensor, const char *name, const char *op) {
  TORCH_CHECK(tensor.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(tensor.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ",
              tensor.device());
  TORCH_CHECK(tensor.layout() == at::kStrided, op, ": ", name, " must be a dense (strided) tensor");
}

void check_dense(const at::Tensor &tensor, const char *name, const char *op, int64_t ndim) {
  check_cpu_tensor(tensor, name, op);
  TORCH_CHECK(tensor.dim() == ndim, op, ": ", name, " must be a ", ndim, "-D tensor, got shape ",
              tensor.sizes());
  TORCH_CHECK(tensor.is_contiguous(), op, ": ", name, " must be contiguous");
}

cpumoe_dtype activation_dtype(const at::Tensor &hidden_states, const char *op) {
  const at::ScalarType dtype = hidden_states.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": hidden_states must be bfloat16 or float16, got ", dtype_name(dtype));
  return core_dtype(dtype);
}

void check_mlp_sizes(int64_t K, int64_t N, const char *op) {
  TORCH_CHECK(K > 0, op, ": hidden size K = hidden_states.size(1) must be positive, got 0");
  TORCH_CHECK(K % 32 == 0, op, ": hidden size K=", K,
              " must be a multiple of 32 (pad hidden_states, w1 and w2 with zeros)");
  TORCH_CHECK(
      N % 32 == 0, op, ": intermediate size N=", N,
      " (w1.size(-2) / 2) must be a multiple of 32 (pad w1 rows and w2 columns with zeros)");
}

void check_unused(const std::optional<at::Tensor> &tensor, const char *name, const char *op,
                  const char *scheme_label) {
  TORCH_CHECK(!tensor.has_value(), op, ": ", name, " must be None for ", scheme_label);
}

namespace {

cpumoe_activation parse_activation(std::optional<c10::string_view> activation,
                                   std::optional<double> alpha, std::optional<double> limit,
                                   const char *op) {
  TORCH_CHECK(!alpha.has_value() || limit.has_value(), op,
              ": alpha needs limit (alpha and limit select the clamped swiglu activation, limit "
              "alone the clamped silu); got only alpha");
  const std::string name = activation.has_value() ? std::string(*activation) : "silu";
  TORCH_CHECK(name == "silu" || name == "gelu", op, ": Unsupported activation '", name,
              "' (expected 'silu' or 'gelu')");
  if (!limit.has_value()) return name == "gelu" ? CPUMOE_ACT_GELU_MUL : CPUMOE_ACT_SILU_MUL;
  const char *clamped = alpha.has_value() ? "alpha and limit select the clamped swiglu"
                                          : "limit without alpha selects the clamped silu";
  TORCH_CHECK(name == "silu", op, ": ", clamped,
              ", which replaces the activation; activation must be None or 'silu' with ",
              alpha.has_value() ? "them" : "it", ", got '", name, "'");
  if (alpha.has_value()) return CPUMOE_ACT_SWIGLU_CLAMP;
  // the C core checks this too; here it also holds for M == 0, which never reaches the core
  TORCH_CHECK(static_cast<float>(*limit) >= 0.0f, op,
              ": limit must be >= 0 (not NaN) for the clamped silu (limit without alpha), got ",
              *limit);
  return CPUMOE_ACT_SILU_CLAMP;
}

}  // namespace

void set_activation(cpumoe_moe_problem &problem, std::optional<c10::string_view> activation,
                    std::optional<double> alpha, std::optional<double> limit, const char *op) {
  problem.activation = parse_activation(activation, alpha, limit, op);
  problem.alpha = alpha.has_value() ? static_cast<float>(*alpha) : 0.0f;
  problem.limit = limit.has_value() ? static_cast<float>(*limit) : 0.0f;
}

}  // namespace cpumoe::bindings
