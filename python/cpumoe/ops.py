"""Typed Python wrappers of the torch.ops.cpumoe operators."""

from __future__ import annotations

import enum
from typing import Optional, Sequence, Tuple

import torch


class MoeCompMethod(enum.IntEnum):
    """Values of ``moe_comp_method`` (SGLang's ``CPUQuantMethod``)."""

    UNQUANT = 0  # bf16/fp16 weights in the activation dtype
    INT8_W8A8 = 1
    FP8_W8A16 = 2
    INT4_W4A8 = 3
    MXFP4 = 4  # gpt-oss: e2m1 weights, an e8m0 scale per 32 input features


def _tracing() -> bool:
    """True under torch.compile / export tracing. The op schemas (SGLang's) declare no
    mutation or aliasing, so an ``inplace=True`` call traced as such would hide the write
    to ``hidden_states`` from the compiler (it may then reorder reads of hidden_states
    past the op, giving wrong values). While tracing, the wrappers therefore run the op
    out of place and ``copy_`` the result into ``hidden_states``: a mutation the compiler
    sees. Eager calls keep the zero-copy in-place path."""
    return torch.compiler.is_compiling()


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """Packs expert weights ``[E, OC, IC]`` (or one matrix ``[OC, IC]``) into the
    VNNI layout the kernels read (docs/FORMATS.md); byte-identical to SGLang's
    ``convert_weight_packed``, so weights packed by either run on both.

    bf16/fp16: same shape and dtype, rows in blocks of 32, each ``[IC/2][32][2]``.
    Requires ``OC % 16 == 0`` and ``IC % 32 == 0``. A 2-D weight with ``OC < 16``
    returns ``weight.float().t().contiguous()`` as SGLang does.

    uint8 weights are MXFP4 codes ``[..., OC, IC/2]`` (two e2m1 codes a byte, the even
    input feature in the low nibble): same shape, rows in blocks of 32, each
    ``[IC/2][32]`` bytes with rows ``r`` and ``16 + r`` sharing a byte
    (docs/FORMATS.md). Requires ``OC % 32 == 0`` and ``IC % 32 == 0``. Their scales go
    through :func:`convert_scale_packed`.
    """
    return torch.ops.cpumoe.convert_weight_packed(weight)


def convert_scale_packed(scale: torch.Tensor) -> torch.Tensor:
    """Packs MXFP4 e8m0 scales ``uint8 [..., OC, IC/32]`` (one exponent byte per output
    channel and 32 input features, as a checkpoint stores them) for ``moe_comp_method=4``;
    byte-identical to SGLang's ``convert_scale_packed``. Same shape and dtype, the rows in
    blocks of 32 stored ``[IC/32][32]`` (docs/FORMATS.md). Requires ``OC % 32 == 0``.
    """
    return torch.ops.cpumoe.convert_scale_packed(scale)


