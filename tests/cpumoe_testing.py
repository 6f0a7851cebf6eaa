"""Test plumbing shared by the cpumoe tests (``from cpumoe_testing import ...``; the
fixtures live in conftest.py, the bit-exact models of the kernels in exact_reference.py).

* tiers: ``BUILT_ISAS`` / ``SUPPORTED_ISAS``, ``use_isa`` / ``isa_params`` /
  ``skip_unless_supported`` / ``needs_two_tiers`` (tiers the CPU cannot run are skipped
  with a reason: ``unsupported_reason``);
* numerics classes: ``assert_tiers_agree`` (tier against tier) and
  ``assert_matches_exact`` (tier against exact_reference.py), bit for bit within a class
  and within ``CROSS_CLASS_TOLERANCE`` across classes;
* inputs: ``make_routing`` / ``make_weights`` / ``make_hidden`` / ``make_bias`` like
  SGLang's tests (softmax scores + topk), scaled so that every intermediate and the output
  are O(1); per scheme ``make_int8_weights`` / ``make_fp8_weights`` / ``Int4Weights`` /
  ``make_quantized_hidden`` / ``make_mxfp4_weights`` / ``make_scheme_weights``;
* calls: ``run_fused`` / ``run_fused_int8`` / ``run_fused_fp8`` / ``run_fused_int4`` /
  ``run_fused_mxfp4``,
  ``call_fused`` / ``DROP`` / ``raises`` for the error tests, ``subprocess_env``;
* tolerances against reference.py, each with its reasoning: ``TOL`` /
  ``assert_moe_close`` (16-bit weights), ``TOL_INT8`` / ``TOL_FP8`` / ``TOL_INT4`` /
  ``TOL_MXFP4`` with ``assert_row_close`` and its per-scheme forms.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import pytest
import torch

import cpumoe

BUILT_ISAS = cpumoe.built_isas()  # worst first
BEST_ISA = cpumoe.best_isa()


_CPU_ISAS = cpumoe.supported_isas()


def tier_supported(tier: str) -> bool:
    """True when this CPU can run `tier`. (The tiers form a tree, so this is not a prefix
    of BUILT_ISAS: a CPU with AVX-512 but no AVX-VNNI runs avx512 but not avx2vnni.)"""
    return tier in _CPU_ISAS


SUPPORTED_ISAS = [t for t in BUILT_ISAS if tier_supported(t)]


def unsupported_reason(tier: str) -> str:
    """The skip reason of a test that needs `tier` on a CPU that cannot run it: the tier,
    and why (the best tier the CPU supports and the features cpuid found)."""
    return (f"this CPU cannot run the {tier} tier: its best tier is {BEST_ISA} "
            f"(CPU features found: {' '.join(cpumoe.cpu_features()) or 'none'})")


def skip_unless_supported(tier: str) -> None:
    if not tier_supported(tier):
        pytest.skip(unsupported_reason(tier))


def _needs_two_tiers_reason() -> str:
    if len(BUILT_ISAS) < 2:
        return f"compares tiers, but this build has only the {BUILT_ISAS[0]} tier"
    return (f"compares tiers, but only the {SUPPORTED_ISAS[0]} tier runs here; "
            + unsupported_reason(BUILT_ISAS[1]))


# Marks a test that runs one call on every tier this CPU supports and compares them.
needs_two_tiers = pytest.mark.skipif(len(SUPPORTED_ISAS) < 2, reason=_needs_two_tiers_reason())


@contextlib.contextmanager
def use_isa(tier: str):
    """Runs the block on `tier`, then restores the previous tier."""
    prev = cpumoe.isa()
    cpumoe.set_isa(tier)
    try:
        assert cpumoe.isa() == tier, (tier, cpumoe.isa_reason())
        yield tier
    finally:
        cpumoe.set_isa(prev)


def isa_params(tiers=None):
    """pytest params over `tiers` (default: every built tier); unsupported ones are skipped."""
    tiers = BUILT_ISAS if tiers is None else tiers
    return [
        pytest.param(t, id=t, marks=() if tier_supported(t) else pytest.mark.skip(
            reason=unsupported_reason(t)))
        for t in tiers
    ]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Tolerances of the op against reference.py (atol = rtol, as in SGLang's tests).
# Both sides compute in fp32 from the same 16-bit inputs, and a product of two 16-bit
# values is exact in fp32. What differs:
#   * summation order inside the fp32 dot products (relative error ~ sqrt(K) * 2^-24,
#     i.e. ~1e-6 for K = 512) and the fp32 exp() inside silu/sigmoid (a few fp32 ulp);
#   * those tiny differences can flip the rounding of an intermediate activation to the
#     neighbouring 16-bit value; each flip moves the output by about w2 * ulp16(a),
#     i.e. ~2^-8 / sqrt(N) relative for bf16: far below the output ulp;
#   * the final rounding to 16 bits can then land on the neighbouring value: at most one
#     output ulp, i.e. <= 2^-7 |v| (0.78%) for bf16 and <= 2^-10 |v| (0.1%) for fp16.
# So atol = rtol = 1e-2 (bf16) and 2e-3 (fp16) allow one output ulp at every magnitude
# (atol covers values near zero) and nothing like a real error (a wrong expert, a dropped
# bias, a swapped gate/up, a missing slot all move outputs by O(10%) or more).
TOL = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_elementwise_close(out: torch.Tensor, ref: torch.Tensor, tol_table: dict,
                             msg: str = "") -> None:
    """out finite, same dtype/shape as ref, and |out - ref| <= atol + rtol |ref| with
    atol/rtol from tol_table[ref.dtype] (the form of TOL)."""
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), f"non-finite output {msg}"
    torch.testing.assert_close(out.float(), ref.float(), **tol_table[ref.dtype],
                               msg=lambda m: f"{msg}\n{m}")


def assert_moe_close(out: torch.Tensor, ref: torch.Tensor, msg: str = "") -> None:
    assert_elementwise_close(out, ref, TOL, msg)


def make_routing(M: int, E: int, topk: int, *, renormalize: bool = False,
                 ids_dtype: torch.dtype = torch.int32,
                 weights_dtype: torch.dtype = torch.float32,
                 drop_prob: float = 0.0):
    """SGLang's make_routing: softmax scores, topk, optional renormalization.
    drop_prob turns that fraction of slots into -1 ("expert on another rank")."""
    scores = torch.softmax(torch.randn(M, E), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(scores, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if drop_prob > 0:
        ids[torch.rand(M, topk) < drop_prob] = -1
    return weights.to(weights_dtype), ids.to(ids_dtype)


def make_hidden(M: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(M, K).to(dtype)


def make_weights(E: int, N: int, K: int, dtype: torch.dtype):
    """Unpacked w1 [E, 2N, K], w2 [E, K, N], scaled by 1/sqrt(fan-in) so that with
    x ~ N(0, 1) the gate/up values are ~N(0, 1) and the outputs O(1)."""
    w1 = (torch.randn(E, 2 * N, K) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, K, N) / N ** 0.5).to(dtype)
    return w1, w2


def make_bias(E: int, N: int, K: int):
    """fp32 biases [E, 2N] and [E, K], large enough that dropping one is visible."""
    return torch.randn(E, 2 * N) * 0.5, torch.randn(E, K) * 0.5


def pack(w: torch.Tensor) -> torch.Tensor:
    return cpumoe.convert_weight_packed(w)


def apply_variant(variant: str, x: torch.Tensor, ti: torch.Tensor, E: int, N: int, K: int):
    """The routing/bias/activation variants of the exact-reference cases of the quantized
    schemes: "duplicates" (one expert in several slots of a token), "*bias*" (w1/w2
    biases), "swiglu_bias" (also the clamped swiglu, with x pushed past the clamp).
    Returns (x, the keyword arguments to add)."""
    if variant == "duplicates":
        ti[0] = E - 1
        ti[1, :2] = 0
    kw = {}
    if "bias" in variant:
        kw["w1_bias"], kw["w2_bias"] = make_bias(E, N, K)
    if variant == "swiglu_bias":
        x = (x.float() * 3).to(x.dtype)  # push gate/up values past the clamp at 7
        kw["alpha"], kw["limit"] = 1.702, 7.0
    return x, kw


DROP = object()  # call_fused(args, name=DROP) leaves the argument out


def call_fused(args: dict, **over) -> torch.Tensor:
    """cpumoe.fused_experts on a dict of valid arguments, with `over` replacing (or, as
    DROP, removing) some of them: the error tests' way to vary one argument at a time."""
    args = {k: v for k, v in {**args, **over}.items() if v is not DROP}
    return cpumoe.fused_experts(args.pop("hidden_states"), args.pop("w1"), args.pop("w2"),
                                args.pop("topk_weights"), args.pop("topk_ids"), **args)


