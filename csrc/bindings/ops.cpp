// PyTorch binding of the cpumoe C core: op schemas (SGLang's, under torch.ops.cpumoe),
// argument validation with messages that name the argument, workspace allocation from
// torch's allocator, and the parallel-for hook (at::parallel_for, so torch's thread
// count governs the kernels). No math here: everything is in csrc/kernels.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cpumoe/cpumoe.h"

namespace {

void run_on_aten_threads(void * /*ctx*/, int64_t n, cpumoe_worker_fn worker, void *arg) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) worker(arg, w);
  });
}

cpumoe_runner aten_runner() {
  return cpumoe_runner{run_on_aten_threads, nullptr, static_cast<int64_t>(at::get_num_threads())};
}

void check_status(cpumoe_status st, const char *op) {
  TORCH_CHECK(st == CPUMOE_OK, op, ": ", cpumoe_last_error());
}

const char *dtype_name(at::ScalarType t) {
  return c10::toString(t);
}

void check_cpu_tensor(const at::Tensor &t, const char *name, const char *op) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a dense (strided) tensor");
}

void check_dense(const at::Tensor &t, const char *name, const char *op, int64_t ndim) {
  check_cpu_tensor(t, name, op);
  TORCH_CHECK(t.dim() == ndim, op, ": ", name, " must be a ", ndim, "-D tensor, got shape ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

cpumoe_dtype act_dtype(const at::Tensor &hidden, const char *op) {
  const auto t = hidden.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf, op,
              ": hidden_states must be bfloat16 or float16, got ", dtype_name(t));
  return t == at::kBFloat16 ? CPUMOE_DTYPE_BF16 : CPUMOE_DTYPE_F16;
}

void check_scheme(int64_t moe_comp_method, const char *op) {
  TORCH_CHECK(moe_comp_method >= 0 && moe_comp_method <= 3, op,
              ": moe_comp_method must be 0 (bf16/fp16), 1 (int8 w8a8), 2 (fp8 w8a16) or 3 "
              "(int4 w4a8), got ",
              moe_comp_method);
}

// What a weight scheme expects of w1/w2 and their scales.
struct SchemeSpec {
  cpumoe_scheme scheme;
  const char *label;            // for messages, e.g. "moe_comp_method 1 (int8 w8a8)"
  at::ScalarType weight_dtype;  // bf16/fp16 weights carry the activation dtype
  int64_t packed_extra_cols;    // a packed row is IC + this long (int8: 4 bytes of comp)
  bool channel_scales;          // per output channel fp32 scales required
  bool block_scales;            // 2-D block scales and block_size required (fp8)
  bool group_scales = false;    // int4: per-group scales and zero points
};

SchemeSpec scheme_spec(int64_t method, at::ScalarType act) {
  if (method == 1)
    return {CPUMOE_SCHEME_INT8_W8A8, "moe_comp_method 1 (int8 w8a8)", at::kChar, 4, true, false};
  if (method == 3)
    return {
        CPUMOE_SCHEME_INT4_W4A8, "moe_comp_method 3 (int4 w4a8)", at::kByte, 0, false, false, true};
  if (method == 2)
    return {CPUMOE_SCHEME_FP8_W8A16,
            "moe_comp_method 2 (fp8 w8a16)",
            at::kFloat8_e4m3fn,
            0,
            false,
            true};
  return {CPUMOE_SCHEME_UNQUANT, "moe_comp_method 0 (bf16/fp16 weights)", act, 0, false, false};
}

void check_unused(const std::optional<at::Tensor> &t, const char *name, const char *op,
                  const SchemeSpec &spec) {
  TORCH_CHECK(!t.has_value(), op, ": ", name, " must be None for ", spec.label);
}

// Checks a per output channel fp32 scale (INT8: callers pass [E, OC, 1] or [E, OC]).
const float *channel_scale(const std::optional<at::Tensor> &s, const char *name, const char *op,
                           int64_t numel) {
  TORCH_CHECK(s.has_value(), op, ": missing ", name,
              " for int8 w8a8 (float32 per output channel scales, ", numel, " values)");
  check_cpu_tensor(*s, name, op);
  TORCH_CHECK(s->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(s->scalar_type()));
  TORCH_CHECK(s->numel() == numel, op, ": ", name, " must hold one scale per output channel (",
              numel, " values), got shape ", s->sizes());
  TORCH_CHECK(s->is_contiguous(), op, ": ", name, " must be contiguous");
  return s->data_ptr<float>();
}

// FP8 block_size = [block_n, block_k]: required, two positive ints, block_k even.
std::pair<int64_t, int64_t> fp8_block_size(at::OptionalIntArrayRef block_size, const char *op) {
  TORCH_CHECK(block_size.has_value(), op,
              ": missing block_size for fp8 w8a16 (e.g. [128, 128], DeepSeek's weight_block_size)");
  TORCH_CHECK(block_size->size() == 2, op,
              ": expect block_size to have 2 values [block_n, "
              "block_k], got ",
              block_size->size());
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

// Checks an fp8 2-D block scale: fp32 [lead..., ceil(OC/bn), ceil(IC/bk)].
const float *block_scale(const std::optional<at::Tensor> &s, const char *name, const char *op,
                         std::vector<int64_t> shape) {
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(s.has_value(), op, ": missing ", name,
              " for fp8 w8a16 (float32 block scales of shape ", expected, ")");
  check_cpu_tensor(*s, name, op);
  TORCH_CHECK(s->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              dtype_name(s->scalar_type()));
  TORCH_CHECK(s->sizes() == expected, op, ": ", name, " must have shape ", expected,
              " (ceil(out_features / block_n), ceil(in_features / block_k)), got ", s->sizes());
  TORCH_CHECK(s->is_contiguous(), op, ": ", name, " must be contiguous");
  return s->data_ptr<float>();
}

// a >= 0, b >= 1; no a + b - 1, which overflows for block sizes near INT64_MAX.
int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

// Scale arguments against the scheme, before shapes are known: scales must be None for a
// scheme without them, block_size only for fp8 (and valid there). Returns [block_n, block_k].
std::pair<int64_t, int64_t> check_scale_args(const SchemeSpec &spec,
                                             const std::optional<at::Tensor> &w1_scale,
                                             const std::optional<at::Tensor> &w2_scale,
                                             at::OptionalIntArrayRef block_size, const char *op) {
  if (!spec.channel_scales && !spec.block_scales && !spec.group_scales) {
    check_unused(w1_scale, "w1_scale", op, spec);
    check_unused(w2_scale, "w2_scale", op, spec);
  }
  TORCH_CHECK(spec.block_scales || !block_size.has_value(), op, ": block_size must be None for ",
              spec.label);
  return spec.block_scales ? fp8_block_size(block_size, op) : std::pair<int64_t, int64_t>{0, 0};
}

// Checked scale pointers of w1 [lead..., 2N, K] and w2 [lead..., K, N] for the scheme
// (nullptr for bf16/fp16 weights).
std::pair<const float *, const float *> scale_pointers(const SchemeSpec &spec,
                                                       const std::optional<at::Tensor> &w1_scale,
                                                       const std::optional<at::Tensor> &w2_scale,
                                                       std::vector<int64_t> lead, int64_t N,
                                                       int64_t K, int64_t bn, int64_t bk,
                                                       const char *op) {
  int64_t experts = 1;
  for (int64_t d : lead) experts *= d;
  if (spec.channel_scales)
    return {channel_scale(w1_scale, "w1_scale", op, experts * 2 * N),
            channel_scale(w2_scale, "w2_scale", op, experts * K)};
  if (!spec.block_scales) return {nullptr, nullptr};
  auto shape = [&](int64_t rows, int64_t cols) {
    std::vector<int64_t> v = lead;
    v.push_back(ceil_div(rows, bn));
    v.push_back(ceil_div(cols, bk));
    return v;
  };
  return {block_scale(w1_scale, "w1_scale", op, shape(2 * N, K)),
          block_scale(w2_scale, "w2_scale", op, shape(K, N))};
}

// Packs validated [..., OC, IC] weights (docs/FORMATS.md): VNNI-2 for 16-bit dtypes,
// VNNI-4 plus int32 compensation ([..., OC, IC + 4]) for int8.
at::Tensor pack_weight(const at::Tensor &weight, const char *op) {
  const int64_t oc = weight.size(-2), ic = weight.size(-1);
  const int64_t experts = weight.dim() == 3 ? weight.size(0) : 1;
  const cpumoe_runner runner = aten_runner();
  if (weight.scalar_type() == at::kChar) {
    std::vector<int64_t> shape(weight.sizes().begin(), weight.sizes().end());
    shape.back() = ic + 4;
    at::Tensor packed = at::empty(shape, weight.options());
    check_status(cpumoe_pack_vnni4_int8(weight.data_ptr<int8_t>(), packed.data_ptr<int8_t>(),
                                        experts, oc, ic, &runner),
                 op);
    return packed;
  }
  at::Tensor packed = at::empty_like(weight, at::MemoryFormat::Contiguous);
  if (weight.scalar_type() == at::kFloat8_e4m3fn) {
    check_status(
        cpumoe_pack_vnni2_8bit(static_cast<const uint8_t *>(weight.data_ptr()),
                               static_cast<uint8_t *>(packed.data_ptr()), experts, oc, ic, &runner),
        op);
    return packed;
  }
  check_status(
      cpumoe_pack_vnni2_16bit(static_cast<const uint16_t *>(weight.data_ptr()),
                              static_cast<uint16_t *>(packed.data_ptr()), experts, oc, ic, &runner),
      op);
  return packed;
}

at::Tensor convert_weight_packed(const at::Tensor &weight) {
  const char *op = "convert_weight_packed";
  check_cpu_tensor(weight, "weight", op);
  TORCH_CHECK(weight.dim() == 2 || weight.dim() == 3, op, ": expect weight to be 2d or 3d, got ",
              weight.dim(), "d tensor.");
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  const auto t = weight.scalar_type();
  const bool known = t == at::kBFloat16 || t == at::kHalf || t == at::kChar ||
                     t == at::kFloat8_e4m3fn || t == at::kByte;
  TORCH_CHECK(
      known, op,
      ": expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4), got ",
      dtype_name(t));
  if (weight.dim() == 2 && weight.size(0) < 16) {
    // SGLang's small-OC case: fp32 [IC, OC] for its FMA linear path.
    return weight.to(at::kFloat).t().contiguous();
  }
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf || t == at::kChar || t == at::kFloat8_e4m3fn, op,
              ": packing ", dtype_name(t),
              " weights is not implemented in this version of cpumoe; bfloat16, float16, int8 and "
              "float8_e4m3fn are");
  const int64_t row_block = t == at::kChar ? 32 : 16;
  TORCH_CHECK(weight.size(-2) % row_block == 0, op, ": invalid weight out features ",
              weight.size(-2), " (must be a multiple of ", row_block, " for ", dtype_name(t), ")");
  TORCH_CHECK(weight.size(-1) % 32 == 0, op, ": invalid weight input features ", weight.size(-1),
              " (must be a multiple of 32)");
  if (weight.numel() == 0) {
    std::vector<int64_t> shape(weight.sizes().begin(), weight.sizes().end());
    if (t == at::kChar) shape.back() += 4;
    return at::empty(shape, weight.options());
  }
  return pack_weight(weight, op);
}

// SGLang's convert_weight_packed_scale_zp: AWQ (0) or GPTQ (1) int4 checkpoint tensors ->
// (packed weight, zero points, scales) in the layout of docs/FORMATS.md.
std::tuple<at::Tensor, at::Tensor, at::Tensor> convert_weight_packed_scale_zp(
    const at::Tensor &qweight, const at::Tensor &qzeros, const at::Tensor &scales,
    int64_t quant_method_4bit) {
  const char *op = "convert_weight_packed_scale_zp";
  TORCH_CHECK(quant_method_4bit == 0 || quant_method_4bit == 1, op,
              ": quant_method_4bit must be 0 (AWQ) or 1 (GPTQ), got ", quant_method_4bit);
  const bool awq = quant_method_4bit == 0;
  for (const auto &[t, name] : {std::pair<const at::Tensor &, const char *>{qweight, "weight"},
                                {qzeros, "qzeros"},
                                {scales, "scales"}}) {
    check_cpu_tensor(t, name, op);
    TORCH_CHECK(t.dim() == 2 || t.dim() == 3, op, ": ", name,
                " must be 2-D or 3-D (one matrix or [E, ...] experts), got shape ", t.sizes());
    TORCH_CHECK(t.dim() == qweight.dim(), op,
                ": weight, qzeros and scales must all be 2-D or all "
                "3-D, got shapes ",
                qweight.sizes(), ", ", qzeros.sizes(), ", ", scales.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  }
  TORCH_CHECK(qweight.scalar_type() == at::kInt, op,
              ": weight must be int32 (8 nibbles per word, AWQ/GPTQ qweight), got ",
              dtype_name(qweight.scalar_type()));
  TORCH_CHECK(qzeros.scalar_type() == at::kInt, op,
              ": qzeros must be int32 (8 nibbles per word), got ",
              dtype_name(qzeros.scalar_type()));
  const auto sdt = scales.scalar_type();
  TORCH_CHECK(sdt == at::kBFloat16 || sdt == at::kHalf || sdt == at::kFloat, op,
              ": scales must be bfloat16, float16 or float32, got ", dtype_name(sdt));
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
  auto shaped = [&](std::vector<int64_t> dims) {
    if (experts) dims.insert(dims.begin(), E);
    return dims;
  };
  at::Tensor packed =
      at::empty(shaped({oc / 32, ic / bk, 16 * bk + 128}), qweight.options().dtype(at::kByte));
  at::Tensor zeros = at::empty(shaped({oc / 32, groups, 32}), qweight.options().dtype(at::kChar));
  at::Tensor out_scales =
      at::empty(shaped({oc / 32, groups, 32}), qweight.options().dtype(at::kFloat));
  const cpumoe_runner runner = aten_runner();
  const cpumoe_dtype scales_dtype = sdt == at::kBFloat16 ? CPUMOE_DTYPE_BF16
                                    : sdt == at::kHalf   ? CPUMOE_DTYPE_F16
                                                         : CPUMOE_DTYPE_F32;
  check_status(
      cpumoe_pack_int4(awq ? CPUMOE_INT4_AWQ : CPUMOE_INT4_GPTQ, qweight.data_ptr<int32_t>(),
                       qzeros.data_ptr<int32_t>(), scales.data_ptr(), scales_dtype, E, oc, ic,
                       groups, packed.data_ptr<uint8_t>(), zeros.data_ptr<int8_t>(),
                       out_scales.data_ptr<float>(), &runner),
      op);
  return {packed, zeros, out_scales};
}

// The op's output: a new contiguous CPU tensor shaped and typed as `like`, made by ATen's CPU
// factory directly. at::empty_like goes through the dispatcher, whose code is cold on every
// decode call (the weights stream through the caches between calls): Qwen3 M=1, 8 weight
// copies cycled, clock stamps around the allocation, medians over 280 calls: 4.5-4.8 us
// against 9.8-11.2 us.
at::Tensor new_output_like(const at::Tensor &like) {
  return at::detail::empty_cpu(like.sizes(), like.scalar_type(), /*pin_memory=*/false,
                               at::MemoryFormat::Contiguous);
}

// One workspace per calling thread, grown on demand and kept: fresh pages are faulted in
// and zero-filled by the OS on first touch, which on every call would cost ~10 ms for a
// 512-token Qwen3 layer. release_workspace() returns it to torch's allocator.
thread_local at::Tensor cached_workspace;

void *workspace_for(size_t bytes) {
  if (!cached_workspace.defined() || cached_workspace.nbytes() < bytes)
    cached_workspace =
        at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  return cached_workspace.data_ptr();
}

void run_problem(cpumoe_moe_problem &p, const char *op) {
  if (p.M == 0) return;
  const size_t bytes = cpumoe_fused_experts_workspace_size(&p);
  TORCH_CHECK(bytes > 0, op, ": ", cpumoe_last_error());
  void *workspace = workspace_for(bytes);
  const cpumoe_runner runner = aten_runner();
  check_status(cpumoe_fused_experts(&p, workspace, bytes, &runner), op);
}

// Validates w1/w2 against the scheme's dtype and the logical shape [..., OC, IC] (packed:
// [..., OC, IC + extra]); packs an unpacked weight (is_vnni=False) on the way.
at::Tensor prepare_weight(const at::Tensor &w, const char *name, const char *op,
                          const SchemeSpec &spec, std::vector<int64_t> shape, bool is_vnni) {
  check_cpu_tensor(w, name, op);
  if (is_vnni) shape.back() += spec.packed_extra_cols;
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(w.dim() == static_cast<int64_t>(shape.size()), op, ": ", name, " must be a ",
              shape.size(), "-D tensor ", expected, ", got shape ", w.sizes());
  TORCH_CHECK(w.scalar_type() == spec.weight_dtype, op, ": ", name, " must be ",
              dtype_name(spec.weight_dtype), " for ", spec.label, ", got ",
              dtype_name(w.scalar_type()));
  TORCH_CHECK(w.sizes() == expected, op, ": ", name, " must have shape ", expected,
              is_vnni && spec.packed_extra_cols ? " (packed by convert_weight_packed)" : "",
              ", got ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), op, ": ", name, " must be contiguous");
  return is_vnni ? w : pack_weight(w, op);
}

void check_mlp_sizes(int64_t K, int64_t N, const char *op) {
  TORCH_CHECK(K > 0, op, ": hidden size K = hidden_states.size(1) must be positive, got 0");
  TORCH_CHECK(K % 32 == 0, op, ": hidden size K=", K,
              " must be a multiple of 32 (pad hidden_states, w1 and w2 with zeros)");
  TORCH_CHECK(
      N % 32 == 0, op, ": intermediate size N=", N,
      " (w1.size(-2) / 2) must be a multiple of 32 (pad w1 rows and w2 columns with zeros)");
}

// ---- INT4 W4A8 -------------------------------------------------------------------------
// Packed by convert_weight_packed_scale_zp (docs/FORMATS.md): per expert, a weight of OC
// output and IC input features is uint8 [OC/32, IC/bk, 16*bk + 128] (bk = min(group, 128)),
// its scales fp32 and zero points int8 [OC/32, IC/group, 32].

struct Int4Operand {
  const float *scale;
  const int8_t *zero;
  int64_t group;
};

// The INT4 scale or zero tensor `t`: present, `dtype`, 4-D [E, OC/32, groups, 32], contiguous.
void check_int4_group_tensor(const std::optional<at::Tensor> &t, const char *name,
                             at::ScalarType dtype, int64_t E, const char *op) {
  TORCH_CHECK(t.has_value(), op, ": missing ", name,
              " for moe_comp_method 3 (int4 w4a8): pass the tensors returned by "
              "convert_weight_packed_scale_zp (w*_scale = its scales, w*_zero = its qzeros)");
  check_cpu_tensor(*t, name, op);
  TORCH_CHECK(t->scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype),
              " for moe_comp_method 3 (int4 w4a8), got ", dtype_name(t->scalar_type()));
  TORCH_CHECK(
      t->dim() == 4 && t->size(0) == E && t->size(3) == 32 && t->size(1) > 0 && t->size(2) > 0, op,
      ": ", name, " must have shape [E=", E,
      ", out_features/32, groups, 32] (from convert_weight_packed_scale_zp), got ", t->sizes());
  TORCH_CHECK(t->is_contiguous(), op, ": ", name, " must be contiguous");
}

// Checks one packed INT4 weight [E, OC/32, IC/bk, 16 bk + 128] against its scale and zero
// tensors; returns the pointers and the group size.
Int4Operand check_int4_weight(const at::Tensor &w, const char *wname,
                              const std::optional<at::Tensor> &scale, const char *sname,
                              const std::optional<at::Tensor> &zero, const char *zname, int64_t E,
                              int64_t oc, int64_t ic, const char *op) {
  check_int4_group_tensor(scale, sname, at::kFloat, E, op);
  check_int4_group_tensor(zero, zname, at::kChar, E, op);
  TORCH_CHECK(zero->sizes() == scale->sizes(), op, ": ", zname, " must have the shape of ", sname,
              " ", scale->sizes(), ", got ", zero->sizes());
  TORCH_CHECK(scale->size(1) * 32 == oc, op, ": ", sname, " has ", scale->size(1),
              " blocks of 32 output features, expected ", oc, " / 32 = ", oc / 32);
  const int64_t groups = scale->size(2);
  TORCH_CHECK(ic % groups == 0, op, ": ", sname, " has ", groups,
              " groups, which do not divide the ", ic, " input features of ", wname);
  const int64_t group = ic / groups, bk = cpumoe_int4_block_k(group);
  TORCH_CHECK(bk > 0, op, ": ", wname, " has group size ", group, " (", ic, " input features / ",
              groups,
              " groups); int4 needs a multiple of 4 that is at most 128, or a multiple of 128");
  const std::vector<int64_t> shape{E, oc / 32, ic / bk, 16 * bk + 128};
  const c10::IntArrayRef expected(shape);
  TORCH_CHECK(w.scalar_type() == at::kByte, op, ": ", wname,
              " must be uint8 for moe_comp_method 3 (int4 w4a8), got ",
              dtype_name(w.scalar_type()));
  TORCH_CHECK(w.sizes() == expected, op, ": ", wname, " must have shape ", expected,
              " (packed by convert_weight_packed_scale_zp, group size ", group, "), got ",
              w.sizes());
  TORCH_CHECK(w.is_contiguous(), op, ": ", wname, " must be contiguous");
  return {scale->data_ptr<float>(), zero->data_ptr<int8_t>(), group};
}

at::Tensor fused_experts_impl(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const at::Tensor &topk_weights, const at::Tensor &topk_ids, bool inplace,
    int64_t moe_comp_method, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, const std::optional<at::Tensor> &w1_zero,
    const std::optional<at::Tensor> &w2_zero, at::OptionalIntArrayRef block_size,
    const std::optional<at::Tensor> &w1_bias, const std::optional<at::Tensor> &w2_bias,
    std::optional<double> alpha, std::optional<double> limit, bool is_vnni) {
  const char *op = "fused_experts_cpu";
  check_scheme(moe_comp_method, op);
  check_dense(hidden_states, "hidden_states", op, 2);
  const cpumoe_dtype adt = act_dtype(hidden_states, op);
  const at::ScalarType dt = hidden_states.scalar_type();
  const SchemeSpec spec = scheme_spec(moe_comp_method, dt);
  const bool int4 = spec.scheme == CPUMOE_SCHEME_INT4_W4A8;
  if (!int4) {
    check_unused(w1_zero, "w1_zero", op, spec);
    check_unused(w2_zero, "w2_zero", op, spec);
  }
  const auto [bn, bk] = check_scale_args(spec, w1_scale, w2_scale, block_size, op);

  const int64_t M = hidden_states.size(0), K = hidden_states.size(1);
  check_cpu_tensor(w1, "w1", op);
  check_cpu_tensor(w2, "w2", op);
  at::Tensor pw1 = w1, pw2 = w2;
  int64_t E, N;
  const float *s1 = nullptr, *s2 = nullptr;
  Int4Operand q1{}, q2{};
  if (int4) {
    // [E, 2N/32, K/bk, 16 bk + 128]: N comes from the scales, as in SGLang
    TORCH_CHECK(is_vnni, op,
                ": moe_comp_method 3 (int4 w4a8) needs w1/w2 packed by "
                "convert_weight_packed_scale_zp and is_vnni=True (there is no unpacked int4 "
                "weight format)");
    TORCH_CHECK(w1.dim() == 4 && w2.dim() == 4, op,
                ": int4 w1 and w2 must be 4-D [E, out_features/32, in_features/bk, 16*bk+128] "
                "(from convert_weight_packed_scale_zp), got shapes ",
                w1.sizes(), " and ", w2.sizes());
    E = w1.size(0);
    TORCH_CHECK(E > 0, op, ": w1 must hold at least one expert, got shape ", w1.sizes());
    check_int4_group_tensor(w1_scale, "w1_scale", at::kFloat, E, op);
    TORCH_CHECK(w1_scale->size(1) % 2 == 0, op,
                ": w1_scale must cover 2N output features (gate and up) in blocks of 32, got ",
                w1_scale->size(1), " blocks");
    N = w1_scale->size(1) * 32 / 2;
    check_mlp_sizes(K, N, op);
    q1 = check_int4_weight(w1, "w1", w1_scale, "w1_scale", w1_zero, "w1_zero", E, 2 * N, K, op);
    q2 = check_int4_weight(w2, "w2", w2_scale, "w2_scale", w2_zero, "w2_zero", E, K, N, op);
    s1 = q1.scale, s2 = q2.scale;
  } else {
    TORCH_CHECK(w1.dim() == 3, op, ": w1 must be a 3-D tensor [E, 2N, K], got shape ", w1.sizes());
    E = w1.size(0), N = w1.size(1) / 2;
    TORCH_CHECK(E > 0, op, ": w1 must hold at least one expert, got shape ", w1.sizes());
    TORCH_CHECK(w1.size(1) % 2 == 0 && N > 0, op,
                ": w1.size(1) must be 2N (gate and up rows), a positive even number, got ",
                w1.size(1));
    check_mlp_sizes(K, N, op);
    pw1 = prepare_weight(w1, "w1", op, spec, {E, 2 * N, K}, is_vnni);
    pw2 = prepare_weight(w2, "w2", op, spec, {E, K, N}, is_vnni);
    std::tie(s1, s2) = scale_pointers(spec, w1_scale, w2_scale, {E}, N, K, bn, bk, op);
  }

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
  const auto idt = topk_ids.scalar_type();
  TORCH_CHECK(idt == at::kInt || idt == at::kLong, op, ": topk_ids must be int32 or int64, got ",
              dtype_name(idt));
  const auto wdt = topk_weights.scalar_type();
  TORCH_CHECK(wdt == at::kFloat || wdt == at::kDouble || wdt == at::kBFloat16 || wdt == at::kHalf,
              op, ": topk_weights must be float32, float64, bfloat16 or float16, got ",
              dtype_name(wdt));
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor weights = topk_weights.contiguous();

  TORCH_CHECK(w1_bias.has_value() == w2_bias.has_value(), op,
              ": w1_bias and w2_bias must be given together (got only ",
              w1_bias.has_value() ? "w1_bias" : "w2_bias", ")");
  if (w1_bias.has_value()) {
    for (const auto &[b, name, cols] :
         {std::tuple{*w1_bias, "w1_bias", 2 * N}, std::tuple{*w2_bias, "w2_bias", K}}) {
      check_dense(b, name, op, 2);
      TORCH_CHECK(b.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
                  dtype_name(b.scalar_type()));
      TORCH_CHECK(b.size(0) == E && b.size(1) == cols, op, ": ", name, " must have shape [", E,
                  ", ", cols, "], got ", b.sizes());
    }
  }
  TORCH_CHECK(alpha.has_value() == limit.has_value(), op,
              ": alpha and limit must be given together (they select the clamped swiglu "
              "activation); got only ",
              alpha.has_value() ? "alpha" : "limit");

  at::Tensor out = inplace ? hidden_states : new_output_like(hidden_states);
  cpumoe_moe_problem p{};
  p.M = M, p.K = K, p.N = N, p.E = E, p.topk = ids.size(1);
  p.scheme = spec.scheme;
  p.act_dtype = adt;
  p.w1_scale = s1;
  p.w2_scale = s2;
  p.block_n = bn, p.block_k = bk;
  p.w1_zero = q1.zero, p.w2_zero = q2.zero;
  p.w1_group = q1.group, p.w2_group = q2.group;
  p.activation = alpha.has_value() ? CPUMOE_ACT_SWIGLU_CLAMP : CPUMOE_ACT_SILU_MUL;
  p.alpha = alpha.has_value() ? static_cast<float>(*alpha) : 0.0f;
  p.limit = limit.has_value() ? static_cast<float>(*limit) : 0.0f;
  p.x = hidden_states.data_ptr();
  p.w1 = pw1.data_ptr();
  p.w2 = pw2.data_ptr();
  p.topk_ids = ids.data_ptr();
  p.topk_ids_dtype = idt == at::kInt ? CPUMOE_DTYPE_I32 : CPUMOE_DTYPE_I64;
  p.topk_weights = weights.data_ptr();
  p.topk_weights_dtype = wdt == at::kFloat      ? CPUMOE_DTYPE_F32
                         : wdt == at::kDouble   ? CPUMOE_DTYPE_F64
                         : wdt == at::kBFloat16 ? CPUMOE_DTYPE_BF16
                                                : CPUMOE_DTYPE_F16;
  p.w1_bias = w1_bias.has_value() ? w1_bias->data_ptr<float>() : nullptr;
  p.w2_bias = w2_bias.has_value() ? w2_bias->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  run_problem(p, op);
  return out;
}

at::Tensor fused_experts_seed(const at::Tensor &hidden_states, const at::Tensor &w1,
                              const at::Tensor &w2, const at::Tensor &topk_weights,
                              const at::Tensor &topk_ids, bool inplace, int64_t moe_comp_method,
                              const std::optional<at::Tensor> &w1_scale,
                              const std::optional<at::Tensor> &w2_scale,
                              const std::optional<at::Tensor> &w1_zero,
                              const std::optional<at::Tensor> &w2_zero,
                              at::OptionalIntArrayRef block_size, bool is_vnni) {
  return fused_experts_impl(hidden_states, w1, w2, topk_weights, topk_ids, inplace, moe_comp_method,
                            w1_scale, w2_scale, w1_zero, w2_zero, block_size, std::nullopt,
                            std::nullopt, std::nullopt, std::nullopt, is_vnni);
}

at::Tensor shared_expert_cpu(
    const at::Tensor &hidden_states, const at::Tensor &w1, const at::Tensor &w2,
    const std::optional<at::Tensor> &fused_experts_out, std::optional<double> routed_scaling_factor,
    bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, const std::optional<at::Tensor> &w1_scale,
    const std::optional<at::Tensor> &w2_scale, at::OptionalIntArrayRef block_size, bool is_vnni) {
  const char *op = "shared_expert_cpu";
  TORCH_CHECK(!(use_int8_w8a8 && use_fp8_w8a16), op,
              ": use_int8_w8a8 and use_fp8_w8a16 cannot both be True");
  check_dense(hidden_states, "hidden_states", op, 2);
  const cpumoe_dtype adt = act_dtype(hidden_states, op);
  const at::ScalarType dt = hidden_states.scalar_type();
  SchemeSpec spec = scheme_spec(use_int8_w8a8 ? 1 : use_fp8_w8a16 ? 2 : 0, dt);
  // messages name this op's flags, not moe_comp_method
  spec.label = use_int8_w8a8   ? "use_int8_w8a8=True (int8 w8a8)"
               : use_fp8_w8a16 ? "use_fp8_w8a16=True (fp8 w8a16)"
                               : "bf16/fp16 weights (use_int8_w8a8 and use_fp8_w8a16 False)";
  const auto [bn, bk] = check_scale_args(spec, w1_scale, w2_scale, block_size, op);
  const int64_t M = hidden_states.size(0), K = hidden_states.size(1);
  check_cpu_tensor(w1, "w1", op);
  TORCH_CHECK(w1.dim() == 2, op, ": w1 must be a 2-D tensor [2N, K], got shape ", w1.sizes());
  const int64_t N = w1.size(0) / 2;
  TORCH_CHECK(w1.size(0) % 2 == 0 && N > 0, op,
              ": w1.size(0) must be 2N (gate and up rows), a positive even number, got ",
              w1.size(0));
  check_mlp_sizes(K, N, op);
  const at::Tensor pw1 = prepare_weight(w1, "w1", op, spec, {2 * N, K}, is_vnni);
  const at::Tensor pw2 = prepare_weight(w2, "w2", op, spec, {K, N}, is_vnni);
  const auto [s1, s2] = scale_pointers(spec, w1_scale, w2_scale, {}, N, K, bn, bk, op);
  TORCH_CHECK(fused_experts_out.has_value() == routed_scaling_factor.has_value(), op,
              ": fused_experts_out and routed_scaling_factor must be given together (got only ",
              fused_experts_out.has_value() ? "fused_experts_out" : "routed_scaling_factor", ")");
  if (fused_experts_out.has_value()) {
    check_dense(*fused_experts_out, "fused_experts_out", op, 2);
    TORCH_CHECK(fused_experts_out->scalar_type() == dt, op,
                ": fused_experts_out must have the dtype of hidden_states (", dtype_name(dt),
                "), got ", dtype_name(fused_experts_out->scalar_type()));
    TORCH_CHECK(fused_experts_out->sizes() == hidden_states.sizes(), op,
                ": fused_experts_out must have the shape of hidden_states ", hidden_states.sizes(),
                ", got ", fused_experts_out->sizes());
  }
  at::Tensor out = inplace ? hidden_states : new_output_like(hidden_states);
  cpumoe_moe_problem p{};
  p.M = M, p.K = K, p.N = N, p.E = 1, p.topk = 1;
  p.scheme = spec.scheme;
  p.w1_scale = s1;
  p.w2_scale = s2;
  p.block_n = bn, p.block_k = bk;
  p.act_dtype = adt;
  p.activation = CPUMOE_ACT_SILU_MUL;
  p.x = hidden_states.data_ptr();
  p.w1 = pw1.data_ptr();
  p.w2 = pw2.data_ptr();
  if (fused_experts_out.has_value()) {
    p.residual = fused_experts_out->data_ptr();
    p.residual_scale = static_cast<float>(*routed_scaling_factor);
  }
  p.out = out.data_ptr();
  run_problem(p, op);
  return out;
}

// ---- Python-level helpers (cpumoe._C) -------------------------------------------------

std::string active_isa() {
  return cpumoe_isa_name(cpumoe_active_isa());
}
std::string best_isa() {
  return cpumoe_isa_name(cpumoe_best_supported_isa());
}

void set_isa(const std::string &name) {
  const cpumoe_isa isa = cpumoe_isa_from_name(name.c_str());
  TORCH_CHECK(isa != CPUMOE_ISA_COUNT, "cpumoe.set_isa: unknown tier '", name,
              "' (expected scalar, avx2 or avx512)");
  check_status(cpumoe_set_isa_cap(isa), "cpumoe.set_isa");
}

double probe_read(const at::Tensor &buffer, int64_t passes) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(),
              "probe_read: contiguous CPU buffer");
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_read(buffer.data_ptr(), buffer.nbytes(), passes, &runner);
}

