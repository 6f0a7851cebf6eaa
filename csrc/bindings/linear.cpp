// The dense linear ops (SGLang's schemas, docs/SGLANG.md): weight_packed_linear (bf16/fp16
// weights), int8_scaled_mm_with_quant (INT8 W8A8), fp8_scaled_mm_cpu (FP8 W8A16) and
// int4_scaled_mm_cpu (INT4 W4A8). Each checks its own weight and scale arguments (in the
// order docs/ERRORS.md gives: mat1, out_dtype, the weight, its scales, bias), packs a 16-bit,
// int8 or fp8 weight per call when is_vnni=False with its scheme row's packer (schemes.h),
// and runs cpumoe_linear: the first GEMM of fused_experts on one expert, plus bias.
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "runtime.h"
#include "schemes.h"

namespace cpumoe::bindings {
namespace {

// a >= 0, b >= 1 (block sizes are bounded by check_scale_args)
int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

// mat1 [M, K], bfloat16 or float16, K a positive multiple of 32; any strides (SGLang takes
// rows with a stride): returned contiguous, copied only when it is not.
at::Tensor check_input(const at::Tensor &mat1, const char *name, const char *op) {
  check_cpu_tensor(mat1, name, op);
  TORCH_CHECK(mat1.dim() == 2, op, ": ", name, " must be a 2-D tensor [M, K], got shape ",
              mat1.sizes());
  const at::ScalarType dtype = mat1.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, op, ": ", name,
              " must be bfloat16 or float16, got ", dtype_name(dtype));
  const int64_t K = mat1.size(1);
  TORCH_CHECK(K > 0 && K % 32 == 0, op, ": input features K = ", name, ".size(1) = ", K,
              " must be a positive multiple of 32 (pad ", name, " and the weight with zeros)");
  return mat1.contiguous();
}

// SGLang's int8 and fp8 ops return out_dtype, which must be the activations' dtype.
void check_out_dtype(at::ScalarType out_dtype, const at::Tensor &mat1, const char *op) {
  TORCH_CHECK(out_dtype == mat1.scalar_type(), op, ": out_dtype must be mat1's dtype ",
              dtype_name(mat1.scalar_type()), ", got ", dtype_name(out_dtype));
}

// A dense weight [N, K] of `dtype` (packed: [N, K + the row's extra columns]), N a positive
// multiple of 32; returns it, packed here when !is_vnni. Fills N and w of `problem`.
at::Tensor prepare_weight(const SchemeTraits &scheme, const at::Tensor &weight, const char *name,
                          at::ScalarType dtype, bool is_vnni, cpumoe_linear_problem &problem,
                          const char *op) {
  check_cpu_tensor(weight, name, op);
  TORCH_CHECK(weight.dim() == 2, op, ": ", name, " must be a 2-D tensor [N, K], got shape ",
              weight.sizes());
  // SGLang's packer turns a weight of fewer than 16 rows into a float32 [K, N] copy for a
  // path of its own; here the weights run on the MoE kernels, which take 32-row tiles
  const bool small_oc_copy = weight.scalar_type() == at::kFloat;
  TORCH_CHECK(weight.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype),
              " for ", scheme.name, " weights, got ", dtype_name(weight.scalar_type()),
              small_oc_copy ? " (the float32 [K, N] copy convert_weight_packed makes of a weight "
                              "with fewer than 16 rows is not supported: pad such a weight to "
                              "32 rows with zeros)"
                            : "");
  const int64_t cols = problem.K + (is_vnni ? scheme.packed_extra_cols : 0);
  TORCH_CHECK(weight.size(1) == cols, op, ": ", name, " must have ", cols,
              " columns (K = ", problem.K,
              is_vnni && scheme.packed_extra_cols ? " plus 4 bytes of compensation, as "
                                                    "convert_weight_packed packs it)"
                                                  : ")",
              ", got shape ", weight.sizes());
  const int64_t N = weight.size(0);
  TORCH_CHECK(N > 0 && N % 32 == 0, op, ": ", name, " has ", N,
              " rows (output features); they must be a positive multiple of 32 (pad the weight "
              "with zero rows)");
  TORCH_CHECK(weight.is_contiguous(), op, ": ", name, " must be contiguous");
  problem.N = N;
  at::Tensor packed = is_vnni ? weight : scheme.pack(weight, op);
  problem.w = packed.data_ptr();
  return packed;
}