def raises(pattern):
    """pytest.raises(RuntimeError) whose message matches `pattern`."""
    return pytest.raises(RuntimeError, match=pattern)


def run_fused(x, w1, w2, tw, ti, *, is_vnni: bool, **kw) -> torch.Tensor:
    """Calls the op with unpacked weights w1/w2: packs them first when is_vnni, else
    lets the op pack them per call."""
    if is_vnni:
        return cpumoe.fused_experts(x, pack(w1), pack(w2), tw, ti, is_vnni=True, **kw)
    return cpumoe.fused_experts(x, w1, w2, tw, ti, is_vnni=False, **kw)



# ---------------------------------------------------------------------------------------
# INT8 W8A8 (moe_comp_method 1) helpers.

INT8 = 1  # moe_comp_method of INT8 W8A8


def make_int8_weights(E: int, N: int, K: int, style: str = "quant"):
    """int8 expert weights w1 [E, 2N, K], w2 [E, K, N] with fp32 per output channel scales
    s1 [E, 2N, 1], s2 [E, K, 1] (the shapes SGLang passes).

    * ``"quant"``: :func:`cpumoe.quant.quantize_int8_per_channel` of the float weights of
      :func:`make_weights` (what a model loader produces);
    * ``"sglang"``: the data of SGLang's own CPU test test_int8_moe:
      ``w = ((rand - 0.5) * 2 * 127).clamp(-128, 127).int8``, scales ``rand * 1e-2``.
    """
    from cpumoe import quant

    if style == "quant":
        f1, f2 = make_weights(E, N, K, torch.float32)
        w1, s1 = quant.quantize_int8_per_channel(f1)
        w2, s2 = quant.quantize_int8_per_channel(f2)
    elif style == "sglang":
        w1 = ((torch.rand(E, 2 * N, K) - 0.5) * 2 * 127).clamp(-128, 127).to(torch.int8)
        w2 = ((torch.rand(E, K, N) - 0.5) * 2 * 127).clamp(-128, 127).to(torch.int8)
        s1 = torch.rand(E, 2 * N, 1) * 1e-2
        s2 = torch.rand(E, K, 1) * 1e-2
    else:
        raise ValueError(f"unknown int8 weight style {style!r}")
    return w1, s1, w2, s2


