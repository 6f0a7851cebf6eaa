// The per-scheme trait table (kSchemes, at the end) and each scheme's functions: the checks
// of its weights and scales, their description to the C core, and its packer. Everything
// that differs between schemes lives here; the ops (fused_experts.cpp, shared_expert.cpp,
// packers.cpp) only read rows. Layouts: docs/FORMATS.md; messages: docs/ERRORS.md.
#include "schemes.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include "checks.h"
#include "runtime.h"

namespace cpumoe::bindings {
namespace {

// a >= 0, b >= 1; no a + b - 1, which overflows for block sizes near INT64_MAX.
int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

// E of an expert bank's w1 [E, ...]: at least one.
int64_t expert_count(const at::Tensor &w1, const char *op) {
  TORCH_CHECK(w1.size(0) > 0, op, ": w1 must hold at least one expert, got shape ", w1.sizes());
  return w1.size(0);
}

// ---- dense weights: [..., OC, IC], packed by convert_weight_packed ----------------------

// The C packers' view of [..., OC, IC] weights: a 2-D weight is one expert.
struct PackedMatrices {
  int64_t experts, rows, cols;
};

PackedMatrices packed_matrices(const at::Tensor &weight) {
  return {weight.dim() == 3 ? weight.size(0) : 1, weight.size(-2), weight.size(-1)};
}

// bf16/fp16: VNNI-2, same shape.
at::Tensor pack_vnni2_16bit(const at::Tensor &weight, const char *op) {
  const PackedMatrices m = packed_matrices(weight);
  const cpumoe_runner runner = aten_runner();
  at::Tensor packed = new_huge_page_tensor(weight.sizes(), weight.options());
  check_status(cpumoe_pack_vnni2_16bit(static_cast<const uint16_t *>(weight.data_ptr()),
                                       static_cast<uint16_t *>(packed.data_ptr()), m.experts,
                                       m.rows, m.cols, &runner),
               op);
  return packed;
}

// fp8 e4m3: the VNNI-2 order of 8-bit elements, same shape.
at::Tensor pack_vnni2_fp8(const at::Tensor &weight, const char *op) {
  const PackedMatrices m = packed_matrices(weight);
  const cpumoe_runner runner = aten_runner();
  at::Tensor packed = new_huge_page_tensor(weight.sizes(), weight.options());
  check_status(cpumoe_pack_vnni2_8bit(static_cast<const uint8_t *>(weight.data_ptr()),
                                      static_cast<uint8_t *>(packed.data_ptr()), m.experts, m.rows,
                                      m.cols, &runner),
               op);
  return packed;
}

// A packed int8 row ends in its int32 compensation (cpumoe_pack_vnni4_int8).
constexpr int64_t kInt8CompensationBytes = 4;

// int8: VNNI-4 plus compensation, [..., OC, IC + 4].
at::Tensor pack_vnni4_int8(const at::Tensor &weight, const char *op) {
  const PackedMatrices m = packed_matrices(weight);
  const cpumoe_runner runner = aten_runner();
  std::vector<int64_t> shape(weight.sizes().begin(), weight.sizes().end());
  shape.back() += kInt8CompensationBytes;
  at::Tensor packed = new_huge_page_tensor(shape, weight.options());
  check_status(cpumoe_pack_vnni4_int8(weight.data_ptr<int8_t>(), packed.data_ptr<int8_t>(),
                                      m.experts, m.rows, m.cols, &runner),
               op);
  return packed;
}

// mxfp4: uint8 [..., OC, IC/2] codes, blocks of 32 rows (cpumoe_pack_mxfp4), same shape.
at::Tensor pack_mxfp4(const at::Tensor &weight, const char *op) {
  const PackedMatrices m = packed_matrices(weight);
  const cpumoe_runner runner = aten_runner();
  at::Tensor packed = new_huge_page_tensor(weight.sizes(), weight.options());
  check_status(cpumoe_pack_mxfp4(weight.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), m.experts,
                                 m.rows, m.cols, &runner),
               op);
  return packed;
}

// Checks w1 or w2 against the scheme's dtype and its logical shape [..., OC, IC] (the tensor:
// [..., OC, IC / weights_per_element], packed: + packed_extra_cols); packs an unpacked weight
// (is_vnni=False) on the way.
at::Tensor prepare_weight(const SchemeTraits &scheme, const WeightOperands &operands,
                          const at::Tensor &weight, const char *name, std::vector<int64_t> shape) {
  const char *op = operands.op;
  check_cpu_tensor(weight, name, op);
  shape.back() /= scheme.weights_per_element;
  if (operands.is_vnni) shape.back() += scheme.packed_extra_cols;
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(weight.dim() == static_cast<int64_t>(shape.size()), op, ": ", name, " must be a ",
              shape.size(), "-D tensor ", expected, ", got shape ", weight.sizes());
  const at::ScalarType dtype = scheme.weight_dtype_for(operands.activation_dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype),
              " for ", operands.label, ", got ", dtype_name(weight.scalar_type()));
  const bool packed_wider = operands.is_vnni && scheme.packed_extra_cols != 0;
  TORCH_CHECK(weight.sizes() == expected, op, ": ", name, " must have shape ", expected,
              packed_wider ? " (packed by convert_weight_packed)" : "", ", got ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), op, ": ", name, " must be contiguous");
  return operands.is_vnni ? weight : scheme.pack(weight, op);
}

// w1 [E, 2N, K], w2 [E, K, N]: E and N come from w1.
DescribedWeights describe_dense_experts(const SchemeTraits &scheme, const WeightOperands &operands,
                                        cpumoe_moe_problem &problem) {
  const at::Tensor &w1 = operands.w1;
  const char *op = operands.op;
  TORCH_CHECK(w1.dim() == 3, op, ": w1 must be a 3-D tensor [E, 2N, K], got shape ", w1.sizes());
  const int64_t E = expert_count(w1, op), N = w1.size(1) / 2;
  TORCH_CHECK(w1.size(1) % 2 == 0 && N > 0, op,
              ": w1.size(1) must be 2N (gate and up rows), a positive even number, got ",
              w1.size(1));
  check_mlp_sizes(problem.K, N, op);
  problem.E = E, problem.N = N;
  return describe_dense_weights(scheme, operands, {E}, problem);
}

// ---- scales of dense weights ----------------------------------------------------------

// bf16/fp16 weights have none; check_scale_args has made sure none were passed.
void describe_no_scales(const SchemeTraits & /*scheme*/, const WeightOperands & /*operands*/,
                        const std::vector<int64_t> & /*lead*/, cpumoe_moe_problem & /*problem*/) {}

// One fp32 scale per output channel, `numel` in all. The check is on the element count, as
// in SGLang, whose callers pass [E, OC, 1]; [E, OC] works too.
const float *channel_scale(const SchemeTraits &scheme, const std::optional<at::Tensor> &scale,
                           const char *name, const char *op, int64_t numel) {
  TORCH_CHECK(scale.has_value(), op, ": missing ", name, " for ", scheme.name,
              " (float32 per output channel scales, ", numel, " values)");
  check_cpu_tensor(*scale, name, op);
  TORCH_CHECK(scale->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(scale->scalar_type()));
  TORCH_CHECK(scale->numel() == numel, op, ": ", name, " must hold one scale per output channel (",
              numel, " values), got shape ", scale->sizes());
  TORCH_CHECK(scale->is_contiguous(), op, ": ", name, " must be contiguous");
  return scale->data_ptr<float>();
}

void describe_channel_scales(const SchemeTraits &scheme, const WeightOperands &operands,
                             const std::vector<int64_t> &lead, cpumoe_moe_problem &problem) {
  int64_t experts = 1;
  for (int64_t d : lead) experts *= d;
  problem.w1_scale =
      channel_scale(scheme, operands.w1_scale, "w1_scale", operands.op, experts * 2 * problem.N);
  problem.w2_scale =
      channel_scale(scheme, operands.w2_scale, "w2_scale", operands.op, experts * problem.K);
}

// block_size = [block_n, block_k], two positive ints, block_k even; None means per-tensor
// scales: one block as large as any matrix.
constexpr int64_t kPerTensorBlock = int64_t{1} << 62;  // even, beyond any K, N <= 2^30

std::pair<int64_t, int64_t> parse_block_size(at::OptionalIntArrayRef block_size, const char *op) {
  if (!block_size.has_value()) return {kPerTensorBlock, kPerTensorBlock};
  TORCH_CHECK(block_size->size() == 2, op,
              ": expect block_size to have 2 values [block_n, block_k], got ", block_size->size());
  const int64_t bn = (*block_size)[0], bk = (*block_size)[1];
  TORCH_CHECK(bn >= 1 && bk >= 1, op, ": block_size values must be positive, got [", bn, ", ", bk,
              "]");
  // larger blocks mean one block anyway; the C core's block arithmetic needs the bound
  TORCH_CHECK(bn <= INT32_MAX && bk <= INT32_MAX, op,
              ": block_size values must be at most 2^31 - 1, got [", bn, ", ", bk, "]");
  TORCH_CHECK(bk % 2 == 0, op, ": block_size[1] (block_k) = ", bk,
              " must be even: the packed layout pairs consecutive k, so a pair cannot straddle "
              "two scale blocks");
  return {bn, bk};
}

// A 2-D block scale: fp32 `shape` = [lead..., ceil(OC / block_n), ceil(IC / block_k)].
const float *block_scale(const SchemeTraits &scheme, const std::optional<at::Tensor> &scale,
                         const char *name, const char *op, const std::vector<int64_t> &shape) {
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(scale.has_value(), op, ": missing ", name, " for ", scheme.name,
              " (float32 block scales of shape ", expected, ")");
  check_cpu_tensor(*scale, name, op);
  TORCH_CHECK(scale->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(scale->scalar_type()));
  TORCH_CHECK(scale->sizes() == expected, op, ": ", name, " must have shape ", expected,
              " (ceil(out_features / block_n), ceil(in_features / block_k)), got ", scale->sizes());
  TORCH_CHECK(scale->is_contiguous(), op, ": ", name, " must be contiguous");
  return scale->data_ptr<float>();
}

// Per-tensor scales (block_size None): one fp32 scale per matrix, shaped `lead` ([E] for
// an expert bank, [] for the shared expert) as SGLang's callers pass them, or with two
// trailing ones ([E, 1, 1], the block form of one block).
const float *tensor_scale(const SchemeTraits &scheme, const std::optional<at::Tensor> &scale,
                          const char *name, const char *op, const std::vector<int64_t> &lead) {
  const c10::IntArrayRef expected(lead);
  TORCH_CHECK(scale.has_value(), op, ": missing ", name, " for ", scheme.name,
              " (block_size is None: float32 per-tensor scales of shape ", expected, ")");
  check_cpu_tensor(*scale, name, op);
  TORCH_CHECK(scale->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(scale->scalar_type()));
  std::vector<int64_t> blocked = lead;
  blocked.insert(blocked.end(), {1, 1});
  TORCH_CHECK(scale->sizes() == expected || scale->sizes() == c10::IntArrayRef(blocked), op, ": ",
              name, " must have shape ", expected,
              " (one scale per matrix: block_size is None, "
              "so the scales are per tensor; pass block_size for block scales), got ",
              scale->sizes());
  TORCH_CHECK(scale->is_contiguous(), op, ": ", name, " must be contiguous");
  return scale->data_ptr<float>();
}

void describe_block_scales(const SchemeTraits &scheme, const WeightOperands &operands,
                           const std::vector<int64_t> &lead, cpumoe_moe_problem &problem) {
  if (problem.block_n == kPerTensorBlock) {
    problem.w1_scale = tensor_scale(scheme, operands.w1_scale, "w1_scale", operands.op, lead);
    problem.w2_scale = tensor_scale(scheme, operands.w2_scale, "w2_scale", operands.op, lead);
    return;
  }
  auto blocks = [&](int64_t rows, int64_t cols) {
    std::vector<int64_t> shape = lead;
    shape.push_back(ceil_div(rows, problem.block_n));
    shape.push_back(ceil_div(cols, problem.block_k));
    return shape;
  };
  problem.w1_scale = block_scale(scheme, operands.w1_scale, "w1_scale", operands.op,
                                 blocks(2 * problem.N, problem.K));
  problem.w2_scale =
      block_scale(scheme, operands.w2_scale, "w2_scale", operands.op, blocks(problem.K, problem.N));
}

// MXFP4: one e8m0 exponent byte per output channel and 32 input features, uint8
// `shape` = [lead..., OC, IC / 32], in convert_scale_packed's order (the order is not
// checkable: SGLang's kernels read it the same way whatever is_vnni says of the weights).
const uint8_t *e8m0_scale(const SchemeTraits &scheme, const std::optional<at::Tensor> &scale,
                          const char *name, const char *op, const std::vector<int64_t> &shape) {
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(scale.has_value(), op, ": missing ", name, " for ", scheme.name,
              " (uint8 e8m0 scales of shape ", expected, ", packed by convert_scale_packed)");
  check_cpu_tensor(*scale, name, op);
  TORCH_CHECK(scale->scalar_type() == at::kByte, op, ": ", name,
              " must be uint8 (e8m0 exponents) for ", scheme.name, ", got ",
              dtype_name(scale->scalar_type()));
  TORCH_CHECK(scale->sizes() == expected, op, ": ", name, " must have shape ", expected,
              " (out_features, in_features / 32), got ", scale->sizes());
  TORCH_CHECK(scale->is_contiguous(), op, ": ", name, " must be contiguous");
  return scale->data_ptr<uint8_t>();
}

void describe_e8m0_scales(const SchemeTraits &scheme, const WeightOperands &operands,
                          const std::vector<int64_t> &lead, cpumoe_moe_problem &problem) {
  auto groups = [&](int64_t rows, int64_t cols) {
    std::vector<int64_t> shape = lead;
    shape.push_back(rows);
    shape.push_back(cols / 32);
    return shape;
  };
  problem.w1_scale_e8m0 = e8m0_scale(scheme, operands.w1_scale, "w1_scale", operands.op,
                                     groups(2 * problem.N, problem.K));
  problem.w2_scale_e8m0 =
      e8m0_scale(scheme, operands.w2_scale, "w2_scale", operands.op, groups(problem.K, problem.N));
}

// ---- INT4 W4A8 ------------------------------------------------------------------------
// Packed by convert_weight_packed_scale_zp (docs/FORMATS.md): per expert, a weight of OC
// output and IC input features is uint8 [OC/32, IC/bk, 16*bk + 128] (bk = min(group, 128)),
// its scales fp32 and zero points int8 [OC/32, IC/group, 32].

struct Int4Operand {
  const float *scale;
  const int8_t *zero;
  int64_t group;
};

// An INT4 scale or zero tensor: present, `dtype`, 4-D [E, OC/32, groups, 32], contiguous.
void check_int4_group_tensor(const std::optional<at::Tensor> &tensor, const char *name,
                             at::ScalarType dtype, int64_t E, const WeightOperands &operands) {
  const char *op = operands.op;
  TORCH_CHECK(tensor.has_value(), op, ": missing ", name, " for ", operands.label,
              ": pass the tensors returned by convert_weight_packed_scale_zp (w*_scale = its "
              "scales, w*_zero = its qzeros)");
  check_cpu_tensor(*tensor, name, op);
  TORCH_CHECK(tensor->scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype),
              " for ", operands.label, ", got ", dtype_name(tensor->scalar_type()));
  TORCH_CHECK(tensor->dim() == 4 && tensor->size(0) == E && tensor->size(3) == 32 &&
                  tensor->size(1) > 0 && tensor->size(2) > 0,
              op, ": ", name, " must have shape [E=", E,
              ", out_features/32, groups, 32] (from convert_weight_packed_scale_zp), got ",
              tensor->sizes());
  TORCH_CHECK(tensor->is_contiguous(), op, ": ", name, " must be contiguous");
}