// A float32 scale tensor of `expected` shape, contiguous.
const float *check_scale(const at::Tensor &scale, const char *name, c10::IntArrayRef expected,
                         const char *what, const char *op) {
  check_cpu_tensor(scale, name, op);
  TORCH_CHECK(scale.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(scale.scalar_type()));
  TORCH_CHECK(scale.sizes() == expected, op, ": ", name, " must have shape ", expected, " (", what,
              "), got ", scale.sizes());
  TORCH_CHECK(scale.is_contiguous(), op, ": ", name, " must be contiguous");
  return scale.data_ptr<float>();
}

// bias [N] (float32, or bfloat16/float16: widened exactly), or None.
at::Tensor check_bias(const std::optional<at::Tensor> &bias, int64_t N, const char *op) {
  if (!bias.has_value()) return at::Tensor();
  check_cpu_tensor(*bias, "bias", op);
  const at::ScalarType dtype = bias->scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": bias must be float32, bfloat16 or float16, got ", dtype_name(dtype));
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [", N,
              "] (one value per output feature), got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// Allocates out [M, N] in x's dtype and runs the checked problem.
at::Tensor run(cpumoe_linear_problem &problem, const at::Tensor &x,
               const std::optional<at::Tensor> &bias, const char *op) {
  const at::Tensor bias32 = check_bias(bias, problem.N, op);
  at::Tensor out = at::empty({problem.M, problem.N}, x.options());
  problem.x = x.data_ptr();
  problem.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  problem.out = out.data_ptr();
  run_linear_problem(problem, op);
  return out;
}

// The problem's sizes and activation dtype from checked activations.
cpumoe_linear_problem problem_for(const at::Tensor &x, cpumoe_scheme scheme) {
  cpumoe_linear_problem problem{};
  problem.M = x.size(0), problem.K = x.size(1);
  problem.scheme = scheme;
  problem.act_dtype = core_dtype(x.scalar_type());
  return problem;
}

}  // namespace

at::Tensor weight_packed_linear(const at::Tensor &mat1, const at::Tensor &mat2,
                                const std::optional<at::Tensor> &bias, bool is_vnni) {
  const char *op = "weight_packed_linear";
  const at::Tensor x = check_input(mat1, "mat1", op);
  const SchemeTraits &scheme = scheme_for_method(CPUMOE_SCHEME_UNQUANT, op);
  cpumoe_linear_problem problem = problem_for(x, scheme.scheme);
  const at::Tensor w = prepare_weight(scheme, mat2, "mat2", x.scalar_type(), is_vnni, problem, op);
  return run(problem, x, bias, op);
}

at::Tensor int8_scaled_mm_with_quant(const at::Tensor &mat1, const at::Tensor &mat2,
                                     const at::Tensor &scales2,
                                     const std::optional<at::Tensor> &bias,
                                     at::ScalarType out_dtype, bool is_vnni) {
  const char *op = "int8_scaled_mm_with_quant";
  const at::Tensor x = check_input(mat1, "mat1", op);
  check_out_dtype(out_dtype, x, op);
  const SchemeTraits &scheme = scheme_for_method(CPUMOE_SCHEME_INT8_W8A8, op);
  cpumoe_linear_problem problem = problem_for(x, scheme.scheme);
  TORCH_CHECK(problem.K <= 65536, op, ": mat1 has K=", problem.K,
              " input features; int8 sums K products exactly in int32 only up to K = 65536");
  const at::Tensor w = prepare_weight(scheme, mat2, "mat2", at::kChar, is_vnni, problem, op);
  // as SGLang: one scale per output feature, checked by count ([N] or [N, 1])
  check_cpu_tensor(scales2, "scales2", op);
  TORCH_CHECK(scales2.scalar_type() == at::kFloat, op, ": scales2 must be float32, got ",
              dtype_name(scales2.scalar_type()));
  TORCH_CHECK(scales2.numel() == problem.N, op,
              ": scales2 must hold one scale per output feature (", problem.N,
              " values), got shape ", scales2.sizes());
  TORCH_CHECK(scales2.is_contiguous(), op, ": scales2 must be contiguous");
  problem.w_scale = scales2.data_ptr<float>();
  return run(problem, x, bias, op);
}