def make_quantized_hidden(M: int, K: int, dtype: torch.dtype,
                          style: str = "quant") -> torch.Tensor:
    """Activations for :func:`make_int8_weights` and :func:`make_fp8_weights` of the same
    `style`: ``randn`` for ``"quant"`` (gate/up values ~ N(0, 1)), SGLang's
    ``randn / sqrt(K)`` for ``"sglang"``."""
    x = torch.randn(M, K)
    return (x / K ** 0.5 if style == "sglang" else x).to(dtype)


# Tolerance of INT8 W8A8 outputs against reference.fused_experts(..., moe_comp_method=1).
# The reference repeats the kernels' fp32 operation order: the same per-row quantization
# (one fp32 division 127/amax, round half to even), exact integer GEMMs, dequantization
# ((float)acc * row_scale) * channel_scale, fp32 topk weight. What still differs:
#   * torch's exp inside silu/sigmoid vs the kernels' polynomial (common/numeric.h): about
#     0.4% of the fp32 activations differ by an ulp. Rarely, that flips the 16-bit rounding
#     of an intermediate a[n] (measured: 1 bf16 and 10 fp16 flips in 25.6M elements), and
#     a flipped a[n] can cross an int8 bucket of its row when re-quantized (step amax/127;
#     if a[n] is the row's amax, the whole row is re-bucketed). One bucket of one element
#     moves y[k] by (amax / 127) * w2[k, n] * s2[k], about amax / (127 sqrt(N) rms(a)) of
#     |y|: 0.3% (N = 128) to 0.6% (N = 32), more for a large w2[k, n]. The bucket is the
#     same size for bf16 and fp16 activations, so both dtypes get the same tolerance.
#   * the reference sums the topk slots per expert, the kernels per slot: fp32 ulps, which
#     can move the final 16-bit rounding by one output ulp (bf16 2^-8, fp16 2^-11 relative).
# Both kinds are relative to the magnitude of the output row (a bucket is amax/127 of a
# row), so the bound is |out - ref| <= rtol |ref| + atol rms(ref row), not a fixed atol:
# SGLang's data gives outputs ~0.05, where a fixed atol of 1e-2 would accept 20% errors.
# atol = rtol = 1e-2 (SGLang's int8 tolerance) covers one output ulp plus one bucket flip;
# a real error (wrong expert, scale, compensation, gate/up swap, dropped bias) is O(10%).
# Nearly all elements are bit-identical (a handful per problem; see INT8_MAX_MISMATCH),
# and exact_reference.int8_exact_reference removes both differences: tests that need
# more than this tolerance compare bit for bit against it.
# Measured (the PAIRWISE cases of test_int8.py plus SGLang's shapes, silu and bias+swiglu,
# 8 seeds, 336 problems): worst |out - ref| / bound = 0.18 (bf16) and 0.054 (fp16), at
# most 0.16% of the elements differ at all, and every problem equals int8_exact_reference
# bit for bit; no exp-caused bucket flip was seen.
TOL_INT8 = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}
# Fraction of output elements allowed to differ at all from the reference (plus 2): the
# differences above touch a handful of elements per problem; a systematic deviation
# (rounding mode, operation order, scale formula) moves a large fraction by an ulp.
INT8_MAX_MISMATCH = 0.01