// The number of distinct OS threads that torch's runner spreads `workers` workers over: a
// check that they really run in parallel (without OpenMP in this file's build it is 1).
int64_t runner_threads(int64_t workers) {
  TORCH_CHECK(workers >= 1, "runner_threads: at least one worker");
  std::vector<std::thread::id> ids(static_cast<size_t>(workers));
  run_on_aten_threads(
      nullptr, workers,
      [](void *arg, int64_t w) {
        (*static_cast<std::vector<std::thread::id> *>(arg))[static_cast<size_t>(w)] =
            std::this_thread::get_id();
      },
      &ids);
  std::sort(ids.begin(), ids.end());
  return std::unique(ids.begin(), ids.end()) - ids.begin();
}

double probe_fma(int64_t iterations) {
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_fma(iterations, &runner);
}

}  // namespace

TORCH_LIBRARY(cpumoe, m) {
  m.def(
      "fused_experts_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
      "Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, "
      "Tensor? w1_zero, Tensor? w2_zero, int[]? block_size, bool is_vnni) -> Tensor");
  m.def(
      "fused_experts_cpu.bias(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
      "Tensor topk_ids, bool inplace, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale, "
      "Tensor? w1_zero, Tensor? w2_zero, int[]? block_size, Tensor? w1_bias, Tensor? w2_bias, "
      "float? alpha, float? limit, bool is_vnni) -> Tensor");
  m.def(
      "shared_expert_cpu(Tensor hidden_states, Tensor w1, Tensor w2, Tensor? fused_experts_out, "
      "float? routed_scaling_factor, bool inplace, bool use_int8_w8a8, bool use_fp8_w8a16, "
      "Tensor? w1_scale, Tensor? w2_scale, int[]? block_size, bool is_vnni) -> Tensor");
  m.def("convert_weight_packed(Tensor weight) -> Tensor");
  m.def(
      "convert_weight_packed_scale_zp(Tensor weight, Tensor qzeros, Tensor scales, int "
      "quant_method_4bit) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cpumoe, CPU, m) {
  m.impl("fused_experts_cpu", &fused_experts_seed);
  m.impl("fused_experts_cpu.bias", &fused_experts_impl);
  m.impl("shared_expert_cpu", &shared_expert_cpu);
  m.impl("convert_weight_packed", &convert_weight_packed);
  m.impl("convert_weight_packed_scale_zp", &convert_weight_packed_scale_zp);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cpumoe native helpers (the ops themselves are torch.ops.cpumoe.*)";
  m.def("active_isa", &active_isa, "ISA tier the ops use");
  m.def("best_isa", &best_isa, "best ISA tier this CPU and build support");
  m.def("set_isa", &set_isa, "cap the active tier (scalar, avx2, avx512)");
  m.def("isa_reason", [] { return std::string(cpumoe_isa_reason()); });
  m.def("cpu_features", [] { return std::string(cpumoe_cpu_features()); });
  m.def("built_isas", [] {
    std::vector<std::string> v;
    for (int i = 0; i < CPUMOE_ISA_COUNT; ++i)
      v.emplace_back(cpumoe_isa_name(static_cast<cpumoe_isa>(i)));
    return v;
  });
  m.def(
      "numerics_class",
      [](const std::string &name) {
        const cpumoe_isa isa = cpumoe_isa_from_name(name.c_str());
        TORCH_CHECK(isa != CPUMOE_ISA_COUNT, "cpumoe.numerics_class: unknown tier '", name, "'");
        return std::string(cpumoe_isa_numerics(isa));
      },
      "numerics class of a tier's results: tiers of one class give the same bits");
  m.def(
      "release_workspace", [] { cached_workspace = at::Tensor(); },
      "free the calling thread's cached op workspace");
  m.def(
      "workspace_bytes", [] { return cached_workspace.defined() ? cached_workspace.nbytes() : 0; },
      "bytes of the calling thread's cached op workspace");
  m.def("probe_read", &probe_read, "stream a buffer `passes` times on torch's threads");
  m.def(
      "probe_int8",
      [](int64_t iterations) {
        const cpumoe_runner runner = aten_runner();
        return cpumoe_probe_int8(iterations, &runner);
      },
      "u8*s8 ops done by `iterations` of the int8 peak loop per thread (VNNI on avx512)");
  m.def("probe_fma", &probe_fma, "flops done by `iterations` of the FMA peak loop per thread");
  m.def("runner_threads", &runner_threads,
        "distinct OS threads that torch's runner gives `workers` workers");
}
