"""The dense linear ops (weight_packed_linear, int8_scaled_mm_with_quant, fp8_scaled_mm_cpu,
int4_scaled_mm_cpu): ``out = round16(mat1 @ W.T + bias)`` on fused_experts' kernels.

* every tier, M from 1 to 1024 (odd M included), several K and N, bias and no bias, bf16 and
  fp16: against reference.py (the spec) and, bit for bit, against the kernels' exact order
  (exact_reference.py: an fp32 FMA chain per element for 16-bit and FP8 weights; INT8 and
  INT4 are integer sums with a fixed dequantization, so reference.py itself is exact there
  and every tier must give its bits);
* the same bits as fused_experts' first GEMM on the same rows, on every tier (amx's own
  numerics class included): fused_experts with one expert, the clamped swiglu turned into
  the identity on the gate rows (alpha = 0, up = 1) and w2 = I outputs round16(W1 x + b1)
  of its gate rows, which must equal the linear of those rows;
* thread counts (1 and 2, and two chunks of rows), is_vnni=False, strided mat1, biases in
  16-bit dtypes, M = 0, the SGLang call forms, opcheck.

Rejected inputs are in tests/test_errors.py's CATALOGUE (section "linear").
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import cpumoe
from cpumoe import MoeCompMethod, quant, reference
from cpumoe_testing import (
    DTYPES,
    assert_fp8_close,
    assert_matches_exact,
    assert_moe_close,
    isa_params,
    use_isa,
)
from exact_reference import fma_chain_matmul, fp8_block_linear

SCHEMES = ("16bit", "int8", "fp8", "int4")
METHOD = {"16bit": MoeCompMethod.UNQUANT, "int8": MoeCompMethod.INT8_W8A8,
          "fp8": MoeCompMethod.FP8_W8A16, "int4": MoeCompMethod.INT4_W4A8}
# M from 1 to 1024: decode sizes, odd ones, one row short of and past the tiers' panel and
# block edges (4, 12, 32 rows a panel; up to 4 panels a block), prefill sizes.
M_VALUES = (1, 2, 3, 5, 13, 17, 48, 63, 100, 255, 512, 1024)
# (K, N, int4 group, fp8 block): K of 96 and 160 are multiples of 32 but not of 64; int4
# groups of 4 .. 384 (bk = min(group, 128), several blocks a group for 384); fp8 blocks
# that divide neither dimension.
SHAPES = ((64, 32, 64, [32, 64]), (96, 160, 32, [48, 32]), (256, 96, 128, [128, 128]),
          (160, 288, 4, [64, 6]), (384, 64, 384, [16, 256]))


@dataclass
class Case:
    """One linear problem: the op's call, reference.py's result and the exact-order result
    (what the fp32-chain numerics class computes), each of ``bias`` (a tensor or None)."""

    x: torch.Tensor
    bias: torch.Tensor
    call: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    spec: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    exact: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    unpacked: Optional[Callable] = None  # the call with is_vnni=False (16bit, int8, fp8)


def _plus_bias(h: torch.Tensor, bias, dtype) -> torch.Tensor:
    return (h if bias is None else h + bias.float()[None, :]).to(dtype)


def make_case(scheme: str, dtype: torch.dtype, M: int, K: int, N: int, group: int = 32,
              block=(32, 64), fmt: str = "awq", seed: int = 0) -> Case:
    """Inputs of one case from their own seed (so that every tier sees the same ones):
    x ~ N(0, 1), float weights scaled by 1/sqrt(K) (outputs O(1)), a bias ~ N(0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    f = torch.randn(N, K, generator=g) / K ** 0.5
    bias = torch.randn(N, generator=g) * 0.5
    if scheme == "16bit":
        w = f.to(dtype)
        wp = cpumoe.convert_weight_packed(w)
        return Case(x, bias, lambda a, b: cpumoe.weight_packed_linear(a, wp, b),
                    lambda a, b: reference.weight_packed_linear(a, w, b),
                    lambda a, b: _plus_bias(fma_chain_matmul(a, w), b, a.dtype),
                    lambda a, b: cpumoe.weight_packed_linear(a, w, b, is_vnni=False))
    if scheme == "int8":
        q, s = quant.quantize_int8_per_channel(f)  # [N, K], [N, 1]
        qp = cpumoe.convert_weight_packed(q)
        spec = functools.partial(_int8_spec, q=q, s=s)
        return Case(x, bias, lambda a, b: cpumoe.int8_scaled_mm_with_quant(a, qp, s, b), spec,
                    spec, lambda a, b: cpumoe.int8_scaled_mm_with_quant(a, q, s, b,
                                                                         is_vnni=False))
    if scheme == "fp8":
        block = list(block)
        q, s = quant.quantize_fp8_blockwise(f, block)
        qp = cpumoe.convert_weight_packed(q)
        return Case(x, bias, lambda a, b: cpumoe.fp8_scaled_mm(a, qp, s, block, b),
                    lambda a, b: reference.fp8_scaled_mm(a, q, s, block, b),
                    lambda a, b: _plus_bias(fp8_block_linear(a, q, s, block), b, a.dtype),
                    lambda a, b: cpumoe.fp8_scaled_mm(a, q, s, block, b, is_vnni=False))
    method = {"awq": 0, "gptq": 1}[fmt]
    ckpt = quant.quantize_int4(f, group, fmt, torch.float16)
    packed = cpumoe.convert_weight_packed_scale_zp(*ckpt, method)
    unpacked = reference.unpack_int4_checkpoint(*ckpt, method)
    spec = functools.partial(_int4_spec, u=unpacked)
    return Case(x, bias, lambda a, b: cpumoe.int4_scaled_mm(a, *packed, b), spec, spec)


def _int8_spec(a, b, q, s):
    return reference.int8_scaled_mm_with_quant(a, q, s, b)


def _int4_spec(a, b, u):
    return reference.int4_scaled_mm(a, *u, b)


def case_for(scheme: str, dt: str, M: int) -> Case:
    """The case of (scheme, dtype, M): the shape cycles with M's position."""
    K, N, group, block = SHAPES[M_VALUES.index(M) % len(SHAPES)]
    fmt = "gptq" if M % 2 else "awq"
    return make_case(scheme, DTYPES[dt], M, K, N, group, block, fmt,
                     seed=zlib.crc32(f"{scheme} {dt} {M}".encode()))


@functools.lru_cache(maxsize=None)
def expected(scheme: str, dt: str, M: int, with_bias: bool):
    """(spec, exact) of a case, computed once for all tiers."""
    c = case_for(scheme, dt, M)
    b = c.bias if with_bias else None
    return c.spec(c.x, b), c.exact(c.x, b)


def check_against_references(out, spec, exact, scheme: str, msg: str = "") -> None:
    """out against the exact order (bit for bit within its numerics class; integer schemes
    bit for bit on every tier) and the spec (its scheme's tolerance)."""
    if scheme in ("int8", "int4"):
        assert torch.equal(out, exact), f"{(out != exact).sum()} elements differ {msg}"
        return
    assert_matches_exact(out, exact, METHOD[scheme], msg)
    if scheme == "16bit":
        assert_moe_close(out, spec, msg)
    else:
        assert_fp8_close(out, spec, msg)


@pytest.mark.parametrize("M", M_VALUES)
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_matches_reference(isa, scheme, dt, M):
    c = case_for(scheme, dt, M)
    for with_bias in (True, False):
        b = c.bias if with_bias else None
        out = c.call(c.x, b)
        N = c.bias.shape[0]
        assert out.shape == (M, N) and out.dtype == c.x.dtype
        spec, exact = expected(scheme, dt, M, with_bias)
        check_against_references(out, spec, exact, scheme,
                                 f"({isa}, {scheme}, {dt}, M={M}, bias={with_bias})")


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ["16bit", "int8", "fp8"])
def test_unpacked_weights(isa, scheme, dt):
    """is_vnni=False packs the weight per call: the same bits as the packed weight."""
    c = case_for(scheme, dt, 17)
    assert torch.equal(c.unpacked(c.x, c.bias), c.call(c.x, c.bias))


