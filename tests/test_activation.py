"""The activation of fused_experts_cpu's first GEMM, chosen by the 18-argument overload's
``activation`` ("silu", or "gelu": erf-GELU times up; docs/MATH.md), or by ``limit`` without
``alpha`` (DeepSeek-V4's clamped SiLU·mul):

* the kernels' GELU (cm_geluf, common/numeric.h) against float64: its stated accuracy, and
  where torch's own fp32 gelu loses every digit;
* every tier's activation kernels equal exact_reference.py's models bit for bit;
* GELU on every scheme, tier, dtype and thread count, against reference.py and, for the
  quantized schemes, bit for bit against the exact models;
* positional calls with 13, 17 and 18 arguments; bad names and bad combinations;
* the clamped SiLU·mul: its kernel on special values and around ±limit (silu_mul's bits
  wherever nothing is clamped), on every scheme, tier, dtype and thread count, through
  every overload and shared_expert_cpu.mxfp4, and its errors.
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
    kernel_silu_clamp,
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


@pytest.mark.parametrize("name", ["silu", "gelu", "swiglu", "silu_clamp"])
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
    elif name == "silu_clamp":
        expected = kernel_silu_clamp(torch.cat([gate, up]), limit)
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


def scheme_case(scheme: str, M: int, E: int, topk: int, N: int, K: int, dtype, bias: bool,
                act=None):
    """(op arguments, reference arguments, exact model or None) of one call with the
    activation keyword arguments `act` (default: GELU)."""
    method = SCHEMES[scheme]
    x = torch.randn(M, K).to(dtype)
    tw, ti = make_routing(M, E, topk, drop_prob=0.1)
    kw = dict(activation="gelu") if act is None else dict(act)
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


# ---------------------------------------------------------------------------------------
# DeepSeek-V4's clamped SiLU·mul: `limit` without `alpha` (gate rows then up rows).

# The first GEMM's outputs in these cases have |h| of about 0.7 (median) and 2.5 (99th
# percentile): this limit clamps about a third of the up values and a sixth of the gates.
SILU_LIMIT = 1.25
SILU_CLAMP = dict(limit=SILU_LIMIT)


def limit_grid(limit: float) -> torch.Tensor:
    """Values at, just inside and just outside ±limit, the special values, and a spread."""
    lim = torch.tensor(limit, dtype=torch.float32)
    near = [lim, -lim, torch.nextafter(lim, torch.tensor(0.0)),
            torch.nextafter(lim, torch.tensor(math.inf)),
            torch.nextafter(-lim, torch.tensor(0.0)),
            torch.nextafter(-lim, torch.tensor(-math.inf))]
    special = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 2.0 ** -149,
                            -(2.0 ** -149), 1e-30, 88.0, -88.0, 100.0, -100.0, 3e38, -3e38])
    return torch.cat([torch.stack(near), special, torch.linspace(-12.0, 12.0, 97)]).float()


@pytest.mark.parametrize("limit", [SILU_LIMIT, 7.0, 0.0, 1e-30, math.inf])
def test_silu_clamp_kernel_special_values(isa, limit):
    """Every (gate, up) pair of the grid: the tier's kernel equals the exact model bit for
    bit (NaN for NaN); NaN in gate or up gives NaN, as torch.clamp passes it on; a pair that
    nothing clamps gives silu_mul's bits; and the result is reference.silu_clamp's."""
    values = limit_grid(limit)
    gate, up = torch.cartesian_prod(values, values).unbind(1)
    gate, up = gate.contiguous(), up.contiguous()
    out = _C.activation_values("silu_clamp", gate, up, 0.0, limit)
    assert same_bits(out, kernel_silu_clamp(torch.cat([gate, up]), limit)), isa
    assert out[gate.isnan() | up.isnan()].isnan().all()
    free = (gate <= limit) & (up.abs() <= limit)
    silu = _C.activation_values("silu", gate, up)
    assert same_bits(out[free], silu[free])
    if limit == math.inf:  # clamps nothing: silu_mul everywhere
        assert same_bits(out, silu)
    # clamped values: the kernel's silu of limit times the clamped up
    clamped_gate = (gate > limit) & ~up.isnan()
    lim = torch.full_like(gate, limit)
    assert same_bits(out[clamped_gate], _C.activation_values(
        "silu", lim, up.clamp(-limit, limit), 0.0, 0.0)[clamped_gate])
    # torch's reference: the same NaNs, and the values within a few fp32 ulp (its exp is
    # not the kernels'). Gates below -80 are left out: there the kernels' silu differs from
    # torch's as silu_mul's does (cm_expf clamps its argument at 88, so silu(-100) is
    # -6e-37, not -4e-42, and silu(-inf) is -inf, not NaN), a matter of silu, not the clamp
    ref = reference.silu_clamp(torch.cat([gate, up]), limit)
    keep = gate >= -80
    assert torch.equal(out[keep].isnan(), ref[keep].isnan())
    fin = keep & out.isfinite() & ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], atol=1e-37, rtol=1e-6)


def test_silu_clamp_kernel_errors():
    x = torch.zeros(4)
    for bad in (math.nan, -1.0, -1e-30, -math.inf):
        with raises(r"activation_values: limit must be >= 0 \(not NaN\) for the clamped silu "
                    r"\(limit without alpha\), got"):
            _C.activation_values("silu_clamp", x, x, 0.0, bad)
    # an empty input is still checked, and -0.0 is a limit of zero
    with raises(r"limit must be >= 0"):
        _C.activation_values("silu_clamp", torch.zeros(0), torch.zeros(0), 0.0, math.nan)
    assert torch.equal(_C.activation_values("silu_clamp", x + 3, x + 3, 0.0, -0.0), x)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_silu_clamp_matches_reference(isa, scheme, dt, bias):
    """limit alone: reference.py within the scheme's tolerance, the exact models bit for
    bit (quantized schemes); really clamped (not plain silu), and with limit = inf plain
    silu's bits."""
    M, E, topk, N, K = 21, 4, 2, 64, 128
    op, ref, exact = scheme_case(scheme, M, E, topk, N, K, DTYPES[dt], bias, SILU_CLAMP)
    out = run(op)
    *tensors, rkw = ref
    assert_scheme_close(scheme, out, reference.fused_experts(*tensors, **rkw))
    if exact is not None:
        assert_matches_exact(out, exact(), SCHEMES[scheme])
    kw = {k: v for k, v in op[-1].items() if k != "limit"}
    silu = run((*op[:-1], kw))
    assert not torch.allclose(out.float(), silu.float(), atol=0.05, rtol=0.05)
    assert torch.equal(run((*op[:-1], dict(kw, limit=math.inf))), silu)


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_silu_clamp_decode_rows(isa, scheme, M):
    """The decode kernels (few rows per expert) with the clamped silu."""
    op, ref, exact = scheme_case(scheme, M, 8, 2, 96, 160, torch.bfloat16, True, SILU_CLAMP)
    *tensors, rkw = ref
    out = run(op)
    assert_scheme_close(scheme, out, reference.fused_experts(*tensors, **rkw))
    if exact is not None:
        assert_matches_exact(out, exact(), SCHEMES[scheme])


