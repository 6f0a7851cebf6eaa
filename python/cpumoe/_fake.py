"""Meta ("fake") kernels so the ops trace under torch.compile and torch.library.opcheck.

Like SGLang's, the schemas carry no alias annotation: with ``inplace=True`` the real
op writes into ``hidden_states`` and returns it, while tracing sees a fresh tensor.
"""

import torch


def _same_device(op, hidden_states, *, first_name="hidden_states", **tensors):
    """A meta tensor among CPU tensors sends the call here; without this check it would
    return an uninitialized CPU tensor. Under FakeTensorMode all devices agree.
    ``first_name`` is how the op names its first tensor (``mat1`` for the linear ops)."""
    for name, t in tensors.items():
        if t is not None and t.device != hidden_states.device:
            raise RuntimeError(
                f"{op}: {name} is on {t.device} but {first_name} is on {hidden_states.device}; "
                "all tensors must be CPU tensors"
            )


@torch.library.register_fake("cpumoe::fused_experts_cpu")
def _fused_experts_fake(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                        moe_comp_method, w1_scale, w2_scale, w1_zero, w2_zero, block_size,
                        is_vnni):
    _same_device("fused_experts_cpu", hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
                 topk_ids=topk_ids, w1_scale=w1_scale, w2_scale=w2_scale, w1_zero=w1_zero,
                 w2_zero=w2_zero)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("cpumoe::fused_experts_cpu.bias")
def _fused_experts_bias_fake(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                             moe_comp_method, w1_scale, w2_scale, w1_zero, w2_zero, block_size,
                             w1_bias, w2_bias, alpha, limit, is_vnni):
    _same_device("fused_experts_cpu", hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
                 topk_ids=topk_ids, w1_scale=w1_scale, w2_scale=w2_scale, w1_zero=w1_zero,
                 w2_zero=w2_zero, w1_bias=w1_bias, w2_bias=w2_bias)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("cpumoe::fused_experts_cpu.activation")
def _fused_experts_activation_fake(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                                   moe_comp_method, w1_scale, w2_scale, w1_zero, w2_zero,
                                   block_size, w1_bias, w2_bias, alpha, limit, is_vnni,
                                   activation=None):
    return _fused_experts_bias_fake(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                                    moe_comp_method, w1_scale, w2_scale, w1_zero, w2_zero,
                                    block_size, w1_bias, w2_bias, alpha, limit, is_vnni)


@torch.library.register_fake("cpumoe::fused_experts_cpu.out")
def _fused_experts_out_fake(out, hidden_states, w1, w2, topk_weights, topk_ids, moe_comp_method,
                            w1_scale, w2_scale, w1_zero, w2_zero, a1_scale, block_size, w1_bias,
                            w2_bias, alpha, limit, is_vnni):
    _same_device("fused_experts_cpu", hidden_states, out=out, w1=w1, w2=w2,
                 topk_weights=topk_weights, topk_ids=topk_ids, w1_scale=w1_scale,
                 w2_scale=w2_scale, w1_zero=w1_zero, w2_zero=w2_zero, a1_scale=a1_scale,
                 w1_bias=w1_bias, w2_bias=w2_bias)


@torch.library.register_fake("cpumoe::fused_experts_fp32_cpu")
def _fused_experts_fp32_fake(hidden_states, w1, w2, topk_weights, topk_ids, moe_comp_method,
                             w1_scale, w2_scale, w1_zero, w2_zero, block_size, w1_bias, w2_bias,
                             alpha, limit, is_vnni, activation=None):
    _same_device("fused_experts_fp32_cpu", hidden_states, w1=w1, w2=w2,
                 topk_weights=topk_weights, topk_ids=topk_ids, w1_scale=w1_scale,
                 w2_scale=w2_scale, w1_zero=w1_zero, w2_zero=w2_zero, w1_bias=w1_bias,
                 w2_bias=w2_bias)
    return hidden_states.new_empty(hidden_states.shape, dtype=torch.float32)


@torch.library.register_fake("cpumoe::shared_expert_cpu")
def _shared_expert_fake(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor,
                        inplace, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size,
                        is_vnni):
    _same_device("shared_expert_cpu", hidden_states, w1=w1, w2=w2,
                 fused_experts_out=fused_experts_out, w1_scale=w1_scale, w2_scale=w2_scale)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("cpumoe::shared_expert_cpu.mxfp4")