// One packed INT4 weight [E, OC/32, IC/bk, 16 bk + 128] against its scale and zero tensors;
// returns their pointers and the group size.
Int4Operand check_int4_weight(const at::Tensor &weight, const char *weight_name,
                              const std::optional<at::Tensor> &scale, const char *scale_name,
                              const std::optional<at::Tensor> &zero, const char *zero_name,
                              int64_t E, int64_t oc, int64_t ic, const WeightOperands &operands) {
  const char *op = operands.op;
  check_int4_group_tensor(scale, scale_name, at::kFloat, E, operands);
  check_int4_group_tensor(zero, zero_name, at::kChar, E, operands);
  TORCH_CHECK(zero->sizes() == scale->sizes(), op, ": ", zero_name, " must have the shape of ",
              scale_name, " ", scale->sizes(), ", got ", zero->sizes());
  TORCH_CHECK(scale->size(1) * 32 == oc, op, ": ", scale_name, " has ", scale->size(1),
              " blocks of 32 output features, expected ", oc, " / 32 = ", oc / 32);
  const int64_t groups = scale->size(2);
  TORCH_CHECK(ic % groups == 0, op, ": ", scale_name, " has ", groups,
              " groups, which do not divide the ", ic, " input features of ", weight_name);
  const int64_t group = ic / groups, bk = cpumoe_int4_block_k(group);
  TORCH_CHECK(bk > 0, op, ": ", weight_name, " has group size ", group, " (", ic,
              " input features / ", groups,
              " groups); int4 needs a multiple of 4 that is at most 128, or a multiple of 128");
  const std::vector<int64_t> shape{E, oc / 32, ic / bk, 16 * bk + 128};
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(weight.scalar_type() == at::kByte, op, ": ", weight_name, " must be uint8 for ",
              operands.label, ", got ", dtype_name(weight.scalar_type()));
  TORCH_CHECK(weight.sizes() == expected, op, ": ", weight_name, " must have shape ", expected,
              " (packed by convert_weight_packed_scale_zp, group size ", group, "), got ",
              weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), op, ": ", weight_name, " must be contiguous");
  return {scale->data_ptr<float>(), zero->data_ptr<int8_t>(), group};
}