# GELU (scheme_case's default) and the clamped silu: the activations added to SiLU·mul
GATED = {"gelu": None, "silu_clamp": SILU_CLAMP}


@needs_two_tiers
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("activation", list(GATED))
def test_gated_tiers_agree(activation, scheme, dt):
    """Tiers of one numerics class give the same bits with GELU and the clamped silu as
    with SiLU."""
    op, _, _ = scheme_case(scheme, 37, 4, 3, 64, 96, DTYPES[dt], True, GATED[activation])
    outs = {}
    for tier in SUPPORTED_ISAS:
        with use_isa(tier):
            outs[tier] = run(op)
    assert_tiers_agree(outs, SCHEMES[scheme])


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("activation", list(GATED))
def test_gated_thread_count_independent(isa, activation, scheme):
    op, _, _ = scheme_case(scheme, 130, 8, 2, 64, 96, torch.bfloat16, True, GATED[activation])
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(run(op))
    assert torch.equal(outs[0], outs[1])


def test_silu_clamp_every_overload(isa):
    """limit alone through .bias (17 arguments), .activation (18, activation None and
    "silu"), .out, fused_experts_fp32_cpu and inplace: one set of bits."""
    op, _, _ = scheme_case("bf16", 9, 4, 2, 32, 64, torch.bfloat16, True)
    x, w1, w2, tw, ti, kw = op
    b1, b2 = kw["w1_bias"], kw["w2_bias"]
    fused = torch.ops.cpumoe.fused_experts_cpu
    base = (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, b1, b2, None,
            SILU_LIMIT, True)
    want = fused(*base)  # resolves to .bias
    assert torch.equal(fused.bias(*base), want)
    assert torch.equal(fused(*base, None), want)
    assert torch.equal(fused(*base, "silu"), want)
    assert torch.equal(cpumoe.fused_experts(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2,
                                            limit=SILU_LIMIT, activation="silu"), want)
    out = torch.empty_like(x)
    fused.out(out, x, w1, w2, tw, ti, 0, None, None, None, None, None, None, b1, b2, None,
              SILU_LIMIT, True)
    assert torch.equal(out, want)
    f32 = cpumoe.fused_experts_fp32(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2,
                                    limit=SILU_LIMIT)
    assert torch.equal(f32.to(x.dtype), want)
    y = x.clone()
    assert torch.equal(cpumoe.fused_experts(y, w1, w2, tw, ti, inplace=True, w1_bias=b1,
                                            w2_bias=b2, limit=SILU_LIMIT), want)
    assert torch.equal(y, want)
    assert not torch.equal(want, cpumoe.fused_experts(x, w1, w2, tw, ti, w1_bias=b1,
                                                      w2_bias=b2))