def _shared_expert_mxfp4_fake(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor,
                              inplace, use_int8_w8a8, use_fp8_w8a16, use_mxfp4, w1_scale,
                              w2_scale, block_size, alpha, limit, is_vnni):
    _same_device("shared_expert_cpu", hidden_states, w1=w1, w2=w2,
                 fused_experts_out=fused_experts_out, w1_scale=w1_scale, w2_scale=w2_scale)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("cpumoe::convert_weight_packed")
def _convert_weight_packed_fake(weight):
    if weight.dim() == 2 and weight.shape[0] < 16:
        return weight.new_empty((weight.shape[1], weight.shape[0]), dtype=torch.float32)
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


@torch.library.register_fake("cpumoe::convert_scale_packed")
def _convert_scale_packed_fake(scale):
    return torch.empty_like(scale, memory_format=torch.contiguous_format)


@torch.library.register_fake("cpumoe::convert_weight_packed_scale_zp")
def _convert_weight_packed_scale_zp_fake(weight, qzeros, scales, quant_method_4bit):
    *lead, rows, cols = weight.shape
    ic, oc = (rows, cols * 8) if quant_method_4bit == 0 else (rows * 8, cols)
    groups = scales.shape[-2]
    group = ic // groups
    bk = min(group, 128)
    packed = weight.new_empty((*lead, oc // 32, ic // bk, 16 * bk + 128), dtype=torch.uint8)
    zeros = weight.new_empty((*lead, oc // 32, groups, 32), dtype=torch.int8)
    out_scales = weight.new_empty((*lead, oc // 32, groups, 32), dtype=torch.float32)
    return packed, zeros, out_scales


def _register_routing_fake(op):
    """The fake kernel of a routing op: (topk_weights float32, topk_ids int32) [M, topk], as
    the real op returns them, M the rows of its first tensor (hidden_states, or
    gating_output for hash_topk_cpu); every tensor argument must be on that one's device."""
    names = [a.name for a in getattr(torch.ops.cpumoe, op).default._schema.arguments]

    def fake(*args, **kwargs):
        bound = {**dict(zip(names, args)), **kwargs}
        first = bound.pop(names[0])
        _same_device(op, first, first_name=names[0],
                     **{k: v for k, v in bound.items() if isinstance(v, torch.Tensor)})
        M, topk = first.shape[0], bound["topk"]
        return (first.new_empty((M, topk), dtype=torch.float32),
                first.new_empty((M, topk), dtype=torch.int32))

    torch.library.register_fake(f"cpumoe::{op}")(fake)


for _op in ("topk_softmax_cpu", "topk_sigmoid_cpu", "grouped_topk_cpu", "biased_grouped_topk_cpu",
            "biased_topk_cpu", "hash_topk_cpu"):
    _register_routing_fake(_op)


# The dense linear ops: [M, N] in the activations' dtype; N from the weight's rows (int4:
# from its scales, [N/32, groups, 32]).


@torch.library.register_fake("cpumoe::weight_packed_linear")
def _weight_packed_linear_fake(mat1, mat2, bias, is_vnni):
    _same_device("weight_packed_linear", mat1, first_name="mat1", mat2=mat2, bias=bias)
    return mat1.new_empty((mat1.shape[0], mat2.shape[0]))


@torch.library.register_fake("cpumoe::int8_scaled_mm_with_quant")
def _int8_scaled_mm_with_quant_fake(mat1, mat2, scales2, bias, out_dtype, is_vnni):
    _same_device("int8_scaled_mm_with_quant", mat1, first_name="mat1", mat2=mat2,
                 scales2=scales2, bias=bias)
    return mat1.new_empty((mat1.shape[0], mat2.shape[0]), dtype=out_dtype)


@torch.library.register_fake("cpumoe::fp8_scaled_mm_cpu")
def _fp8_scaled_mm_fake(mat1, mat2, scales2, block_size, bias, out_dtype, is_vnni):
    _same_device("fp8_scaled_mm_cpu", mat1, first_name="mat1", mat2=mat2, scales2=scales2,
                 bias=bias)
    return mat1.new_empty((mat1.shape[0], mat2.shape[0]), dtype=out_dtype)


@torch.library.register_fake("cpumoe::int4_scaled_mm_cpu")
def _int4_scaled_mm_fake(x, w, w_zeros, w_scales, bias):
    _same_device("int4_scaled_mm_cpu", x, first_name="x", w=w, w_zeros=w_zeros,
                 w_scales=w_scales, bias=bias)
    return x.new_empty((x.shape[0], w_scales.shape[0] * w_scales.shape[-1]))