// w1 [E, 2N/32, K/bk, 16 bk + 128], w2 likewise over N: N comes from the scales, as in SGLang.
DescribedWeights describe_int4_experts(const SchemeTraits & /*scheme*/,
                                       const WeightOperands &operands,
                                       cpumoe_moe_problem &problem) {
  const at::Tensor &w1 = operands.w1, &w2 = operands.w2;
  const char *op = operands.op;
  TORCH_CHECK(operands.is_vnni, op, ": ", operands.label,
              " needs w1/w2 packed by convert_weight_packed_scale_zp and is_vnni=True (there is "
              "no unpacked int4 weight format)");
  TORCH_CHECK(w1.dim() == 4 && w2.dim() == 4, op,
              ": int4 w1 and w2 must be 4-D [E, out_features/32, in_features/bk, 16*bk+128] "
              "(from convert_weight_packed_scale_zp), got shapes ",
              w1.sizes(), " and ", w2.sizes());
  const int64_t E = expert_count(w1, op), K = problem.K;
  check_int4_group_tensor(operands.w1_scale, "w1_scale", at::kFloat, E, operands);
  const int64_t w1_blocks = operands.w1_scale->size(1);
  TORCH_CHECK(w1_blocks % 2 == 0, op,
              ": w1_scale must cover 2N output features (gate and up) in blocks of 32, got ",
              w1_blocks, " blocks");
  const int64_t N = w1_blocks * 32 / 2;
  check_mlp_sizes(K, N, op);
  const Int4Operand q1 = check_int4_weight(w1, "w1", operands.w1_scale, "w1_scale",
                                           operands.w1_zero, "w1_zero", E, 2 * N, K, operands);
  const Int4Operand q2 = check_int4_weight(w2, "w2", operands.w2_scale, "w2_scale",
                                           operands.w2_zero, "w2_zero", E, K, N, operands);
  problem.E = E, problem.N = N;
  problem.w1 = w1.data_ptr(), problem.w2 = w2.data_ptr();
  problem.w1_scale = q1.scale, problem.w2_scale = q2.scale;
  problem.w1_zero = q1.zero, problem.w2_zero = q2.zero;
  problem.w1_group = q1.group, problem.w2_group = q2.group;
  return {w1, w2};
}