def test_opcheck_silu_clamp():
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, False)
    x, w1, w2, tw, ti, _ = op
    args = (x, w1, w2, tw, ti, False, 0, None, None, None, None, None, None, None, None,
            SILU_LIMIT, True)
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.bias, args)
    torch.library.opcheck(torch.ops.cpumoe.fused_experts_cpu.activation, args + ("silu",))


def shared_case(scheme: str, dtype, N: int = 64, K: int = 96):
    """(x, shared_expert keyword-free weights w1, w2 packed, op keyword arguments, reference
    weights and keyword arguments, fused_experts arguments of the same MLP as one expert)
    for "bf16", "int8", "fp8" or "mxfp4"."""
    x = torch.randn(11, K).to(dtype)
    if scheme == "mxfp4":
        c1, s1, c2, s2 = (t[0] for t in make_mxfp4_weights(1, N, K))
        p1, p2 = cpumoe.convert_scale_packed(s1), cpumoe.convert_scale_packed(s2)
        op_kw = dict(use_mxfp4=True, w1_scale=p1, w2_scale=p2)
        ref = (c1, c2, dict(use_mxfp4=True, w1_scale=s1, w2_scale=s2))
        fused_kw = dict(moe_comp_method=MXFP4, w1_scale=p1[None], w2_scale=p2[None])
        return x, pack(c1), pack(c2), op_kw, ref, pack(c1[None]), pack(c2[None]), fused_kw
    method = {"bf16": 0, "int8": 1, "fp8": 2}[scheme]
    w1, w2, kw = make_scheme_weights(method, 1, N, K, dtype)
    w1, w2 = w1[0], w2[0]
    scales = {k: kw[k][0] for k in ("w1_scale", "w2_scale") if k in kw}
    flags = dict(use_int8_w8a8=method == 1, use_fp8_w8a16=method == 2)
    op_kw = dict(**flags, **scales, block_size=kw.get("block_size"))
    ref = (w1, w2, dict(**flags, **scales, block_size=kw.get("block_size")))
    return x, pack(w1), pack(w2), op_kw, ref, pack(w1[None]), pack(w2[None]), kw


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8", "mxfp4"])
def test_shared_expert_silu_clamp(isa, scheme, dt):
    """shared_expert_cpu.mxfp4 with limit alone (SGLang's DeepSeek-V4 call, positional):
    one expert of fused_experts bit for bit, and reference.shared_expert with
    fused_experts_out and the scaling factor."""
    x, w1, w2, op_kw, (r1, r2, rkw), f1, f2, fkw = shared_case(scheme, DTYPES[dt])
    x = (x.float() * 1.5).to(x.dtype)
    M = x.shape[0]
    shared = torch.ops.cpumoe.shared_expert_cpu.mxfp4

    def positional(fused_out=None, factor=None):
        return shared(x, w1, w2, fused_out, factor, False, op_kw.get("use_int8_w8a8", False),
                      op_kw.get("use_fp8_w8a16", False), op_kw.get("use_mxfp4", False),
                      op_kw["w1_scale"] if "w1_scale" in op_kw else None,
                      op_kw["w2_scale"] if "w2_scale" in op_kw else None,
                      op_kw.get("block_size"), None, SILU_LIMIT, True)

    got = positional()
    one_expert = cpumoe.fused_experts(x, f1, f2, torch.ones(M, 1),
                                      torch.zeros(M, 1, dtype=torch.int32), limit=SILU_LIMIT,
                                      **fkw)
    assert torch.equal(got, one_expert)
    assert torch.equal(cpumoe.shared_expert(x, w1, w2, limit=SILU_LIMIT, **op_kw), got)
    assert not torch.equal(got, cpumoe.shared_expert(x, w1, w2, **op_kw))
    routed, factor = torch.randn(M, x.shape[1]).to(x.dtype), 2.5
    want = reference.shared_expert(x, r1, r2, routed, factor, limit=SILU_LIMIT, **rkw)
    assert_scheme_close(scheme, positional(routed, factor), want)


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf])
def test_silu_clamp_bad_limit(bad):
    """A NaN or negative limit is an error naming it, in both ops, also with M == 0 (which
    never reaches the kernels)."""
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, False)
    msg = (r"fused_experts_cpu: limit must be >= 0 \(not NaN\) for the clamped silu "
           r"\(limit without alpha\), got")
    with raises(msg):
        run((*op[:-1], dict(limit=bad)))
    x, w1, w2, tw, ti, _ = op
    with raises(msg):
        run((x[:0], w1, w2, tw[:0], ti[:0], dict(limit=bad)))
    x, w1, w2, op_kw, *_ = shared_case("bf16", torch.bfloat16)
    with raises(msg.replace("fused_experts_cpu", "shared_expert_cpu")):
        cpumoe.shared_expert(x, w1, w2, limit=bad, **op_kw)


def test_silu_clamp_zero_limit():
    """limit = 0 is valid: every up value clamps to zero, so the MLP outputs zeros."""
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, False)
    assert (run((*op[:-1], dict(limit=0.0))) == 0).all()


def test_silu_clamp_gelu_and_alpha_alone_are_errors():
    op, _, _ = scheme_case("bf16", 3, 4, 2, 32, 64, torch.bfloat16, False)
    with raises(r"fused_experts_cpu: limit without alpha selects the clamped silu, which "
                r"replaces the activation; activation must be None or 'silu' with it, got "
                r"'gelu'"):
        run((*op[:-1], dict(activation="gelu", limit=SILU_LIMIT)))
    with raises(r"fused_experts_cpu: alpha needs limit .*got only alpha"):
        run((*op[:-1], dict(alpha=1.702)))
    with raises(r"fused_experts_cpu: alpha needs limit"):
        run((*op[:-1], dict(alpha=1.702, activation="silu")))
    x, w1, w2, op_kw, *_ = shared_case("bf16", torch.bfloat16)
    with raises(r"shared_expert_cpu: alpha needs limit .*got only alpha"):
        cpumoe.shared_expert(x, w1, w2, alpha=1.702, **op_kw)