at::Tensor fp8_scaled_mm_cpu(const at::Tensor &mat1, const at::Tensor &mat2,
                             const at::Tensor &scales2, at::IntArrayRef block_size,
                             const std::optional<at::Tensor> &bias, at::ScalarType out_dtype,
                             bool is_vnni) {
  const char *op = "fp8_scaled_mm_cpu";
  const at::Tensor x = check_input(mat1, "mat1", op);
  check_out_dtype(out_dtype, x, op);
  const SchemeTraits &scheme = scheme_for_method(CPUMOE_SCHEME_FP8_W8A16, op);
  cpumoe_linear_problem problem = problem_for(x, scheme.scheme);
  std::tie(problem.block_n, problem.block_k) =
      check_scale_args(scheme, scheme.name, scales2, scales2, block_size, op);
  const at::Tensor w =
      prepare_weight(scheme, mat2, "mat2", at::kFloat8_e4m3fn, is_vnni, problem, op);
  const std::vector<int64_t> blocks{ceil_div(problem.N, problem.block_n),
                                    ceil_div(problem.K, problem.block_k)};
  problem.w_scale =
      check_scale(scales2, "scales2", blocks, "ceil(N / block_n), ceil(K / block_k)", op);
  return run(problem, x, bias, op);
}

at::Tensor int4_scaled_mm_cpu(const at::Tensor &x_in, const at::Tensor &w,
                              const at::Tensor &w_zeros, const at::Tensor &w_scales,
                              const std::optional<at::Tensor> &bias) {
  const char *op = "int4_scaled_mm_cpu";
  const at::Tensor x = check_input(x_in, "x", op);
  cpumoe_linear_problem problem = problem_for(x, CPUMOE_SCHEME_INT4_W4A8);
  const int64_t K = problem.K;
  // as SGLang: N from the scales [N/32, groups, 32] (convert_weight_packed_scale_zp's)
  check_cpu_tensor(w_scales, "w_scales", op);
  TORCH_CHECK(
      w_scales.dim() == 3 && w_scales.size(0) > 0 && w_scales.size(1) > 0 && w_scales.size(2) == 32,
      op,
      ": w_scales must have shape [out_features/32, groups, 32] (from "
      "convert_weight_packed_scale_zp), got ",
      w_scales.sizes());
  problem.N = w_scales.size(0) * 32;
  const int64_t groups = w_scales.size(1);
  TORCH_CHECK(K % groups == 0, op, ": w_scales has ", groups,
              " groups, which do not divide the K = ", K, " input features of x");
  problem.w_group = K / groups;
  const int64_t bk = cpumoe_int4_block_k(problem.w_group);
  TORCH_CHECK(bk > 0, op, ": group size ", problem.w_group, " (K = ", K, " / ", groups,
              " groups in w_scales) is not supported: int4 needs a multiple of 4 that is at "
              "most 128, or a multiple of 128");
  problem.w_scale =
      check_scale(w_scales, "w_scales", w_scales.sizes(), "out_features/32, groups, 32", op);
  check_cpu_tensor(w_zeros, "w_zeros", op);
  TORCH_CHECK(w_zeros.scalar_type() == at::kChar, op, ": w_zeros must be int8, got ",
              dtype_name(w_zeros.scalar_type()));
  TORCH_CHECK(w_zeros.sizes() == w_scales.sizes(), op, ": w_zeros must have the shape of w_scales ",
              w_scales.sizes(), ", got ", w_zeros.sizes());
  TORCH_CHECK(w_zeros.is_contiguous(), op, ": w_zeros must be contiguous");
  problem.w_zero = w_zeros.data_ptr<int8_t>();
  check_cpu_tensor(w, "w", op);
  TORCH_CHECK(w.scalar_type() == at::kByte, op, ": w must be uint8, got ",
              dtype_name(w.scalar_type()));
  const std::vector<int64_t> packed{problem.N / 32, K / bk, 16 * bk + 128};
  const c10::IntArrayRef expected(packed);
  TORCH_CHECK(w.sizes() == expected, op, ": w must have shape ", expected,
              " (packed by convert_weight_packed_scale_zp, group size ", problem.w_group, "), got ",
              w.sizes());
  TORCH_CHECK(w.is_contiguous(), op, ": w must be contiguous");
  problem.w = w.data_ptr();
  return run(problem, x, bias, op);
}

}  // namespace cpumoe::bindings
