"""The NaN/Inf policy of docs/ERRORS.md ("NaN and Inf"), for moe_comp_method 0, 1 and 2 (and
3 and 4 for activations, topk weights, group scales and MXFP4's infinite weights) on every
tier:

* NaN/Inf in a token's activations reach that token's output row only (with silu·mul the
  whole row becomes non-finite; INT8 makes it exactly NaN, see below; with the clamped
  swiglu the clamp may catch an Inf); a token whose slots are all -1 still outputs zeros;
* NaN/Inf in a weight, scale or bias of expert e reach only the tokens routed to e: a
  w1-side value poisons their whole rows, a w2-side value (row k of w2, its scale, w2_bias[k])
  only column k;
* NaN in a topk weight poisons its token's row only;
* INT8 (and INT4) activation quantization of a row holding Inf or NaN: its absmax is Inf/NaN, so the
  row scale is Inf/NaN, every code is 0 (x * 127/Inf = 0; a NaN or Inf element becomes 0),
  and dequantization gives 0 * Inf or 0 * NaN: the token's outputs are all NaN, never Inf.

Every unaffected element is compared bit for bit with the clean run; the non-finite mask
with reference.py's.
"""

from __future__ import annotations

import pytest
import torch

import cpumoe
from cpumoe import reference
from cpumoe_testing import (
    DTYPES,
    Int4Weights,
    make_mxfp4_weights,
    make_routing,
    make_scheme_weights,
    pack,
)

M, E, TOPK, N, K = 30, 4, 2, 64, 96  # 30 tokens: panels hold several tokens on every tier
BLOCK = (32, 32)
SCHEMES = {0: "bf16", 1: "int8", 2: "fp8"}
# INT4 quantizes activations like INT8; its group scales: test_int4_nonfinite_scale_stays_in_its_expert
# MXFP4's infinite weights (scale 255): test_mxfp4_infinite_weight_stays_in_its_expert
ACT_SCHEMES = {**SCHEMES, 3: "int4", 4: "mxfp4"}
NAN, INF = float("nan"), float("inf")


def problem(method: int, dtype=torch.bfloat16) -> dict:
    """Unpacked arguments of reference.fused_experts for a problem of `method` (INT4: plus
    the packed tensors under "packed", which `run` uses)."""
    x = torch.randn(M, K).to(dtype)
    if method == 3:
        w = Int4Weights(E, N, K, 32)
        tw, ti = make_routing(M, E, TOPK)
        return dict(hidden_states=x, w1=w.u1[0], w2=w.u2[0], topk_weights=tw, topk_ids=ti,
                    **w.ref_kwargs(), packed=(w.p1[0], w.p2[0], w.op_kwargs()))
    if method == 4:
        c1, s1, c2, s2 = make_mxfp4_weights(E, N, K)
        tw, ti = make_routing(M, E, TOPK)
        return dict(hidden_states=x, w1=c1, w2=c2, topk_weights=tw, topk_ids=ti,
                    moe_comp_method=4, w1_scale=s1, w2_scale=s2, packed=mxfp4_packed(c1, s1, c2, s2))
    w1, w2, kw = make_scheme_weights(method, E, N, K, dtype, BLOCK)
    tw, ti = make_routing(M, E, TOPK)
    return dict(hidden_states=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ti, **kw)


def mxfp4_packed(c1, s1, c2, s2):
    """what the op takes for unpacked MXFP4 codes and scales"""
    return (pack(c1), pack(c2), dict(w1_scale=cpumoe.convert_scale_packed(s1),
                                     w2_scale=cpumoe.convert_scale_packed(s2)))


def run(p: dict) -> torch.Tensor:
    a = dict(p)
    w1, w2 = a.pop("w1"), a.pop("w2")
    if "packed" in a:  # INT4 and MXFP4: the op takes the packers' tensors
        w1, w2, kw = a.pop("packed")
        a = dict(a, **kw)
    else:
        w1, w2 = pack(w1), pack(w2)
    return cpumoe.fused_experts(a.pop("hidden_states"), w1, w2, a.pop("topk_weights"),
                                a.pop("topk_ids"), **a)


def ref(p: dict) -> torch.Tensor:
    return reference.fused_experts(**{k: v for k, v in p.items() if k != "packed"})