// ---- the table ------------------------------------------------------------------------
// Row i describes moe_comp_method i (SGLang's numbering, docs/SGLANG.md).

constexpr SchemeTraits kSchemes[] = {
    {
        .scheme = CPUMOE_SCHEME_UNQUANT,
        .name = "bf16/fp16",
        .label = "moe_comp_method 0 (bf16/fp16 weights)",
        .weight_dtypes = {at::kBFloat16, at::kHalf},
        .weights_match_activations = true,
        .scales = ScaleKind::kNone,
        .takes_block_size = false,
        .shared_expert = {.supported = true,
                          .use_int8_w8a8 = false,
                          .use_fp8_w8a16 = false,
                          .use_mxfp4 = false,
                          .label = "bf16/fp16 weights (use_int8_w8a8 and use_fp8_w8a16 False)"},
        .packed_extra_cols = 0,
        .pack_row_multiple = 16,
        .pack = pack_vnni2_16bit,
        .describe_dense_scales = describe_no_scales,
        .describe_experts = describe_dense_experts,
    },
    {
        .scheme = CPUMOE_SCHEME_INT8_W8A8,
        .name = "int8 w8a8",
        .label = "moe_comp_method 1 (int8 w8a8)",
        .weight_dtypes = {at::kChar, at::ScalarType::Undefined},
        .weights_match_activations = false,
        .scales = ScaleKind::kPerChannel,
        .takes_block_size = false,
        .shared_expert = {.supported = true,
                          .use_int8_w8a8 = true,
                          .use_fp8_w8a16 = false,
                          .use_mxfp4 = false,
                          .label = "use_int8_w8a8=True (int8 w8a8)"},
        .packed_extra_cols = kInt8CompensationBytes,
        .pack_row_multiple = 32,
        .pack = pack_vnni4_int8,
        .describe_dense_scales = describe_channel_scales,
        .describe_experts = describe_dense_experts,
    },
    {
        .scheme = CPUMOE_SCHEME_FP8_W8A16,
        .name = "fp8 w8a16",
        .label = "moe_comp_method 2 (fp8 w8a16)",
        .weight_dtypes = {at::kFloat8_e4m3fn, at::ScalarType::Undefined},
        .weights_match_activations = false,
        .scales = ScaleKind::kBlock2D,
        .takes_block_size = true,
        .shared_expert = {.supported = true,
                          .use_int8_w8a8 = false,
                          .use_fp8_w8a16 = true,
                          .use_mxfp4 = false,
                          .label = "use_fp8_w8a16=True (fp8 w8a16)"},
        .packed_extra_cols = 0,
        .pack_row_multiple = 16,
        .pack = pack_vnni2_fp8,
        .describe_dense_scales = describe_block_scales,
        .describe_experts = describe_dense_experts,
    },
    {
        .scheme = CPUMOE_SCHEME_INT4_W4A8,
        .name = "int4 w4a8",
        .label = "moe_comp_method 3 (int4 w4a8)",
        // uint8 is also mxfp4's dtype: convert_weight_packed packs uint8 weights as mxfp4
        .weight_dtypes = {at::kByte, at::ScalarType::Undefined},
        .weights_match_activations = false,
        .scales = ScaleKind::kGroupWithZeros,
        .takes_block_size = false,
        .shared_expert = {.supported = false,
                          .use_int8_w8a8 = false,
                          .use_fp8_w8a16 = false,
                          .use_mxfp4 = false,
                          .label = nullptr},
        // no dense layout: convert_weight_packed_scale_zp packs int4 checkpoints
        .packed_extra_cols = 0,
        .pack_row_multiple = 0,
        .pack = nullptr,
        .describe_dense_scales = nullptr,
        .describe_experts = describe_int4_experts,
    },
    {
        .scheme = CPUMOE_SCHEME_MXFP4,
        .name = "mxfp4",
        .label = "moe_comp_method 4 (mxfp4)",
        .weight_dtypes = {at::kByte, at::ScalarType::Undefined},
        .weights_match_activations = false,
        .scales = ScaleKind::kE8M0Group,
        .takes_block_size = false,
        .shared_expert = {.supported = true,
                          .use_int8_w8a8 = false,
                          .use_fp8_w8a16 = false,
                          .use_mxfp4 = true,
                          .label = "use_mxfp4=True (mxfp4)"},
        .packed_extra_cols = 0,
        .pack_row_multiple = 32,  // SGLang's packer reads past a 16-row block's data
        .pack = pack_mxfp4,
        .describe_dense_scales = describe_e8m0_scales,
        .describe_experts = describe_dense_experts,
        .weights_per_element = 2,
    },
};
constexpr size_t kSchemeCount = std::size(kSchemes);