def convert_weight_packed_scale_zp(qweight: torch.Tensor, qzeros: torch.Tensor,
                                   scales: torch.Tensor, quant_method_4bit: int):
    """Packs an AWQ (``quant_method_4bit=0``) or GPTQ (``1``) 4-bit checkpoint for
    ``moe_comp_method=3``; byte-identical to SGLang's op of the same name.

    Per expert (a leading ``E`` dim is optional on all three), with OC output and IC input
    features in G groups along IC:

    * AWQ: ``qweight`` int32 ``[IC, OC/8]``, ``qzeros`` int32 ``[G, OC/8]``;
    * GPTQ: ``qweight`` int32 ``[IC/8, OC]``, ``qzeros`` int32 ``[G, OC/8]`` (zero - 1);
    * ``scales`` ``[G, OC]`` bf16, fp16 or fp32.

    Returns ``(weight uint8 [OC/32, IC/bk, 16*bk + 128], zeros int8 [OC/32, G, 32],
    scales fp32 [OC/32, G, 32])`` with ``bk = min(IC/G, 128)``; pass them to
    :func:`fused_experts` as ``w*``, ``w*_zero`` and ``w*_scale``. Group sizes: multiples
    of 4 up to 128, or multiples of 128 (docs/FORMATS.md).
    """
    return torch.ops.cpumoe.convert_weight_packed_scale_zp(qweight, qzeros, scales,
                                                           int(quant_method_4bit))


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inplace: bool = False,
    moe_comp_method: int = MoeCompMethod.UNQUANT,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w1_zero: Optional[torch.Tensor] = None,
    w2_zero: Optional[torch.Tensor] = None,
    block_size: Optional[Sequence[int]] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    is_vnni: bool = True,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Mixture-of-Experts layer: for every token m and slot j with expert
    e = topk_ids[m, j] (``-1`` skips the slot),
    ``out[m] += topk_weights[m, j] * (w2[e] @ act(w1[e] @ x[m] + b1[e]) + b2[e])``.

    Args:
        hidden_states: ``[M, K]`` bfloat16 or float16, contiguous.
        w1: ``[E, 2N, K]`` gate rows then up rows (interleaved gate/up when ``alpha``
            and ``limit`` are given), in the dtype of ``hidden_states``.
        w2: ``[E, K, N]``.
        topk_weights: ``[M, topk]``, any float dtype.
        topk_ids: ``[M, topk]``, int32 or int64, values in ``[0, E)`` or ``-1``.
        inplace: write the result into ``hidden_states`` and return it.
        moe_comp_method: weight scheme, see :class:`MoeCompMethod`.
        w1_scale, w2_scale: INT8: fp32 per output channel; FP8: fp32 block scales with
            ``block_size``, or per-tensor scales ``[E]`` with ``block_size=None``; INT4:
            from :func:`convert_weight_packed_scale_zp`; MXFP4: uint8 e8m0 ``[E, 2N, K/32]``
            / ``[E, K, N/32]`` from :func:`convert_scale_packed` (w1/w2 are then uint8 codes
            ``[E, 2N, K/2]`` / ``[E, K, N/2]``).
        w1_zero, w2_zero: INT4 only: the zero points from
            :func:`convert_weight_packed_scale_zp` (w1/w2 are then its packed weights).
        w1_bias, w2_bias: optional float32 ``[E, 2N]`` and ``[E, K]`` (both or neither).
        alpha, limit: both select GPT-OSS's clamped SwiGLU; ``limit`` alone (``>= 0``)
            DeepSeek-V4's clamped SiLU·mul, ``silu(min(gate, limit)) * clamp(up, -limit,
            limit)`` on gate rows then up rows; ``alpha`` alone is a RuntimeError.
        activation: without ``alpha``/``limit``, the function of the gate half: ``"silu"``
            (None means this) or ``"gelu"`` (the erf form, ``x * Phi(x)``); any other name
            is a RuntimeError, and so is ``"gelu"`` with ``limit``.
        is_vnni: True when ``w1``/``w2`` come from :func:`convert_weight_packed`;
            False packs them on every call (slow, for convenience). It concerns the
            weights only: MXFP4 scales always come from :func:`convert_scale_packed`,
            as in SGLang.

    Returns:
        ``[M, K]`` in the dtype of ``hidden_states``. Accumulation is float32 with
        one rounding at the end; results do not depend on the thread count.
    """
    block = list(block_size) if block_size is not None else None
    op = torch.ops.cpumoe.fused_experts_cpu
    traced_inplace = inplace and _tracing()
    if traced_inplace:
        inplace = False  # see _tracing()
    if activation is not None:
        out = op.activation(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                            int(moe_comp_method), w1_scale, w2_scale, w1_zero, w2_zero, block,
                            w1_bias, w2_bias, alpha, limit, is_vnni, activation)
    elif w1_bias is None and w2_bias is None and alpha is None and limit is None:
        out = op.default(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                         int(moe_comp_method), w1_scale, w2_scale, w1_zero, w2_zero, block,
                         is_vnni)
    else:
        out = op.bias(hidden_states, w1, w2, topk_weights, topk_ids, inplace,
                      int(moe_comp_method), w1_scale, w2_scale, w1_zero, w2_zero, block,
                      w1_bias, w2_bias, alpha, limit, is_vnni)
    return hidden_states.copy_(out) if traced_inplace else out


def fused_experts_into(
    out: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    moe_comp_method: int = MoeCompMethod.UNQUANT,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w1_zero: Optional[torch.Tensor] = None,
    w2_zero: Optional[torch.Tensor] = None,
    block_size: Optional[Sequence[int]] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    is_vnni: bool = True,
) -> None:
    """:func:`fused_experts` written into ``out`` (``torch.ops.cpumoe.fused_experts_cpu.out``,
    the schema of vLLM's CPU build): the same bits as :func:`fused_experts` returns.

    ``out`` must have the shape and dtype of ``hidden_states`` and be contiguous; it may be
    ``hidden_states`` itself (then the op runs in place) or overlap it. vLLM's ``a1_scale``
    (precomputed activation scales for its own FP8 W8A8 MoE) has no cpumoe scheme: the op
    rejects it, so this wrapper does not take it. Other arguments as :func:`fused_experts`.
    """
    block = list(block_size) if block_size is not None else None
    torch.ops.cpumoe.fused_experts_cpu.out(out, hidden_states, w1, w2, topk_weights, topk_ids,
                                           int(moe_comp_method), w1_scale, w2_scale, w1_zero,
                                           w2_zero, None, block, w1_bias, w2_bias, alpha, limit,
                                           is_vnni)


def fused_experts_fp32(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    moe_comp_method: int = MoeCompMethod.UNQUANT,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w1_zero: Optional[torch.Tensor] = None,
    w2_zero: Optional[torch.Tensor] = None,
    block_size: Optional[Sequence[int]] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    is_vnni: bool = True,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """:func:`fused_experts` without its last step: returns the float32 ``[M, K]`` sum over
    the slots as it stands before the one rounding to the activation dtype
    (``torch.ops.cpumoe.fused_experts_cpu``'s output is exactly this tensor rounded once,
    ``.to(hidden_states.dtype)``, bit for bit). cpumoe only (SGLang has no such op).

    Its use is expert parallelism: each rank computes the slots of its own experts (the
    others' ids are -1), the ranks add their float32 partial sums, and the total is
    rounded once (:func:`cpumoe.distributed.fused_experts`). Arguments as
    :func:`fused_experts`, without ``inplace``.
    """
    block = list(block_size) if block_size is not None else None
    return torch.ops.cpumoe.fused_experts_fp32_cpu(
        hidden_states, w1, w2, topk_weights, topk_ids, int(moe_comp_method), w1_scale,
        w2_scale, w1_zero, w2_zero, block, w1_bias, w2_bias, alpha, limit, is_vnni, activation)


def shared_expert(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    fused_experts_out: Optional[torch.Tensor] = None,
    routed_scaling_factor: Optional[float] = None,
    *,
    inplace: bool = False,
    use_int8_w8a8: bool = False,
    use_fp8_w8a16: bool = False,
    use_mxfp4: bool = False,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_size: Optional[Sequence[int]] = None,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    is_vnni: bool = True,
) -> torch.Tensor:
    """Dense shared expert (DeepSeek style):
    ``out = w2 @ act(w1 @ x) + routed_scaling_factor * fused_experts_out``,
    ``act`` being SiLU(gate) * up, with ``[gate; up] = w1 @ x`` (or a clamped form: ``alpha``,
    ``limit`` below); float32 inside, one rounding.

    Args:
        hidden_states: ``[M, K]`` bfloat16 or float16.
        w1: ``[2N, K]``; w2: ``[K, N]`` (packed unless ``is_vnni=False``).
        fused_experts_out: ``[M, K]`` routed output to fold in, with
            ``routed_scaling_factor`` (both or neither).
        use_int8_w8a8, use_fp8_w8a16, use_mxfp4: the weight scheme (at most one), with
            ``w1_scale`` and ``w2_scale``: INT8 per output channel; FP8 block scales with
            ``block_size``, or one scale per matrix (shape ``[]``) with ``block_size=None``;
            MXFP4: uint8 codes ``w1 [2N, K/2]``, ``w2 [K, N/2]`` and e8m0 scales
            ``[2N, K/32]``, ``[K, N/32]`` from :func:`convert_scale_packed`.
        alpha, limit: both select GPT-OSS's clamped SwiGLU (``w1`` rows then interleave
            gate and up), ``limit`` alone DeepSeek-V4's clamped SiLU·mul (gate rows then up
            rows), as in :func:`fused_experts`.
    """
    block = list(block_size) if block_size is not None else None
    traced_inplace = inplace and _tracing()
    op = torch.ops.cpumoe.shared_expert_cpu
    if not use_mxfp4 and alpha is None and limit is None:
        out = op.default(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor,
                         inplace and not traced_inplace, use_int8_w8a8, use_fp8_w8a16, w1_scale,
                         w2_scale, block, is_vnni)
    else:
        out = op.mxfp4(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor,
                       inplace and not traced_inplace, use_int8_w8a8, use_fp8_w8a16, use_mxfp4,
                       w1_scale, w2_scale, block, alpha, limit, is_vnni)
    return hidden_states.copy_(out) if traced_inplace else out


# ---------------------------------------------------------------------------------------
# Routing: the ops before the experts. Each returns ``(topk_weights, topk_ids)``: float32
# and int32 ``[M, topk]``, best expert first (higher score first; equal ones by lower
# expert index), ready for :func:`fused_experts`. ``hidden_states`` only gives M (any
# dtype). ``gating_output`` (the router logits ``[M, E]``) may be float32, bfloat16 or
# float16; any E, any topk up to E. Bit-identical for any thread count and on every ISA
# tier. docs/MATH.md ("Routing") has the math.

Routing = Tuple[torch.Tensor, torch.Tensor]


def topk_softmax(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                 renormalize: bool = False) -> Routing:
    """The ``topk`` experts of highest softmax score (Qwen3, Mixtral, OLMoE ...).

    Weights are the softmax probabilities of the chosen experts, divided by their sum when
    ``renormalize``. The ranking is by logit (the order of the exact softmax).
    """
    return torch.ops.cpumoe.topk_softmax_cpu(hidden_states, gating_output, int(topk),
                                             bool(renormalize))


def topk_sigmoid(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                 renormalize: bool = False) -> Routing:
    """The ``topk`` experts of highest sigmoid score; weights ``sigmoid(logit)``, divided by
    their sum when ``renormalize``. (SGLang's kernel takes only ``topk = 1``.)"""
    return torch.ops.cpumoe.topk_sigmoid_cpu(hidden_states, gating_output, int(topk),
                                             bool(renormalize))


def grouped_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                 renormalize: bool, num_expert_group: int, topk_group: int, *,
                 num_fused_shared_experts: int = 0,
                 routed_scaling_factor: Optional[float] = None,
                 num_token_non_padded: Optional[torch.Tensor] = None) -> Routing:
    """DeepSeek-V2's routing: softmax scores; the E experts form ``num_expert_group``
    groups of consecutive ids, each scored by its best expert; the ``topk`` best experts of
    the ``topk_group`` best groups.

    Args:
        num_fused_shared_experts: > 0 makes the last slot a fused shared expert: id
            ``E + m % num_fused_shared_experts`` for token row m, weight (sum of the routed
            weights) / ``routed_scaling_factor`` (required then), so 1 after renormalizing.
        routed_scaling_factor: multiplies every output weight (after renormalizing).
        num_token_non_padded: one-element int tensor n: rows from n on are padding and get
            ids -1 (skipped by :func:`fused_experts`) and weights 0.
    """
    return torch.ops.cpumoe.grouped_topk_cpu(hidden_states, gating_output, int(topk),
                                             bool(renormalize), int(num_expert_group),
                                             int(topk_group), int(num_fused_shared_experts),
                                             routed_scaling_factor, num_token_non_padded)