def row_bound(ref: torch.Tensor, tol_table: dict) -> torch.Tensor:
    """Allowed |out - ref| per element: rtol |ref| + atol * rms of ref's row, with
    rtol/atol from tol_table[ref.dtype] (the quantized schemes' tolerance form)."""
    tol = tol_table[ref.dtype]
    r = ref.float()
    row_rms = r.pow(2).mean(-1, keepdim=True).sqrt()
    return tol["rtol"] * r.abs() + tol["atol"] * row_rms


def row_scaled_error(out: torch.Tensor, ref: torch.Tensor, tol_table: dict) -> float:
    """max |out - ref| / row_bound(ref) (0/0 counts as 0): <= 1 passes."""
    d = (out.float() - ref.float()).abs()
    if d.numel() == 0:
        return 0.0
    return float(torch.where(d == 0, torch.zeros_like(d), d / row_bound(ref, tol_table)).max())


def assert_row_close(out: torch.Tensor, ref: torch.Tensor, tol_table: dict, msg: str = "",
                     max_mismatch: Optional[float] = None) -> None:
    """out within row_bound of ref, finite, same dtype/shape; and (unless max_mismatch
    is None) at most that fraction of elements (+2) not bit-identical."""
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), f"non-finite output {msg}"
    d = (out.float() - ref.float()).abs()
    bad = d > row_bound(ref, tol_table)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {d.numel()} elements beyond rtol |ref| + atol rms(row) "
            f"({tol_table[ref.dtype]}); worst scaled error "
            f"{row_scaled_error(out, ref, tol_table):.3g}; "
            f"first at {i}: out {out[i].item()} ref {ref[i].item()} {msg}")
    if max_mismatch is not None:
        differ = int((out != ref).sum())
        assert differ <= max_mismatch * out.numel() + 2, (
            f"{differ} of {out.numel()} elements differ from the reference (each within "
            f"tolerance, but too many for rounding accidents) {msg}")


def assert_int8_close(out: torch.Tensor, ref: torch.Tensor, msg: str = "",
                      max_mismatch: Optional[float] = INT8_MAX_MISMATCH) -> None:
    assert_row_close(out, ref, TOL_INT8, msg, max_mismatch)


def run_fused_int8(x, w1, s1, w2, s2, tw, ti, *, is_vnni: bool, **kw) -> torch.Tensor:
    """fused_experts with moe_comp_method=1 from unpacked int8 weights: packs them first
    when is_vnni, else lets the op pack them per call."""
    if is_vnni:
        w1, w2 = pack(w1), pack(w2)
    return cpumoe.fused_experts(x, w1, w2, tw, ti, moe_comp_method=INT8, w1_scale=s1,
                                w2_scale=s2, is_vnni=is_vnni, **kw)


# ---------------------------------------------------------------------------------------
# FP8 W8A16 (moe_comp_method 2) helpers.

FP8 = 2  # moe_comp_method of FP8 W8A16
FP8_DTYPE = torch.float8_e4m3fn


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(oc: int, ic: int, block) -> tuple:
    """Block scale shape of an [oc, ic] weight for block_size = [block_n, block_k]."""
    return ceil_div(oc, block[0]), ceil_div(ic, block[1])