constexpr bool rows_follow_method_numbers() {
  for (size_t i = 0; i < kSchemeCount; ++i)
    if (kSchemes[i].scheme != static_cast<cpumoe_scheme>(i)) return false;
  return true;
}
static_assert(rows_follow_method_numbers(), "kSchemes[i] must describe moe_comp_method i");

// shared_expert_cpu and describe_dense_experts hand a row's weights to describe_dense_weights,
// which needs the row's dense layout.
constexpr bool dense_users_have_dense_layout() {
  for (const SchemeTraits &s : kSchemes) {
    const bool dense_user =
        s.shared_expert.supported || s.describe_experts == describe_dense_experts;
    if (dense_user && (s.pack == nullptr || s.describe_dense_scales == nullptr)) return false;
  }
  return true;
}
static_assert(dense_users_have_dense_layout(),
              "a row that uses dense weights needs pack and describe_dense_scales");

// "0 (bf16/fp16), 1 (int8 w8a8), 2 (fp8 w8a16) or 3 (int4 w4a8)"
std::string method_choices() {
  std::string choices;
  for (size_t i = 0; i < kSchemeCount; ++i) {
    if (i > 0) choices += i + 1 == kSchemeCount ? " or " : ", ";
    choices += std::to_string(i) + " (" + kSchemes[i].name + ")";
  }
  return choices;
}

}  // namespace