def check(out, clean, ref, poisoned_rows, cols=None, exactly_nan=False):
    """Elements of poisoned_rows (x cols, default all) are non-finite (NaN when
    exactly_nan), every other element equals the clean run bit for bit, and the
    non-finite mask is the reference's."""
    mask = torch.zeros(M, K, dtype=torch.bool)
    rows = torch.as_tensor(poisoned_rows, dtype=torch.long)
    if cols is None:
        mask[rows] = True
    else:
        mask[rows[:, None], torch.as_tensor(cols)[None, :]] = True
    of = out.float()
    assert not torch.isfinite(of[mask]).any(), "a poisoned element is finite"
    if exactly_nan:
        assert torch.isnan(of[mask]).all(), "a poisoned element is Inf, not NaN"
    assert torch.equal(out[~mask], clean[~mask]), "the poison reached an unrelated element"
    assert torch.equal(torch.isfinite(of), torch.isfinite(ref.float())), "mask differs from ref"


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("method", ACT_SCHEMES, ids=ACT_SCHEMES.get)
def test_nonfinite_activations_stay_in_their_token(isa, method, dt):
    p = problem(method, DTYPES[dt])
    p["topk_ids"][17] = -1
    clean = run(p)
    x = p["hidden_states"].clone()
    x[0, 5] = NAN
    x[5, 40] = INF
    x[9, 0] = -INF
    x[13] = INF
    x[17] = NAN  # every slot -1: never read
    x[21, 95] = NAN
    x[21, 3] = INF
    p["hidden_states"] = x
    out = run(p)
    # INT8/INT4: exactly NaN (see the module docstring); 16-bit/FP8 weights: non-finite
    check(out, clean, ref(p), [0, 5, 9, 13, 21], exactly_nan=method in (1, 3))
    assert torch.equal(out[17], torch.zeros(K, dtype=x.dtype))


@pytest.mark.parametrize("method", ACT_SCHEMES, ids=ACT_SCHEMES.get)
def test_swiglu_clamp_keeps_nonfinite_in_token(isa, method):
    """The clamped swiglu clips +Inf gate/up values to `limit`, so an Inf can come out
    finite (as in the reference); whatever comes out, it stays in its token."""
    p = problem(method)
    p.update(alpha=1.702, limit=7.0)
    clean = run(p)
    x = p["hidden_states"].clone()
    x[2, 7] = INF
    x[11, 8] = NAN
    x[12] = -INF
    p["hidden_states"] = x
    out = run(p)
    keep = torch.ones(M, dtype=torch.bool)
    keep[[2, 11, 12]] = False
    assert torch.equal(out[keep], clean[keep])
    assert torch.equal(torch.isfinite(out.float()), torch.isfinite(ref(p).float()))
    assert not torch.isfinite(out[11].float()).all()


def test_int8_quantization_of_nonfinite_rows():
    """reference.quantize_rows_int8 (the kernels' contract, bit for bit) on rows with Inf
    or NaN: scale Inf/NaN, every code 0; so dequantization (code sums * scale) is NaN."""
    x = torch.randn(4, 64)
    x[1, 3] = INF
    x[2, 60] = -INF
    x[3, 0] = NAN
    q, scale = reference.quantize_rows_int8(x)
    assert torch.isfinite(scale[0]) and scale[1] == INF and scale[2] == INF
    assert torch.isnan(scale[3])
    assert torch.equal(q[1:], torch.zeros(3, 64))
    assert torch.isnan(torch.zeros(()) * scale[1:]).all()


def _hit_rows(p, e):
    hit = (p["topk_ids"] == e).any(dim=1)
    assert hit.any() and not hit.all()
    return hit.nonzero().flatten()


def _poison_w1(method):
    """A NaN on the w1 side of expert 1: the whole rows of its tokens."""
    def apply(p):
        if method == 0:
            p["w1"] = p["w1"].clone()
            p["w1"][1, 3, 5] = NAN  # gate row 3
        elif method == 1:
            p["w1_scale"] = p["w1_scale"].clone()
            p["w1_scale"][1, N + 7] = NAN  # up row 7's channel scale
        else:
            p["w1_scale"] = p["w1_scale"].clone()
            p["w1_scale"][1, 1, 2] = NAN  # gate rows 32..63, k 64..95
        return None
    return apply