def moe_first_gemm(x, weight, bias, *, scheme: str, scale=None, block=None):
    """fused_experts' first GEMM of the rows x with `weight` [N, K] (N = K), observed through
    its output: one expert whose w1 interleaves the weight's rows (gate) with zero rows
    (up) and whose up bias is 1, the clamped swiglu with alpha = 0 and a limit beyond every
    value, so that act = gate * sigmoid(0) * (1 + 1) = gate exactly; w2 = I and weight 1, so
    that out = round16(act) = round16(W x + bias)."""
    N, K = weight.shape
    assert N == K
    w1 = torch.zeros(2 * N, K, dtype=weight.dtype)
    w1[0::2] = weight
    b1 = torch.ones(2 * N)
    b1[0::2] = bias
    eye = torch.eye(K, N)
    kw = {}
    if scheme == "fp8":  # the block scales of w1 repeat per gate/up pair; w2's are 1
        bn, bk = block
        assert bn % 2 == 0 and N % bn == 0
        kw = dict(moe_comp_method=MoeCompMethod.FP8_W8A16, block_size=[2 * bn, bk],
                  w1_scale=scale[None], w2_scale=torch.ones(1, K // (2 * bn), N // bk))
        eye = eye.to(torch.float8_e4m3fn)
    else:
        eye = eye.to(x.dtype)
    M = x.shape[0]
    return cpumoe.fused_experts(
        x, cpumoe.convert_weight_packed(w1[None]), cpumoe.convert_weight_packed(eye[None]),
        torch.ones(M, 1), torch.zeros(M, 1, dtype=torch.int32), w1_bias=b1[None],
        w2_bias=torch.zeros(1, K), alpha=0.0, limit=3e38, **kw)


# 130 and 290 rows: on the amx tier the linear's blocks have 8 panels of 32 rows and the fused
# MoE's 4, so 130 puts 2 rows (bf16: the decode kernel's in the MoE) after 4 panels within
# one of the linear's blocks, and 290 a 34-row tail after 8 panels.
@pytest.mark.parametrize("M", [1, 2, 3, 17, 64, 100, 130, 290])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ["16bit", "fp8"])
def test_same_bits_as_fused_experts_first_gemm(isa, scheme, dt, M):
    """The linear is fused_experts' first GEMM on the same rows, plus bias, rounded: the
    same bits on every tier, in every numerics class (moe_first_gemm observes that GEMM).
    INT8 and INT4 run integer sums with a fixed dequantization on every tier; their linear
    equals reference.int8_linear / int4_linear bit for bit (test_matches_reference), the
    functions that make fused_experts' exact reference (exact_reference.py)."""
    dtype = DTYPES[dt]
    K = N = 64
    x = torch.randn(M, K)
    f = torch.randn(N, K) / K ** 0.5
    # two products that cancel exactly (k = 5 and 20, one fp8 block): the partial sums pass
    # through +-2^11 |w|, where fp32 keeps few bits of the other terms, so kernels that sum
    # in different orders give visibly different outputs instead of agreeing by luck
    x[:, 5], x[:, 20] = 2048.0, -2048.0
    f[:, 20] = f[:, 5]
    x = x.to(dtype)
    bias = torch.randn(N) * 0.5
    if scheme == "16bit":
        w = f.to(dtype)
        linear = cpumoe.weight_packed_linear(x, cpumoe.convert_weight_packed(w), bias)
        moe = moe_first_gemm(x, w, bias, scheme=scheme)
    else:
        block = [32, 32]
        q, s = quant.quantize_fp8_blockwise(f, block)
        linear = cpumoe.fp8_scaled_mm(x, cpumoe.convert_weight_packed(q), s, block, bias)
        moe = moe_first_gemm(x, q, bias, scheme=scheme, scale=s, block=block)
    assert torch.equal(linear, moe), f"{(linear != moe).sum()} of {linear.numel()} differ"


@pytest.mark.parametrize("M", [1, 7, 300, 1100])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_thread_count_independent(isa, scheme, M):
    """1 and 2 threads give the same bits; 1100 rows are two chunks of rows."""
    c = make_case(scheme, torch.bfloat16, M, 256, 96, group=128, block=(128, 128), seed=M)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(c.call(c.x, c.bias))
    assert torch.equal(outs[0], outs[1])
    if M == 1100:  # the second chunk's rows as the first chunk's
        assert torch.equal(outs[0][1024:], c.call(c.x[1024:].contiguous(), c.bias))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_do_not_depend_on_the_batch(scheme):
    """A row's bits do not depend on the rows it comes with (on the numerics classes whose
    kernels do not change with the block size: not amx's bf16 tiles, docs/NUMERICS.md)."""
    c = make_case(scheme, torch.float16, 40, 96, 160, group=32, block=(48, 32), seed=3)
    full = c.call(c.x, c.bias)
    for rows in (slice(0, 1), slice(5, 7), slice(13, 40)):
        assert torch.equal(c.call(c.x[rows].contiguous(), c.bias), full[rows])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_strided_mat1(scheme):
    """mat1 with a row stride (a slice of a wider tensor, or a transposed copy): the bits of
    the contiguous rows (SGLang reads rows with a stride too)."""
    c = make_case(scheme, torch.bfloat16, 9, 64, 32, group=64, block=(32, 64))
    wide = torch.zeros(9, 3 * 64, dtype=torch.bfloat16)
    wide[:, 64:128] = c.x
    strided = wide[:, 64:128]
    assert not strided.is_contiguous()
    assert torch.equal(c.call(strided, c.bias), c.call(c.x, c.bias))
    column_major = c.x.t().contiguous().t()
    assert torch.equal(c.call(column_major, None), c.call(c.x, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_bias_dtypes(scheme, dtype):
    """A 16-bit bias is widened exactly: the bits of the same values in float32."""
    c = make_case(scheme, torch.bfloat16, 5, 64, 32, group=64, block=(32, 64))
    b16 = c.bias.to(dtype)
    assert torch.equal(c.call(c.x, b16), c.call(c.x, b16.float()))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bias_is_added(scheme):
    """out(bias) - out(no bias) is the bias, up to the rounding of both outputs."""
    c = make_case(scheme, torch.float16, 6, 64, 32, group=64, block=(32, 64))
    diff = c.call(c.x, c.bias).float() - c.call(c.x, None).float()
    torch.testing.assert_close(diff, c.bias[None].expand(6, -1), atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_empty_batch(scheme):
    c = make_case(scheme, torch.float16, 0, 64, 96, group=32, block=(32, 64))
    out = c.call(c.x, c.bias)
    assert out.shape == (0, 96) and out.dtype == torch.float16


def test_sglang_call_forms():
    """The positional forms SGLang's layers use (python/sglang/srt/layers/...): packed
    weights, is_vnni=True, out_dtype = x.dtype; results within SGLang's test tolerance of
    torch's float GEMM on the dequantized weights."""
    M, K, N = 7, 128, 96
    x = torch.randn(M, K, dtype=torch.bfloat16)
    f = torch.randn(N, K) / K ** 0.5
    bias = torch.randn(N)
    tol = dict(atol=5e-2, rtol=5e-2)
    ops = torch.ops.cpumoe
    w = f.to(torch.bfloat16)
    out = ops.weight_packed_linear(x, cpumoe.convert_weight_packed(w), bias, True)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias.bfloat16()), **tol)
    q, s = quant.quantize_int8_per_channel(f)
    out = ops.int8_scaled_mm_with_quant(x, cpumoe.convert_weight_packed(q), s, bias, x.dtype,
                                        True)
    torch.testing.assert_close(out.float(), x.float() @ (q.float() * s).t() + bias, **tol)
    q, s = quant.quantize_fp8_blockwise(f, [128, 128])
    out = ops.fp8_scaled_mm_cpu(x, cpumoe.convert_weight_packed(q), s, [128, 128], bias,
                                x.dtype, True)
    ref = x.float() @ reference.dequantize_fp8_blocks(q, s, 128, 128).t() + bias
    torch.testing.assert_close(out.float(), ref, **tol)
    # AWQ: qweight [K, N/8] int32 -> int4_scaled_mm_cpu(x, w, zeros, scales, bias)
    ckpt = quant.quantize_int4(f, 32, "awq", torch.bfloat16)
    w4, z4, s4 = torch.ops.cpumoe.convert_weight_packed_scale_zp(*ckpt, 0)
    out = ops.int4_scaled_mm_cpu(x, w4, z4, s4, bias)
    deq = reference.dequantize_int4(*reference.unpack_int4_checkpoint(*ckpt, 0))
    torch.testing.assert_close(out.float(), x.float() @ deq.t() + bias, **dict(atol=0.1, rtol=0.1))


# ---------------------------------------------------------------------------------------
# The ops as PyTorch operators


def _opcheck_args(scheme: str, with_bias: bool):
    M, K, N = 3, 64, 32
    g = torch.Generator().manual_seed(11)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    f = torch.randn(N, K, generator=g) / 8
    bias = torch.randn(N, generator=g) if with_bias else None
    ops = torch.ops.cpumoe
    if scheme == "16bit":
        return ops.weight_packed_linear.default, (x, cpumoe.convert_weight_packed(
            f.to(torch.bfloat16)), bias, True)
    if scheme == "int8":
        q, s = quant.quantize_int8_per_channel(f)
        return ops.int8_scaled_mm_with_quant.default, (x, cpumoe.convert_weight_packed(q), s,
                                                       bias, torch.bfloat16, True)
    if scheme == "fp8":
        q, s = quant.quantize_fp8_blockwise(f, [32, 32])
        return ops.fp8_scaled_mm_cpu.default, (x, cpumoe.convert_weight_packed(q), s, [32, 32],
                                               bias, torch.bfloat16, True)
    packed = cpumoe.convert_weight_packed_scale_zp(*quant.quantize_int4(f, 32, "awq"), 0)
    return ops.int4_scaled_mm_cpu.default, (x, *packed, bias)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck(scheme, with_bias):
    op, args = _opcheck_args(scheme, with_bias)
    if scheme != "fp8":
        torch.library.opcheck(op, args)
        return
    # opcheck's schema test does arithmetic on every input, which torch 2.13 does not
    # implement for float8_e4m3fn; what it checks (no input is written) is checked here
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    op(*args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fake_kernels_on_meta(scheme):
    """All-meta arguments give an empty result of the real shape and dtype."""
    op, args = _opcheck_args(scheme, True)
    real = op(*args)
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    assert meta.device.type == "meta"
    assert (meta.shape, meta.dtype) == (real.shape, real.dtype)


def test_compile_fullgraph():
    """A module calling the four wrappers traces whole under torch.compile (fake kernels)."""
    ops_args = [_opcheck_args(s, True) for s in SCHEMES]

    def f(x):
        return sum(op(x, *args[1:]).float().sum() for op, args in ops_args)

    x = ops_args[0][1][0]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


@functools.lru_cache(maxsize=None)
def _qwen3_case(K: int, N: int):
    c = make_case("int4", torch.bfloat16, 3, K, N, group=128, seed=K)
    return c, c.spec(c.x, c.bias)


@pytest.mark.parametrize("tier", isa_params())
def test_qwen3_attention_shapes(tier):
    """The bench's shapes (Qwen3-30B-A3B: K=2048 -> N=4096, K=4096 -> N=2048) at M = 3 and
    M = 1, int4 (group 128), bit for bit against the exact reference."""
    with use_isa(tier):
        for K, N in ((2048, 4096), (4096, 2048)):
            c, spec = _qwen3_case(K, N)
            out = c.call(c.x, c.bias)
            assert torch.equal(out, spec)
            assert torch.equal(c.call(c.x[:1], c.bias), out[:1])