def fp8_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn tensor with the given byte values (any integer tensor)."""
    return codes.to(torch.uint8).view(FP8_DTYPE)


def make_fp8_weights(E: int, N: int, K: int, block, style: str = "quant"):
    """float8_e4m3fn expert weights w1 [E, 2N, K], w2 [E, K, N] with fp32 block scales
    s1 [E, ceil(2N/bn), ceil(K/bk)], s2 [E, ceil(K/bn), ceil(N/bk)].

    * ``"quant"``: :func:`cpumoe.quant.quantize_fp8_blockwise` of the float weights of
      :func:`make_weights` (what a DeepSeek-style checkpoint holds);
    * ``"sglang"``: the data of SGLang's own CPU test test_fp8_moe:
      ``w = clamp(randn * 400, -400, 400).fp8``, scales ``rand * 1e-3``.
    """
    from cpumoe import quant

    if style == "quant":
        f1, f2 = make_weights(E, N, K, torch.float32)
        w1, s1 = quant.quantize_fp8_blockwise(f1, block)
        w2, s2 = quant.quantize_fp8_blockwise(f2, block)
    elif style == "sglang":
        w1 = (torch.randn(E, 2 * N, K) * 400).clamp(-400, 400).to(FP8_DTYPE)
        w2 = (torch.randn(E, K, N) * 400).clamp(-400, 400).to(FP8_DTYPE)
        s1 = torch.rand(E, *fp8_scale_shape(2 * N, K, block)) * 1e-3
        s2 = torch.rand(E, *fp8_scale_shape(K, N, block)) * 1e-3
    else:
        raise ValueError(f"unknown fp8 weight style {style!r}")
    return w1, s1, w2, s2


def run_fused_fp8(x, w1, s1, w2, s2, tw, ti, block, *, is_vnni: bool, **kw) -> torch.Tensor:
    """fused_experts with moe_comp_method=2 from unpacked fp8 weights: packs them first
    when is_vnni, else lets the op pack them per call."""
    if is_vnni:
        w1, w2 = pack(w1), pack(w2)
    return cpumoe.fused_experts(x, w1, w2, tw, ti, moe_comp_method=FP8, w1_scale=s1,
                                w2_scale=s2, block_size=list(block), is_vnni=is_vnni, **kw)


# Tolerance of FP8 W8A16 outputs against reference.fused_experts(..., moe_comp_method=2).
# The reference decodes each e4m3 byte exactly and multiplies by its block scale with one
# fp32 rounding (reference.dequantize_fp8_blocks), then runs an fp32 GEMM; the kernels sum
# each K block's exact products x * e4m3 in one fp32 chain and fold that sum in with one
# fma by the block scale (exact_reference.fp8_block_linear). Both compute in fp32 from
# the same 16-bit activations. What differs is what differs on the bf16 path (TOL above):
#   * summation and rounding order: per-weight scale rounding and torch's blocked sums on
#     one side, per-block chains and one scale rounding per block on the other; relative
#     ~ sqrt(K) * 2^-24;
#   * torch's exp vs the kernels' polynomial in silu/sigmoid (a few fp32 ulp);
#   * either can flip the 16-bit rounding of an intermediate a[n], moving y[k] by
#     w2[k, n] * ulp16(a[n]) (~2^-8 / sqrt(N) of the row's rms for bf16), or flip the final
#     rounding by one output ulp (<= 2^-7 |v| for bf16, 2^-10 |v| for fp16).
# rtol covers the output ulp; the intermediate flips are absolute in the row's scale, so
# atol multiplies the rms of the reference row (SGLang's data gives outputs ~0.05, where a
# fixed atol of 1e-2 would accept 20% errors): |out - ref| <= rtol |ref| + atol rms(row).
# A real error (wrong block scale, a 0 decoded as 2^-7 * scale, a subnormal misdecoded,
# a shifted block, a swapped gate/up, a dropped bias) moves outputs by O(1%-100%).
# exact_reference.fp8_exact_reference removes every difference: tests that need more
# compare bit for bit against it.
# One output ulp is at most 2^-7 / 1e-2 = 0.78 (bf16) and 2^-10 / 2e-3 = 0.49 (fp16) of the
# bound. Measured with the per-block order (test_fp8.py's PAIRWISE + EXTRA, 4 seeds, 196
# problems; avx512 tier, which is bit-identical to the others): worst |out - ref| / bound
# = 0.57 (bf16) and 0.42 (fp16) (0.48 / 0.32 over 536 problems with the earlier per-weight
# scaling); every problem the tests also run through fp8_exact_reference equals it bit for
# bit.
TOL_FP8 = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
# No limit on how many elements may differ by an ulp: an intermediate flip shifts every
# output of its token by ~1/sqrt(N) of an ulp, so a problem with few tokens can see 15% of
# its elements differ by one ulp (measured: fp16, M=2, N=512). Bit-level agreement is
# checked against fp8_exact_reference instead, which is exact.
FP8_MAX_MISMATCH = None


def assert_fp8_close(out: torch.Tensor, ref: torch.Tensor, msg: str = "",
                     max_mismatch: Optional[float] = FP8_MAX_MISMATCH) -> None:
    assert_row_close(out, ref, TOL_FP8, msg, max_mismatch)


def subprocess_env(**extra):
    """Environment for a child Python that must import the very cpumoe this process
    imported (the installed package in CI, the in-place build in a dev checkout):
    its directory goes first on PYTHONPATH, CPUMOE_ISA is cleared, `extra` is added."""
    import cpumoe

    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(cpumoe.__file__)))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CPUMOE_ISA", None)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------
# INT4 W4A8 (moe_comp_method 3) helpers.

INT4 = 3  # moe_comp_method of INT4 W4A8
INT4_FORMATS = {"awq": 0, "gptq": 1}  # quant_method_4bit of convert_weight_packed_scale_zp
# Tolerance against reference.fused_experts(..., moe_comp_method=3): the reference repeats
# the kernels' order (per-row activation quantization as for INT8, exact integer block
# sums, one fmaf per block with the group scale, times the row scale), so what differs is
# what TOL_INT8 explains: torch's exp vs the kernels' and the order of the slot sum.
TOL_INT4 = TOL_INT8


class Int4Weights:
    """One expert set in the three forms a test needs: ``ckpt1/ckpt2`` the AWQ or GPTQ
    checkpoint tensors (qweight, qzeros, scales), ``u1/u2`` unpacked (nibbles, zeros, scales
    [E, OC, G]) for reference.py, ``p1/p2`` packed (weight, zeros, scales) for the op."""

    def __init__(self, E: int, N: int, K: int, group: int, fmt: str = "awq", group2=None,
                 scales_dtype: torch.dtype = torch.float16):
        from cpumoe import quant, reference

        f1, f2 = make_weights(E, N, K, torch.float32)
        self.group, self.group2 = group, group2 or group
        self.fmt, self.method = fmt, INT4_FORMATS[fmt]
        self.ckpt1 = quant.quantize_int4(f1, self.group, fmt, scales_dtype)
        self.ckpt2 = quant.quantize_int4(f2, self.group2, fmt, scales_dtype)
        self.u1 = reference.unpack_int4_checkpoint(*self.ckpt1, self.method)
        self.u2 = reference.unpack_int4_checkpoint(*self.ckpt2, self.method)
        self.p1 = cpumoe.convert_weight_packed_scale_zp(*self.ckpt1, self.method)
        self.p2 = cpumoe.convert_weight_packed_scale_zp(*self.ckpt2, self.method)

    def op_kwargs(self) -> dict:
        return dict(moe_comp_method=INT4, w1_scale=self.p1[2], w2_scale=self.p2[2],
                    w1_zero=self.p1[1], w2_zero=self.p2[1])

    def ref_kwargs(self) -> dict:
        return dict(moe_comp_method=INT4, w1_scale=self.u1[2], w2_scale=self.u2[2],
                    w1_zero=self.u1[1], w2_zero=self.u2[1])


def run_fused_int4(x, w: Int4Weights, tw, ti, **kw) -> torch.Tensor:
    return cpumoe.fused_experts(x, w.p1[0], w.p2[0], tw, ti, **w.op_kwargs(), **kw)


def ref_int4(x, w: Int4Weights, tw, ti, **kw) -> torch.Tensor:
    from cpumoe import reference

    return reference.fused_experts(x, w.u1[0], w.u2[0], tw, ti, **w.ref_kwargs(), **kw)


def assert_int4_close(out: torch.Tensor, ref: torch.Tensor, msg: str = "",
                      max_mismatch: Optional[float] = INT8_MAX_MISMATCH) -> None:
    assert_row_close(out, ref, TOL_INT4, msg, max_mismatch)


# ---------------------------------------------------------------------------------------
# MXFP4 (moe_comp_method 4) helpers.

MXFP4 = 4  # moe_comp_method of MXFP4


def make_mxfp4_weights(E: int, N: int, K: int, style: str = "quant"):
    """MXFP4 expert weights as a checkpoint holds them (unpacked): uint8 codes c1 [E, 2N,
    K/2], c2 [E, K, N/2] and e8m0 scales s1 [E, 2N, K/32], s2 [E, K, N/32], from
    :func:`cpumoe.quant.quantize_mxfp4` of

    * ``"quant"``: the float weights of :func:`make_weights` (gate/up values ~ N(0, 1) for
      x ~ N(0, 1));
    * ``"sglang"``: SGLang's own CPU test test_mxfp4_moe's, ``randn / 10`` (its
      quantizer chooses the scales as ours does).
    """
    from cpumoe import quant

    if style == "quant":
        f1, f2 = make_weights(E, N, K, torch.float32)
    elif style == "sglang":
        f1, f2 = torch.randn(E, 2 * N, K) / 10, torch.randn(E, K, N) / 10
    else:
        raise ValueError(f"unknown mxfp4 weight style {style!r}")
    c1, s1 = quant.quantize_mxfp4(f1)
    c2, s2 = quant.quantize_mxfp4(f2)
    return c1, s1, c2, s2


def run_fused_mxfp4(x, c1, s1, c2, s2, tw, ti, *, is_vnni: bool = True, **kw) -> torch.Tensor:
    """fused_experts with moe_comp_method=4 from unpacked codes and scales: the scales are
    always packed (convert_scale_packed: is_vnni concerns the weights only, as in SGLang);
    the codes are packed first when is_vnni, else the op packs them per call."""
    if is_vnni:
        c1, c2 = pack(c1), pack(c2)
    return cpumoe.fused_experts(x, c1, c2, tw, ti, moe_comp_method=MXFP4,
                                w1_scale=cpumoe.convert_scale_packed(s1),
                                w2_scale=cpumoe.convert_scale_packed(s2), is_vnni=is_vnni, **kw)


# Tolerance of MXFP4 outputs against reference.fused_experts(..., moe_comp_method=4). Both
# sides decode every weight exactly (e2m1 times a power of two is a bf16 number), so what
# differs is exactly what differs for 16-bit weights (TOL above) with the rounding of the
# output and the intermediate: the order of the fp32 sums (torch's blocked GEMM against one
# chain per element) and torch's exp against the kernels' polynomial, each able to flip the
# 16-bit rounding of an intermediate a[n] (moving y[k] by w2[k, n] * ulp16(a[n]), ~2^-8 /
# sqrt(N) of the row's rms for bf16) or of the output (one output ulp: <= 2^-7 |v| bf16,
# 2^-10 |v| fp16). The intermediate flips are absolute in the row's scale, so the bound is
# |out - ref| <= rtol |ref| + atol rms(row), as for FP8 (SGLang's data gives outputs ~0.05,
# where a fixed atol of 1e-2 would accept 20% errors). A real error (a scale off by one
# exponent, a nibble or row order mixed up, a zero code decoded as 2^(s-127), a swapped
# gate/up, a dropped bias) moves outputs by O(10%-100%). exact_reference.mxfp4_exact_reference
# removes every difference: tests that need more compare bit for bit against it.
TOL_MXFP4 = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_mxfp4_close(out: torch.Tensor, ref: torch.Tensor, msg: str = "") -> None:
    """Within TOL_MXFP4 (no limit on how many elements differ by an ulp, as FP8: an
    intermediate flip moves every output of its token a little)."""
    assert_row_close(out, ref, TOL_MXFP4, msg, max_mismatch=None)


def mxfp4_ref_kwargs(s1, s2) -> dict:
    """reference.fused_experts's keyword arguments for unpacked MXFP4 scales."""
    return dict(moe_comp_method=MXFP4, w1_scale=s1, w2_scale=s2)