def biased_grouped_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor,
                        correction_bias: torch.Tensor, topk: int, renormalize: bool,
                        num_expert_group: int, topk_group: int, *,
                        num_fused_shared_experts: int = 0,
                        routed_scaling_factor: Optional[float] = None,
                        num_token_non_padded: Optional[torch.Tensor] = None) -> Routing:
    """DeepSeek-V3/R1's routing: sigmoid scores; experts ranked by score +
    ``correction_bias`` ([E], float32/bfloat16/float16); groups scored by the sum of their
    two best ranks; the ``topk`` best experts of the ``topk_group`` best groups, weighted by
    their unbiased scores. Other arguments as :func:`grouped_topk` (DeepSeek-V3:
    ``num_expert_group=8, topk_group=4, topk=8, renormalize=True``, factor 2.5)."""
    return torch.ops.cpumoe.biased_grouped_topk_cpu(
        hidden_states, gating_output, correction_bias, int(topk), bool(renormalize),
        int(num_expert_group), int(topk_group), int(num_fused_shared_experts),
        routed_scaling_factor, num_token_non_padded)


def biased_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor,
                correction_bias: torch.Tensor, topk: int, renormalize: bool, *,
                scoring_func: str = "sigmoid", num_fused_shared_experts: int = 0,
                routed_scaling_factor: Optional[float] = None,
                apply_routed_scaling_factor_on_output: bool = False) -> Routing:
    """vLLM's ``biased_topk_cpu`` (DeepSeek-V4): :func:`biased_grouped_topk` without groups,
    with ``scoring_func`` ``"sigmoid"`` or ``"sqrtsoftplus"`` (sqrt(softplus(x))).
    ``routed_scaling_factor`` scales the output weights only with
    ``apply_routed_scaling_factor_on_output``; fused shared experts divide by it always."""
    return torch.ops.cpumoe.biased_topk_cpu(
        hidden_states, gating_output, correction_bias, int(topk), bool(renormalize),
        str(scoring_func), int(num_fused_shared_experts), routed_scaling_factor,
        bool(apply_routed_scaling_factor_on_output))


