"""The activation of fused_experts_cpu's first GEMM, chosen by the 18-argument overload's
``activation`` ("silu", or "gelu": erf-GELU times up; docs/MATH.md):

* the kernels' GELU (cm_geluf, common/numeric.h) against float64: its stated accuracy, and
  where torch's own fp32 gelu loses every digit;
* every tier's activation kernels equal exact_reference.py's models bit for bit;
* GELU on every scheme, tier, dtype and thread count, against reference.py and, for the
  quantized schemes, bit for bit against the exact models;
* positional calls with 13, 17 and 18 arguments; bad names and bad combinations.
"""

import math

import pytest
import torch

import cpumoe
from cpumoe import _C, reference
from cpumoe_testing import (
    CROSS_CLASS_TOLERANCE,
    DTYPES,
    INT4,
    MXFP4,
    SUPPORTED_ISAS,
    Int4Weights,
    assert_elementwise_close,
    assert_matches_exact,
    assert_row_close,
    assert_tiers_agree,
    make_bias,
    make_mxfp4_weights,
    make_routing,
    make_scheme_weights,
    needs_two_tiers,
    pack,
    raises,
    use_isa,
)
from exact_reference import (
    fp8_exact_reference,
    int4_exact_reference,
    int8_exact_reference,
    kernel_gelu,
    kernel_gelu_and_mul,
    kernel_silu_and_mul,
    kernel_swiglu_clamp,
    mxfp4_exact_reference,
)

# cm_geluf's relative error bound wherever the result is a normal float (docs/NUMERICS.md);
# measured: 4.3e-7 over [-15, 15].
GELU_MAX_REL_ERROR = 5e-7
FLT_MIN = 2.0 ** -126


def gelu_float64(x: torch.Tensor) -> torch.Tensor:
    """x * Phi(x) in float64, Phi from erfc (accurate in both tails)."""
    x = x.double()
    return x * 0.5 * torch.special.erfc(-x / math.sqrt(2.0))


def gelu_inputs() -> torch.Tensor:
    return torch.cat([
        torch.linspace(-15.0, 15.0, 1_000_001),
        torch.randn(200_000) * 3,
        torch.randn(50_000) * 1e-3,
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0 ** -149, 13.1, -13.1, 13.2, -13.2]),
    ]).float()


def test_gelu_model_accuracy():
    """The model of cm_geluf is within GELU_MAX_REL_ERROR of x * Phi(x) wherever that is
    a normal float, and within FLT_MIN below (the far left tail, where it becomes 0)."""
    x = gelu_inputs()
    got, true = kernel_gelu(x).double(), gelu_float64(x)
    normal = true.abs() >= FLT_MIN
    rel = ((got - true).abs() / true.abs())[normal]
    assert rel.max().item() < GELU_MAX_REL_ERROR, x[normal][rel.argmax()].item()
    assert (got - true)[~normal].abs().max().item() < FLT_MIN
    # torch's fp32 gelu computes 1 + erf(x / sqrt2), which cancels in the left tail: the
    # reason the kernels do not copy its formula (reference.py uses it, within tolerance)
    left = (x < -5) & normal
    torch_rel = ((torch.nn.functional.gelu(x).double() - true).abs() / true.abs())[left]
    assert torch_rel.max().item() > 1e-3
    assert ((got - true).abs() / true.abs())[left].max().item() < GELU_MAX_REL_ERROR