# ---------------------------------------------------------------------------------------
# Any scheme.


def make_scheme_weights(method: int, E: int, N: int, K: int, dtype=torch.bfloat16,
                        block=(32, 32)):
    """Unpacked w1 [E, 2N, K], w2 [E, K, N] of moe_comp_method 0 (in `dtype`), 1 (int8) or 2
    (fp8 with `block`), and the keyword arguments that go with them (moe_comp_method,
    scales, block_size), which the op (after packing w1/w2) and reference.fused_experts
    both take. INT4 has its own form: Int4Weights; MXFP4 too (make_mxfp4_weights: its
    scales are packed for the op, unpacked for the reference)."""
    if method == 0:
        w1, w2 = make_weights(E, N, K, dtype)
        return w1, w2, dict(moe_comp_method=0)
    if method == 1:
        w1, s1, w2, s2 = make_int8_weights(E, N, K)
        return w1, w2, dict(moe_comp_method=1, w1_scale=s1, w2_scale=s2)
    w1, s1, w2, s2 = make_fp8_weights(E, N, K, block)
    return w1, w2, dict(moe_comp_method=2, w1_scale=s1, w2_scale=s2, block_size=list(block))


# ---------------------------------------------------------------------------------------
# Numerics classes: which tiers must agree bit for bit, and how closely the others must.

