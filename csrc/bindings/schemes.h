// The weight schemes (moe_comp_method of SGLang's schemas, docs/SGLANG.md) as one table of
// traits, one row per scheme: what each expects of w1/w2 and their scales, and the functions
// that check those operands, describe them to the C core and pack them. The ops look their
// scheme up here and call its entries, so adding a scheme means adding a row (and its
// functions) in schemes.cpp. Byte layouts are in docs/FORMATS.md, messages in docs/ERRORS.md.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "cpumoe/cpumoe.h"

namespace cpumoe::bindings {

// The scale tensors a scheme's weights come with.
enum class ScaleKind {
  kNone,            // bf16/fp16 weights: w*_scale must be None
  kPerChannel,      // fp32, one scale per output channel
  kBlock2D,         // fp32 [..., ceil(OC / block_n), ceil(IC / block_k)], with block_size;
                    // without it, one scale per matrix (per-tensor: [...])
  kGroupWithZeros,  // fp32 scales and int8 zero points (w*_zero) per group of input features
  kE8M0Group,       // uint8 e8m0 exponents [..., OC, IC/32], packed by convert_scale_packed
};

// The weight arguments of one op call as the op received them. shared_expert_cpu has no
// zero points: it passes None for them.
struct WeightOperands {
  const at::Tensor &w1;
  const at::Tensor &w2;
  const std::optional<at::Tensor> &w1_scale;
  const std::optional<at::Tensor> &w2_scale;
  const std::optional<at::Tensor> &w1_zero;
  const std::optional<at::Tensor> &w2_zero;
  at::ScalarType activation_dtype;  // hidden_states' (checked)
  bool is_vnni;                     // false: the op packs the weights itself
  const char *label;                // how this op's messages name the scheme
  const char *op;
};

// The weight tensors a described problem points into. The op holds them until the problem
// has run: with is_vnni=False they are the packed copies, owned by nobody else.
struct DescribedWeights {
  at::Tensor w1, w2;
};

struct SchemeTraits;

// Checks an expert bank's w1/w2 and their scales and writes E, N, the weights, scales and
// zero points into `problem`, whose K and block sizes are already set.
using DescribeExpertsFn = DescribedWeights (*)(const SchemeTraits &scheme,
                                               const WeightOperands &operands,
                                               cpumoe_moe_problem &problem);
// Checks the scales of dense weights w1 [lead..., 2N, K] and w2 [lead..., K, N] and writes
// their pointers into `problem`, whose N, K and block sizes are already set.
using DescribeScalesFn = void (*)(const SchemeTraits &scheme, const WeightOperands &operands,
                                  const std::vector<int64_t> &lead, cpumoe_moe_problem &problem);
// Packs checked, contiguous [..., OC, IC] weights into the scheme's layout.
using PackFn = at::Tensor (*)(const at::Tensor &weight, const char *op);

// How shared_expert_cpu's flags select a scheme (it has no moe_comp_method). At most one
// flag is set; none selects the bf16/fp16 row. use_mxfp4 exists only in the .mxfp4 overload.
struct SharedExpertFlags {
  bool supported;  // false: no flag combination selects the scheme
  bool use_int8_w8a8;
  bool use_fp8_w8a16;
  bool use_mxfp4;     // the flag of SGLang's newer shared_expert_cpu overload
  const char *label;  // how shared_expert_cpu's messages name the scheme
};

struct SchemeTraits {
  cpumoe_scheme scheme;  // = moe_comp_method = the row's index in the table
  const char *name;      // "int8 w8a8": the unknown-method message and scale messages
  const char *label;     // "moe_comp_method 1 (int8 w8a8)": fused_experts_cpu's messages
  // The weight dtypes the scheme takes (the second is Undefined when it takes one). With
  // `weights_match_activations` the weights must have hidden_states' dtype.
  std::array<at::ScalarType, 2> weight_dtypes;
  bool weights_match_activations;
  ScaleKind scales;
  bool takes_block_size;  // block_size = [block_n, block_k] of kBlock2D scales
  SharedExpertFlags shared_expert;
  // Dense layout, produced by convert_weight_packed (or by the op when is_vnni=False); these
  // four entries are 0/nullptr for a scheme without one.
  int64_t packed_extra_cols;  // a packed row is IC + this long (int8: 4 bytes of compensation)
  int64_t pack_row_multiple;  // out features must be a multiple of this to pack
  PackFn pack;
  DescribeScalesFn describe_dense_scales;
  // fused_experts_cpu's step for w1/w2 and their scales and zero points
  DescribeExpertsFn describe_experts;
  // Weights per element of the dense weight tensor: 2 for MXFP4, whose uint8 [..., OC, IC/2]
  // holds two 4-bit codes a byte; 1 for the others.
  int64_t weights_per_element = 1;

  bool takes_scales() const { return scales != ScaleKind::kNone; }
  bool takes_zero_points() const { return scales == ScaleKind::kGroupWithZeros; }
  bool accepts_weight_dtype(at::ScalarType dtype) const;
  at::ScalarType weight_dtype_for(at::ScalarType activation_dtype) const;
};

// The row of `moe_comp_method`; the one place an unknown method is rejected.
const SchemeTraits &scheme_for_method(int64_t moe_comp_method, const char *op);

// The row shared_expert_cpu's flags select; more than one flag set, or a flag no row has
// (kSchemes lists a row per flag, so only a build without that scheme), is a RuntimeError
// of `op`.
const SchemeTraits &scheme_for_shared_expert(bool use_int8_w8a8, bool use_fp8_w8a16, bool use_mxfp4,
                                             const char *op);

// The row whose dense weights (packed by convert_weight_packed) have `dtype`, or nullptr.
const SchemeTraits *scheme_for_weight_dtype(at::ScalarType dtype);

// Checks the scale arguments against the scheme before any shape is known: scales None for
// a scheme without them, block_size only for one that takes it (and valid there).
// Returns [block_n, block_k], zeros when the scheme takes no block_size.
std::pair<int64_t, int64_t> check_scale_args(const SchemeTraits &scheme, const char *label,
                                             const std::optional<at::Tensor> &w1_scale,
                                             const std::optional<at::Tensor> &w2_scale,
                                             at::OptionalIntArrayRef block_size, const char *op);

// Checks dense w1 [lead..., 2N, K] and w2 [lead..., K, N] (N and K from `problem`) and
// their scales, packs them when !is_vnni, and writes them into `problem`.
DescribedWeights describe_dense_weights(const SchemeTraits &scheme, const WeightOperands &operands,
                                        const std::vector<int64_t> &lead,
                                        cpumoe_moe_problem &problem);

}  // namespace cpumoe::bindings