def test_gelu_special_values():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -20.0, 20.0])
    g = kernel_gelu(x)
    assert g[0].isnan() and g[1].item() == math.inf and g[2].isnan()  # -inf * 0, as torch
    assert g[3].item() == 0.0 and math.copysign(1.0, g[4].item()) == -1.0
    assert g[5].item() == 0.0 and g[6].item() == 20.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical fp32 tensors, any NaN matching any NaN."""
    both_nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


@pytest.mark.parametrize("name", ["silu", "gelu", "swiglu"])
def test_activation_kernels_match_models(isa, name):
    """The tier's activation kernels (cpumoe_activation_values) equal exact_reference's
    models bit for bit: every tier computes the activation with the same fp32 operations
    (elementwise/elementwise-impl.h), whatever its GEMM numerics class."""
    gate = gelu_inputs() if name == "gelu" else torch.linspace(-100.0, 100.0, 400_001)
    if name == "gelu":
        gate = torch.cat([gate, torch.tensor([float("nan"), float("inf"), float("-inf")])])
    up = torch.randn_like(gate) * 2
    alpha, limit = 1.702, 7.0
    out = _C.activation_values(name, gate, up, alpha, limit)
    if name == "swiglu":
        h = torch.stack([gate, up], -1).reshape(-1)  # interleaved gate/up
        expected = kernel_swiglu_clamp(h, alpha, limit)
    else:
        model = kernel_gelu_and_mul if name == "gelu" else kernel_silu_and_mul
        expected = model(torch.cat([gate, up]))
    assert same_bits(out, expected), f"{int((out != expected).sum())} differ on {isa}"


def test_activation_values_errors():
    x = torch.zeros(4)
    with raises(r"activation_values: unknown activation 'relu'"):
        _C.activation_values("relu", x, x)
    with raises(r"activation_values: gate and up must be 1-D float32"):
        _C.activation_values("gelu", x, x.double())


# ---------------------------------------------------------------------------------------
# GELU in the fused MoE, every scheme.

SCHEMES = {"bf16": 0, "int8": 1, "fp8": 2, "int4": INT4, "mxfp4": MXFP4}


def scheme_case(scheme: str, M: int, E: int, topk: int, N: int, K: int, dtype, bias: bool):
    """(op arguments, reference arguments, exact model or None) of one GELU call."""
    method = SCHEMES[scheme]
    x = torch.randn(M, K).to(dtype)
    tw, ti = make_routing(M, E, topk, drop_prob=0.1)
    kw = dict(activation="gelu")
    if bias:
        kw["w1_bias"], kw["w2_bias"] = make_bias(E, N, K)
    if method == INT4:
        w = Int4Weights(E, N, K, 32)
        op = (x, w.p1[0], w.p2[0], tw, ti, dict(**w.op_kwargs(), **kw))
        ref = (x, w.u1[0], w.u2[0], tw, ti, dict(**w.ref_kwargs(), **kw))
        return op, ref, lambda: int4_exact_reference(x, w, tw, ti, **kw)
    if method == MXFP4:
        c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
        op = (x, pack(c1), pack(c2), tw, ti,
              dict(moe_comp_method=MXFP4, w1_scale=cpumoe.convert_scale_packed(s1),
                   w2_scale=cpumoe.convert_scale_packed(s2), **kw))
        ref = (x, c1, c2, tw, ti, dict(moe_comp_method=MXFP4, w1_scale=s1, w2_scale=s2, **kw))
        return op, ref, lambda: mxfp4_exact_reference(x, c1, s1, c2, s2, tw, ti, **kw)
    w1, w2, skw = make_scheme_weights(method, E, N, K, dtype, block=(32, 64))
    op = (x, pack(w1), pack(w2), tw, ti, dict(**skw, **kw))
    ref = (x, w1, w2, tw, ti, dict(**skw, **kw))
    exact = None
    if method == 1:
        exact = lambda: int8_exact_reference(x, w1, skw["w1_scale"], w2, skw["w2_scale"],  # noqa: E731
                                             tw, ti, **kw)
    elif method == 2:
        exact = lambda: fp8_exact_reference(x, w1, skw["w1_scale"], w2, skw["w2_scale"],  # noqa: E731
                                            tw, ti, (32, 64), **kw)
    return op, ref, exact


def run(op_args) -> torch.Tensor:
    *tensors, kw = op_args
    return cpumoe.fused_experts(*tensors, **kw)


def assert_scheme_close(scheme: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = CROSS_CLASS_TOLERANCE[SCHEMES[scheme]]
    if scheme == "bf16":
        assert_elementwise_close(out, ref, tol)
    else:
        assert_row_close(out, ref, tol)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gelu_matches_reference(isa, scheme, dt, bias):
    M, E, topk, N, K = 21, 4, 2, 64, 128
    op, ref, exact = scheme_case(scheme, M, E, topk, N, K, DTYPES[dt], bias)
    out = run(op)
    *tensors, rkw = ref
    expected = reference.fused_experts(*tensors, **rkw)
    assert_scheme_close(scheme, out, expected)
    if exact is not None:
        assert_matches_exact(out, exact(), SCHEMES[scheme])
    # GELU really replaced SiLU
    silu = run((*op[:-1], {k: v for k, v in op[-1].items() if k != "activation"}))
    assert not torch.allclose(out.float(), silu.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gelu_decode_rows(isa, scheme, M):
    """The decode kernels (few rows per expert) with GELU."""
    op, ref, exact = scheme_case(scheme, M, 8, 2, 96, 160, torch.bfloat16, True)
    *tensors, rkw = ref
    assert_scheme_close(scheme, run(op), reference.fused_experts(*tensors, **rkw))
    if exact is not None:
        assert_matches_exact(run(op), exact(), SCHEMES[scheme])


@needs_two_tiers
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gelu_tiers_agree(scheme):
    """Tiers of one numerics class give the same bits with GELU as with SiLU."""
    op, _, _ = scheme_case(scheme, 37, 4, 3, 64, 96, torch.float16, True)
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = run(op)
    assert_tiers_agree(outs, SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gelu_thread_count_independent(isa, scheme):
    op, _, _ = scheme_case(scheme, 130, 8, 2, 64, 96, torch.bfloat16, True)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(run(op))
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------
# The 18-argument schema and its errors.


def test_positional_18_args(isa):
    """SGLang's current schema: the 17 arguments and a trailing `str? activation`."""
    op, _, _ = scheme_case("bf16", 5, 4, 2, 32, 64, torch.bfloat16, False)
    x, w1, w2, tw, ti, _ = op
    fused = torch.ops.cpumoe.fused_experts_cpu
    base = (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, None, None, None, None,
            True)
    silu13 = fused(x, w1, w2, tw, ti, False, 0, None, None, None, None, None, True)
    assert torch.equal(fused(*base, None), silu13)
    assert torch.equal(fused(*base, "silu"), silu13)
    assert torch.equal(fused(*base, "gelu"), cpumoe.fused_experts(x, w1, w2, tw, ti,
                                                                   activation="gelu"))
    assert torch.equal(fused.activation(*base), silu13)  # activation defaults to None
    assert not torch.equal(fused(*base, "gelu"), silu13)


@pytest.mark.parametrize("name", ["relu", "GELU", "gelu_tanh", "swiglu", ""])
def test_unknown_activation(name):
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, False)
    with raises(f"fused_experts_cpu: Unsupported activation '{name}' "
                r"\(expected 'silu' or 'gelu'\)"):
        run((*op[:-1], dict(activation=name)))


def test_gelu_with_alpha_limit_is_an_error():
    """alpha/limit select the clamped swiglu, which replaces the activation: asking for
    gelu with them is ambiguous, so it is refused rather than silently ignored."""
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, False)
    with raises("alpha and limit select the clamped swiglu.*got 'gelu'"):
        run((*op[:-1], dict(activation="gelu", alpha=1.702, limit=7.0)))
    # "silu" with them is the swiglu, as with activation=None
    swiglu = run((*op[:-1], dict(alpha=1.702, limit=7.0)))
    assert torch.equal(run((*op[:-1], dict(activation="silu", alpha=1.702, limit=7.0))), swiglu)


def test_opcheck_activation_overload():
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, True)
    x, w1, w2, tw, ti, kw = op
    args = (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, kw["w1_bias"],
            kw["w2_bias"], None, None, True, "gelu")
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.activation, args)