bool SchemeTraits::accepts_weight_dtype(at::ScalarType dtype) const {
  return std::find(weight_dtypes.begin(), weight_dtypes.end(), dtype) != weight_dtypes.end();
}

at::ScalarType SchemeTraits::weight_dtype_for(at::ScalarType activation_dtype) const {
  return weights_match_activations ? activation_dtype : weight_dtypes[0];
}

const SchemeTraits &scheme_for_method(int64_t moe_comp_method, const char *op) {
  TORCH_CHECK(moe_comp_method >= 0 && moe_comp_method < static_cast<int64_t>(kSchemeCount), op,
              ": moe_comp_method must be ", method_choices(), ", got ", moe_comp_method);
  return kSchemes[static_cast<size_t>(moe_comp_method)];
}

const SchemeTraits &scheme_for_shared_expert(bool use_int8_w8a8, bool use_fp8_w8a16, bool use_mxfp4,
                                             const char *op) {
  struct Flag {
    bool value;
    const char *name;
    const char *scheme;  // what the flag asks for, for the message when no row has it
  };
  const Flag flags[] = {{use_int8_w8a8, "use_int8_w8a8", "int8 w8a8"},
                        {use_fp8_w8a16, "use_fp8_w8a16", "fp8 w8a16"},
                        {use_mxfp4, "use_mxfp4", "mxfp4"}};
  std::vector<const Flag *> set;
  for (const Flag &flag : flags)
    if (flag.value) set.push_back(&flag);
  std::string set_names;  // "use_int8_w8a8", "use_int8_w8a8 and use_mxfp4", "a, b and c"
  for (size_t i = 0; i < set.size(); ++i)
    set_names += (i == 0 ? "" : i + 1 == set.size() ? " and " : ", ") + std::string(set[i]->name);
  TORCH_CHECK(set.size() <= 1, op, ": ", set_names, " cannot ", set.size() == 2 ? "both" : "all",
              " be True");
  const auto row =
      std::find_if(std::begin(kSchemes), std::end(kSchemes), [&](const SchemeTraits &s) {
        return s.shared_expert.supported && s.shared_expert.use_int8_w8a8 == use_int8_w8a8 &&
               s.shared_expert.use_fp8_w8a16 == use_fp8_w8a16 &&
               s.shared_expert.use_mxfp4 == use_mxfp4;
      });
  // only a set flag can miss: the bf16/fp16 row (no flag) always exists
  TORCH_CHECK(row != std::end(kSchemes), op, ": ", set_names, "=True selects the ", set[0]->scheme,
              " weight scheme, which is not available in this build of cpumoe");
  return *row;
}