# Tolerance between outputs of tiers of different numerics classes (cpumoe.numerics_class;
# docs/NUMERICS.md, tolerances between classes), per scheme: each scheme's tolerance
# against reference.py, in the same form (elementwise for 16-bit weights, scaled by the rms
# of the output row for the quantized schemes).
# Why the same bound: a class fixes one fp32 operation order (summation order, exp, where a
# scale is applied); reference.py is just another such order. Each of them computes the
# exact math up to fp32 noise and rounds to 16 bits, so any two differ by what that noise
# can do: flip an intermediate 16-bit rounding, then land the output on the neighbouring
# ulp. The reasoning at each TOL table bounds exactly that. The count of differing elements
# is not limited (INT8_MAX_MISMATCH guards the fp32-chain order against reference.py; a
# class with another order may move many elements by an ulp and still be right).
CROSS_CLASS_TOLERANCE = {
    cpumoe.MoeCompMethod.UNQUANT: TOL,
    cpumoe.MoeCompMethod.INT8_W8A8: TOL_INT8,
    cpumoe.MoeCompMethod.FP8_W8A16: TOL_FP8,
    cpumoe.MoeCompMethod.INT4_W4A8: TOL_INT4,
    cpumoe.MoeCompMethod.MXFP4: TOL_MXFP4,
}


