// Argument checks shared by every op: tensor placement, rank and contiguity, the activation
// dtype and function, the hidden/intermediate size rules, and the translation of torch dtypes and
// C-core status codes. Each failure is a RuntimeError that starts with the op's name and names the
// argument; the messages are listed in docs/ERRORS.md, which tests/test_errors.py keeps exact.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "cpumoe/cpumoe.h"

namespace cpumoe::bindings {

// torch's C++ spelling of a dtype ("BFloat16", "Char"), as the messages print it.
const char *dtype_name(at::ScalarType dtype);

// The C core's code for a dtype the caller has already checked to be one the core knows.
cpumoe_dtype core_dtype(at::ScalarType dtype);

// Raises the C core's message for the calling thread when `status` is not CPUMOE_OK.
void check_status(cpumoe_status status, const char *op);

// `tensor` is defined, on the CPU and strided.
void check_cpu_tensor(const at::Tensor &tensor, const char *name, const char *op);

// check_cpu_tensor, plus exactly `ndim` dimensions and contiguous.
void check_dense(const at::Tensor &tensor, const char *name, const char *op, int64_t ndim);

// The activation dtype of `hidden_states`: bfloat16 or float16.
cpumoe_dtype activation_dtype(const at::Tensor &hidden_states, const char *op);

// The size rules of the C core's MLP: K > 0, K and N multiples of 32.
void check_mlp_sizes(int64_t K, int64_t N, const char *op);

// The activation of fused_experts_cpu and shared_expert_cpu: alpha and limit select the
// clamped swiglu (GPT-OSS), limit alone the clamped silu (DeepSeek-V4; limit >= 0), alpha
// alone is an error; otherwise `activation` names the function applied to the gate half,
// "silu" (also for None) or "gelu". The clamped ones take only None or "silu".
// Sets problem's activation, alpha and limit (unset: 0) from the op's arguments.
void set_activation(cpumoe_moe_problem &problem, std::optional<c10::string_view> activation,
                    std::optional<double> alpha, std::optional<double> limit, const char *op);

// An optional argument that `scheme_label` does not take must be None.
void check_unused(const std::optional<at::Tensor> &tensor, const char *name, const char *op,
                  const char *scheme_label);

}  // namespace cpumoe::bindings