def hash_topk(gating_output: torch.Tensor, tid2eid: torch.Tensor, topk: int, *,
              scoring_func: str = "sqrtsoftplus", num_fused_shared_experts: int = 0,
              routed_scaling_factor: float = 1.0) -> Routing:
    """Hash routing (``hash_topk_cpu`` of vLLM and SGLang; DeepSeek-V4's first layers): each
    token's experts come from a table indexed by its input id, not from a top-k.

    Args:
        gating_output: router logits ``[M, E]``, float32, bfloat16 or float16.
        tid2eid: int32 ``[M, R]``, the table rows of the tokens' ids (the caller indexes
            the model's table by ``input_ids``); every id in ``[0, E)``, any strides.
            ``R = topk`` without a fused shared expert, ``topk - 1`` with one.
        scoring_func: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"`` (sqrt(softplus(x))).
        num_fused_shared_experts: > 0 makes the last slot a fused shared expert: id
            ``E + m % num_fused_shared_experts`` for token row m, weight (sum of the routed
            weights) / ``routed_scaling_factor`` (then finite and non-zero; unused otherwise).

    Slot j < R holds expert ``tid2eid[m, j]`` with weight ``score[m, tid2eid[m, j]]``;
    sigmoid and sqrtsoftplus weights are divided by their sum when it is > 0 (softmax
    weights are left as they are).
    """
    return torch.ops.cpumoe.hash_topk_cpu(
        gating_output, tid2eid, int(topk), str(scoring_func), int(num_fused_shared_experts),
        int(gating_output.shape[1]) if gating_output.dim() == 2 else -1,
        float(routed_scaling_factor))