# Classes that part from another class only where a denormal occurs: fp32-chain-daz is the
# fp32 chain on bf16 dot-product instructions that flush denormal inputs and results
# (docs/NUMERICS.md). The tests' data make no denormal (inputs and every intermediate are
# O(1)), so there such a class must give its base class's bits; tests/test_denormals.py
# holds them to the tolerance where denormals do occur.
DENORMALS_ONLY = {"fp32-chain-daz": "fp32-chain"}


# Classes whose bf16 dot products flush denormals (in the calls docs/NUMERICS.md says).
FLUSHING_CLASSES = {"fp32-chain-daz", "amx-bf16"}


def flushes_denormals(tier: str) -> bool:
    return cpumoe.numerics_class(tier) in FLUSHING_CLASSES


# Classes whose bf16-activation bits depend on how many rows an expert gets in the batch:
# blocks of few rows and larger ones take kernels that round differently (vdpbf16ps and
# AMX tdpbf16ps, docs/NUMERICS.md); there a token alone and in a batch agree within the
# cross-class tolerance, not bit for bit.
BATCH_DEPENDENT_CLASSES = {"amx-bf16"}


def batch_dependent(tier: str, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and cpumoe.numerics_class(tier) in BATCH_DEPENDENT_CLASSES


def bits_class(numerics_class: str) -> str:
    """The class whose bits a class gives on the tests' data (denormal-free)."""
    return DENORMALS_ONLY.get(numerics_class, numerics_class)


def bit_difference(out: torch.Tensor, expected: torch.Tensor) -> str:
    """How far from bit-identical out is: the count of differing elements and the largest
    difference (for assertion messages)."""
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return (f"got {out.dtype} {tuple(out.shape)}, expected {expected.dtype} "
                f"{tuple(expected.shape)}")
    diff = (out.float() - expected.float()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    return f"{int((diff != 0).sum())} of {diff.numel()} elements differ (max {worst})"


def assert_numerics_agree(out: torch.Tensor, out_class: str, expected: torch.Tensor,
                          expected_class: str, scheme: int, msg: str = "") -> None:
    """out and expected are one call's result from two sources (two tiers, or a tier and
    an exact model) of numerics classes out_class and expected_class: bit-identical when
    the classes are the same (or differ only on denormals, DENORMALS_ONLY: the tests' data
    have none), else within CROSS_CLASS_TOLERANCE[scheme]."""
    if bits_class(out_class) == bits_class(expected_class):
        assert torch.equal(out, expected), (
            f"{bit_difference(out, expected)}; both of numerics class {out_class} {msg}")
        return
    tol_table = CROSS_CLASS_TOLERANCE[scheme]
    where = f"(numerics classes {out_class} vs {expected_class}) {msg}"
    if scheme == cpumoe.MoeCompMethod.UNQUANT:
        assert_elementwise_close(out, expected, tol_table, where)
    else:
        assert_row_close(out, expected, tol_table, where, max_mismatch=None)


def assert_tiers_agree(outs: dict, scheme: int, msg: str = "") -> torch.Tensor:
    """outs maps tiers (worst first) to their outputs of one call. Each tier must equal
    the first tier of its numerics class bit for bit, and each class's first tier must be
    within CROSS_CLASS_TOLERANCE[scheme] of the first tier of all. Returns that first
    tier's output, the one the tests compare with a reference."""
    tiers = list(outs)
    first_of_class = {}
    for tier in tiers:
        tier_class = cpumoe.numerics_class(tier)
        anchor = first_of_class.setdefault(bits_class(tier_class), tier)
        if anchor == tier:
            anchor = tiers[0]
        assert_numerics_agree(outs[tier], tier_class, outs[anchor],
                              cpumoe.numerics_class(anchor), scheme,
                              f"({tier} vs {anchor}) {msg}")
    return outs[tiers[0]]


def assert_matches_exact(out: torch.Tensor, expected: torch.Tensor, scheme: int,
                         msg: str = "", tier: Optional[str] = None) -> None:
    """out, computed on `tier` (default: the active one), against exact_reference's model
    of the same call: bit for bit when the tier is of the class that model repeats
    (EXACT_NUMERICS_CLASS), else within CROSS_CLASS_TOLERANCE[scheme]."""
    from exact_reference import EXACT_NUMERICS_CLASS

    tier = cpumoe.isa() if tier is None else tier
    assert_numerics_agree(out, cpumoe.numerics_class(tier), expected, EXACT_NUMERICS_CLASS,
                          scheme, f"({tier} vs exact_reference) {msg}")