const SchemeTraits *scheme_for_weight_dtype(at::ScalarType dtype) {
  // uint8 is both INT4's dtype and MXFP4's; only MXFP4 has a dense layout to pack into
  const auto row = std::find_if(
      std::begin(kSchemes), std::end(kSchemes),
      [&](const SchemeTraits &s) { return s.pack != nullptr && s.accepts_weight_dtype(dtype); });
  return row == std::end(kSchemes) ? nullptr : &*row;
}

std::pair<int64_t, int64_t> check_scale_args(const SchemeTraits &scheme, const char *label,
                                             const std::optional<at::Tensor> &w1_scale,
                                             const std::optional<at::Tensor> &w2_scale,
                                             at::OptionalIntArrayRef block_size, const char *op) {
  if (!scheme.takes_scales()) {
    check_unused(w1_scale, "w1_scale", op, label);
    check_unused(w2_scale, "w2_scale", op, label);
  }
  TORCH_CHECK(scheme.takes_block_size || !block_size.has_value(), op,
              ": block_size must be None for ", label);
  if (!scheme.takes_block_size) return {0, 0};
  return parse_block_size(block_size, op);
}

DescribedWeights describe_dense_weights(const SchemeTraits &scheme, const WeightOperands &operands,
                                        const std::vector<int64_t> &lead,
                                        cpumoe_moe_problem &problem) {
  std::vector<int64_t> w1_shape = lead, w2_shape = lead;
  w1_shape.insert(w1_shape.end(), {2 * problem.N, problem.K});
  w2_shape.insert(w2_shape.end(), {problem.K, problem.N});
  DescribedWeights weights;
  weights.w1 = prepare_weight(scheme, operands, operands.w1, "w1", std::move(w1_shape));
  weights.w2 = prepare_weight(scheme, operands, operands.w2, "w2", std::move(w2_shape));
  scheme.describe_dense_scales(scheme, operands, lead, problem);
  problem.w1 = weights.w1.data_ptr(), problem.w2 = weights.w2.data_ptr();
  return weights;
}

}  // namespace cpumoe::bindings