# ---------------------------------------------------------------------------------------
# Dense linear layers: SGLang's four ops for the layers around the experts (attention
# projections, dense MLPs, lm_head), on the experts' own kernels: each is the first GEMM of
# :func:`fused_experts` on one expert holding all M rows, then ``+ bias`` in float32 and one
# rounding to the activation dtype. ``out [M, N] = mat1 [M, K] @ W [N, K].T + bias``.
# ``mat1`` is bfloat16 or float16 ``[M, K]`` (any strides), ``K`` and ``N`` multiples of 32;
# ``bias`` ``[N]`` float32 (bfloat16/float16 are widened exactly). Results are the same bits
# for any thread count, and on every tier of a numerics class (docs/NUMERICS.md).


def weight_packed_linear(mat1: torch.Tensor, mat2: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *,
                         is_vnni: bool = True) -> torch.Tensor:
    """bf16/fp16 linear: ``mat1 @ mat2.T + bias`` with float32 accumulation.

    Args:
        mat1: ``[M, K]`` bfloat16 or float16.
        mat2: ``[N, K]`` in mat1's dtype, packed by :func:`convert_weight_packed` (or, with
            ``is_vnni=False``, unpacked: packed on every call).
        bias: optional ``[N]``.

    Returns:
        ``[M, N]`` in mat1's dtype.
    """
    return torch.ops.cpumoe.weight_packed_linear(mat1, mat2, bias, is_vnni)