def _poison_w2(method):
    """An Inf on the w2 side of expert 1 (row k = 40 of w2 or its scale): column 40 of its
    tokens (FP8: the 32 rows of the scale block, columns 32..63)."""
    def apply(p):
        if method == 0:
            p["w2"] = p["w2"].clone()
            p["w2"][1, 40, 9] = INF
            return [40]
        if method == 1:
            p["w2_scale"] = p["w2_scale"].clone()
            p["w2_scale"][1, 40] = INF
            return [40]
        p["w2_scale"] = p["w2_scale"].clone()
        p["w2_scale"][1, 1, 0] = INF
        return list(range(32, 64))
    return apply


def _poison_w1_bias(method):
    def apply(p):
        p["w1_bias"][1, 2] = NAN
        return None
    return apply


def _poison_w2_bias(method):
    def apply(p):
        p["w2_bias"][1, 70] = -INF
        return [70]
    return apply


POISONS = {"w1": _poison_w1, "w2": _poison_w2, "w1_bias": _poison_w1_bias,
           "w2_bias": _poison_w2_bias}


@pytest.mark.parametrize("where", POISONS)
@pytest.mark.parametrize("method", SCHEMES, ids=SCHEMES.get)
def test_nonfinite_weight_stays_in_its_expert(isa, method, where):
    p = problem(method)
    if "bias" in where:
        p.update(w1_bias=torch.randn(E, 2 * N) * 0.5, w2_bias=torch.randn(E, K) * 0.5)
    clean = run(p)
    cols = POISONS[where](method)(p)
    out = run(p)
    check(out, clean, ref(p), _hit_rows(p, 1), cols,
          exactly_nan=cols is None)


@pytest.mark.parametrize("method", ACT_SCHEMES, ids=ACT_SCHEMES.get)
def test_nan_topk_weight_stays_in_its_token(isa, method):
    p = problem(method)
    clean = run(p)
    p["topk_weights"] = p["topk_weights"].clone()
    p["topk_weights"][6, 1] = NAN
    out = run(p)
    check(out, clean, ref(p), [6], exactly_nan=True)


@pytest.mark.parametrize("side", ["w1", "w2"])
def test_int4_nonfinite_scale_stays_in_its_expert(isa, side):
    """INT4: a NaN in a w1 group scale of expert 1 poisons its tokens' whole rows; an Inf in
    a w2 group scale (output row k = 40) only column 40 of them. The packed scales
    [E, OC/32, G, 32] and the reference's [E, OC, G] carry the same poison."""
    p = problem(3)
    clean = run(p)
    w1p, w2p, kw = p["packed"]
    kw = dict(kw)
    if side == "w1":
        row, group, value, name, cols = N + 7, 2, NAN, "w1_scale", None  # up row 7, k 64..95
    else:
        row, group, value, name, cols = 40, 1, INF, "w2_scale", [40]
    packed = kw[name].clone()
    packed[1, row // 32, group, row % 32] = value
    unpacked = p[name].clone()
    unpacked[1, row, group] = value
    kw[name] = packed
    p.update({name: unpacked, "packed": (w1p, w2p, kw)})
    check(run(p), clean, ref(p), _hit_rows(p, 1), cols, exactly_nan=cols is None)


@pytest.mark.parametrize("side", ["w1", "w2"])
def test_mxfp4_infinite_weight_stays_in_its_expert(isa, side):
    """MXFP4: scale 255 is 2^128, so a code of magnitude 1 or more there decodes to +-inf (the
    e8m0 byte has no NaN here). On w1's side (expert 1, gate row 3's first group) it poisons
    its tokens' whole rows; on w2's side (expert 1, output row 40) only column 40 of them."""
    p = problem(4)
    clean = run(p)
    name, codes_name = ("w1_scale", "w1") if side == "w1" else ("w2_scale", "w2")
    row, cols = (3, None) if side == "w1" else (40, [40])
    scales, codes = p[name].clone(), p[codes_name].clone()
    scales[1, row, 0] = 255
    codes[1, row, 0] = 0x77  # codes 7 and 7: 6 * 2^128 = inf
    p.update({name: scales, codes_name: codes})
    p["packed"] = mxfp4_packed(p["w1"], p["w1_scale"], p["w2"], p["w2_scale"])
    check(run(p), clean, ref(p), _hit_rows(p, 1), cols)
