// torch.ops.cpumoe.convert_weight_packed and convert_weight_packed_scale_zp (SGLang's ops of
// the same names, docs/SGLANG.md): checkpoint weights -> the layouts of docs/FORMATS.md that
// fused_experts_cpu and shared_expert_cpu take with is_vnni=True. Which packer a dense
// weight gets is its scheme row's (schemes.h), found by the weight's dtype.
#include "checks.h"
#include "ops.h"
#include "runtime.h"
#include "schemes.h"

namespace cpumoe::bindings {

at::Tensor convert_weight_packed(const at::Tensor &weight) {
  const char *op = "convert_weight_packed";
  check_cpu_tensor(weight, "weight", op);
  TORCH_CHECK(weight.dim() == 2 || weight.dim() == 3, op, ": expect weight to be 2d or 3d, got ",
              weight.dim(), "d tensor.");
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  const at::ScalarType dtype = weight.scalar_type();
  const SchemeTraits *scheme = scheme_for_weight_dtype(dtype);
  TORCH_CHECK(
      scheme != nullptr, op,
      ": expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4), got ",
      dtype_name(dtype));
  if (weight.dim() == 2 && weight.size(0) < 16) {
    // SGLang's small-OC case: fp32 [IC, OC] for its FMA linear path.
    return weight.to(at::kFloat).t().contiguous();
  }
  const int64_t row_multiple = scheme->pack_row_multiple;
  TORCH_CHECK(weight.size(-2) % row_multiple == 0, op, ": invalid weight out features ",
              weight.size(-2), " (must be a multiple of ", row_multiple, " for ", dtype_name(dtype),
              ")");
  // uint8 (mxfp4) holds two input features a byte
  const int64_t in_features = weight.size(-1) * scheme->weights_per_element;
  TORCH_CHECK(in_features % 32 == 0, op, ": invalid weight input features ", in_features,
              " (must be a multiple of 32)");
  if (weight.numel() == 0) {
    std::vector<int64_t> shape(weight.sizes().begin(), weight.sizes().end());
    shape.back() += scheme->packed_extra_cols;
    return at::empty(shape, weight.options());
  }
  return scheme->pack(weight, op);
}

// MXFP4 e8m0 scales [E, OC, G] or [OC, G] -> the same shape in blocks of 32 rows, each
// [G][32] (cpumoe_pack_e8m0_scales).
at::Tensor convert_scale_packed(const at::Tensor &scale) {
  const char *op = "convert_scale_packed";
  check_cpu_tensor(scale, "scale", op);
  TORCH_CHECK(scale.dim() == 2 || scale.dim() == 3, op, ": expect scale to be 2d or 3d, got ",
              scale.dim(), "d tensor.");
  TORCH_CHECK(scale.scalar_type() == at::kByte, op,
              ": expect scale to be uint8 (e8m0 exponents), got ", dtype_name(scale.scalar_type()));
  TORCH_CHECK(scale.is_contiguous(), op, ": scale must be contiguous");
  const int64_t rows = scale.size(-2), groups = scale.size(-1);
  TORCH_CHECK(rows % 32 == 0, op, ": scale has ", rows,
              " rows (the weight's out features), which must be a multiple of 32");
  // streamed with the codes on every call, as the weights are: on huge pages like them
  at::Tensor packed = new_huge_page_tensor(scale.sizes(), scale.options());
  if (scale.numel() == 0) return packed;
  const cpumoe_runner runner = aten_runner();
  check_status(cpumoe_pack_e8m0_scales(scale.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(),
                                       scale.dim() == 3 ? scale.size(0) : 1, rows, groups, &runner),
               op);
  return packed;
}

// AWQ (0) or GPTQ (1) int4 checkpoint tensors -> (packed weight, zero points, scales).
std::tuple<at::Tensor, at::Tensor, at::Tensor> convert_weight_packed_scale_zp(
    const at::Tensor &qweight, const at::Tensor &qzeros, const at::Tensor &scales,
    int64_t quant_method_4bit) {
  const char *op = "convert_weight_packed_scale_zp";
  TORCH_CHECK(quant_method_4bit == 0 || quant_method_4bit == 1, op,
              ": quant_method_4bit must be 0 (AWQ) or 1 (GPTQ), got ", quant_method_4bit);
  const bool awq = quant_method_4bit == 0;
  for (const auto &[tensor, name] : {std::pair<const at::Tensor &, const char *>{qweight, "weight"},
                                     {qzeros, "qzeros"},
                                     {scales, "scales"}}) {
    check_cpu_tensor(tensor, name, op);
    TORCH_CHECK(tensor.dim() == 2 || tensor.dim() == 3, op, ": ", name,
                " must be 2-D or 3-D (one matrix or [E, ...] experts), got shape ", tensor.sizes());
    TORCH_CHECK(tensor.dim() == qweight.dim(), op,
                ": weight, qzeros and scales must all be 2-D or all 3-D, got shapes ",
                qweight.sizes(), ", ", qzeros.sizes(), ", ", scales.sizes());
    TORCH_CHECK(tensor.is_contiguous(), op, ": ", name, " must be contiguous");
  }
  TORCH_CHECK(qweight.scalar_type() == at::kInt, op,
              ": weight must be int32 (8 nibbles per word, AWQ/GPTQ qweight), got ",
              dtype_name(qweight.scalar_type()));
  TORCH_CHECK(qzeros.scalar_type() == at::kInt, op,
              ": qzeros must be int32 (8 nibbles per word), got ",
              dtype_name(qzeros.scalar_type()));
  const at::ScalarType scales_dtype = scales.scalar_type();
  TORCH_CHECK(
      scales_dtype == at::kBFloat16 || scales_dtype == at::kHalf || scales_dtype == at::kFloat, op,
      ": scales must be bfloat16, float16 or float32, got ", dtype_name(scales_dtype));
  const bool experts = qweight.dim() == 3;
  const int64_t E = experts ? qweight.size(0) : 1;
  TORCH_CHECK(!experts || (qzeros.size(0) == E && scales.size(0) == E), op,
              ": weight, qzeros and scales must have the same number of experts, got shapes ",
              qweight.sizes(), ", ", qzeros.sizes(), ", ", scales.sizes());
  // AWQ qweight [IC, OC/8]; GPTQ qweight [IC/8, OC]; qzeros [G, OC/8]; scales [G, OC]
  const int64_t ic = awq ? qweight.size(-2) : qweight.size(-2) * 8;
  const int64_t oc = awq ? qweight.size(-1) * 8 : qweight.size(-1);
  const int64_t groups = scales.size(-2);
  TORCH_CHECK(scales.size(-1) == oc, op, ": scales must be [", experts ? "E, " : "",
              "groups, out_features=", oc, "], got shape ", scales.sizes());
  TORCH_CHECK(qzeros.size(-2) == groups && qzeros.size(-1) * 8 == oc, op, ": qzeros must be [",
              experts ? "E, " : "", "groups=", groups, ", out_features/8=", oc / 8, "], got shape ",
              qzeros.sizes());
  TORCH_CHECK(oc > 0 && oc % 32 == 0, op, ": invalid weight out features ", oc,
              " (must be a positive multiple of 32)");
  TORCH_CHECK(groups > 0 && ic % groups == 0, op, ": ", ic, " input features cannot be split into ",
              groups, " groups (scales.size(-2))");
  const int64_t group = ic / groups, bk = cpumoe_int4_block_k(group);
  TORCH_CHECK(bk > 0, op, ": group size ", group, " (", ic, " input features / ", groups,
              " groups in scales) is not supported: it must be a multiple of 4 that is at most "
              "128, or a multiple of 128");
  // [E, ...] when the inputs have experts
  auto shaped = [&](std::vector<int64_t> dims) {
    if (experts) dims.insert(dims.begin(), E);
    return dims;
  };
  at::Tensor packed = new_huge_page_tensor(shaped({oc / 32, ic / bk, 16 * bk + 128}),
                                           qweight.options().dtype(at::kByte));
  // the zero points and scales stream beside the weights on every call: huge pages too (a
  // decode kernel with them on 4 KiB pages streamed 10-15 % slower, docs/PERFORMANCE-HISTORY.md)
  at::Tensor zeros =
      new_huge_page_tensor(shaped({oc / 32, groups, 32}), qweight.options().dtype(at::kChar));
  at::Tensor out_scales =
      new_huge_page_tensor(shaped({oc / 32, groups, 32}), qweight.options().dtype(at::kFloat));
  const cpumoe_runner runner = aten_runner();
  check_status(
      cpumoe_pack_int4(awq ? CPUMOE_INT4_AWQ : CPUMOE_INT4_GPTQ, qweight.data_ptr<int32_t>(),
                       qzeros.data_ptr<int32_t>(), scales.data_ptr(), core_dtype(scales_dtype), E,
                       oc, ic, groups, packed.data_ptr<uint8_t>(), zeros.data_ptr<int8_t>(),
                       out_scales.data_ptr<float>(), &runner),
      op);
  return {packed, zeros, out_scales};
}

}  // namespace cpumoe::bindings