def int8_scaled_mm_with_quant(mat1: torch.Tensor, mat2: torch.Tensor, scales2: torch.Tensor,
                              bias: Optional[torch.Tensor] = None, *,
                              out_dtype: Optional[torch.dtype] = None,
                              is_vnni: bool = True) -> torch.Tensor:
    """INT8 W8A8 linear: each row of ``mat1`` quantized to int8 inside the op (per row,
    symmetric, as :func:`fused_experts` does), an exact integer GEMM with the int8 weight,
    then ``(acc * row_scale) * scales2[n] + bias[n]`` in float32.

    Args:
        mat1: ``[M, K]`` bfloat16 or float16, ``K <= 65536``.
        mat2: int8 ``[N, K + 4]`` from :func:`convert_weight_packed` (``is_vnni=False``:
            int8 ``[N, K]``, packed on every call).
        scales2: float32, one scale per output channel (``[N]`` or ``[N, 1]``).
        bias: optional ``[N]``.
        out_dtype: must be mat1's dtype (the default), as in SGLang.
    """
    out_dtype = mat1.dtype if out_dtype is None else out_dtype
    return torch.ops.cpumoe.int8_scaled_mm_with_quant(mat1, mat2, scales2, bias, out_dtype,
                                                      is_vnni)


def fp8_scaled_mm(mat1: torch.Tensor, mat2: torch.Tensor, scales2: torch.Tensor,
                  block_size: Sequence[int], bias: Optional[torch.Tensor] = None, *,
                  out_dtype: Optional[torch.dtype] = None, is_vnni: bool = True) -> torch.Tensor:
    """FP8 W8A16 linear (``fp8_scaled_mm_cpu``): e4m3 weights decoded exactly, each
    ``[block_n, block_k]`` block multiplied by its scale; activations stay 16-bit.

    Args:
        mat1: ``[M, K]`` bfloat16 or float16.
        mat2: float8_e4m3fn ``[N, K]`` from :func:`convert_weight_packed` (``is_vnni=False``:
            unpacked, packed on every call).
        scales2: float32 ``[ceil(N / block_n), ceil(K / block_k)]`` (DeepSeek's
            ``weight_scale_inv``: multiplied).
        block_size: ``[block_n, block_k]``; any ``block_n >= 1``, any even ``block_k``.
        bias: optional ``[N]``.
        out_dtype: must be mat1's dtype (the default), as in SGLang.
    """
    out_dtype = mat1.dtype if out_dtype is None else out_dtype
    return torch.ops.cpumoe.fp8_scaled_mm_cpu(mat1, mat2, scales2, list(block_size), bias,
                                              out_dtype, is_vnni)


def int4_scaled_mm(x: torch.Tensor, w: torch.Tensor, w_zeros: torch.Tensor,
                   w_scales: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """INT4 W4A8 linear (``int4_scaled_mm_cpu``) on an AWQ or GPTQ weight: rows of ``x``
    quantized to int8 inside the op, ``(nibble - zero) * scale`` weights per group.

    Args:
        x: ``[M, K]`` bfloat16 or float16.
        w, w_zeros, w_scales: the packed weight, zero points and scales that
            :func:`convert_weight_packed_scale_zp` returns for one ``[K, N]`` checkpoint
            (in that order: it returns ``(w, w_zeros, w_scales)``); ``N = w_scales.size(0) * 32``.
        bias: optional ``[N]``.

    Returns:
        ``[M, N]`` in x's dtype.
    """
    return torch.ops.cpumoe.int4_scaled_mm_cpu(x, w, w_zeros, w_scales, bias)
