"""Bit-exact models of the kernels' arithmetic, in torch, for the cpumoe tests.

python/cpumoe/reference.py is the specification: the math and its rounding points, with
torch's exp and a per-expert sum. A tier of the numerics class ``EXACT_NUMERICS_CLASS``
computes the same math in one fixed fp32 operation order; the helpers here repeat that
order step for step, so tests of that class compare with ``torch.equal`` instead of a
tolerance. They live beside the tests, not in reference.py, because the order is one
class's implementation choice: a tier of another class may differ within the scheme's
tolerance (CROSS_CLASS_TOLERANCE in cpumoe_testing.py) and still meet the spec.

* ``kernel_expf`` / ``kernel_silu_and_mul`` / ``kernel_swiglu_clamp`` /
  ``kernel_silu_clamp`` / ``kernel_gelu`` / ``kernel_gelu_and_mul`` / ``kernel_activate`` and the
  ``kernel_activations`` context: the activations of csrc/kernels/common/numeric.h;
* ``kernel_sigmoid`` / ``kernel_sqrtsoftplus`` and the ``kernel_gating`` context: the
  routing scores of numeric.h, with which reference.route gives the routing ops' bits;
* ``slot_order_reference``: the sum over the topk slots in slot order;
* ``int8_exact_reference`` / ``int4_exact_reference``: reference.py's integer-GEMM experts
  (already in the kernels' order) with the two above;
* ``fma_chain_matmul`` / ``fp8_block_linear`` / ``fp8_expert_exact`` /
  ``fp8_exact_reference`` / ``fp8_shared_exact_reference``: FP8 W8A16 in the kernels'
  order (each K block's FMA chain, folded in with its block scale);
* ``mxfp4_expert_exact`` / ``mxfp4_exact_reference``: MXFP4 in the kernels' order (the
  weights decoded exactly, one FMA chain per element: the bf16 scheme's order);
* ``e4m3_value``: an e4m3fn byte's value from the format's definition.

Every fused multiply-add is ``reference.fmaf`` (C's fmaf, exactly rounded once).
"""

from __future__ import annotations

import contextlib

import torch

from cpumoe import reference

# The numerics class whose operation order these helpers repeat (cpumoe.numerics_class).
EXACT_NUMERICS_CLASS = "fp32-chain"


def _f32(v: float) -> torch.Tensor:
    """A Python float as an fp32 scalar, so that torch computes each step in fp32."""
    return torch.tensor(v, dtype=torch.float32)


# cm_expf of numeric.h ("the operation sequence is the contract"). Checked: with
# reference.fmaf, kernel_expf and the silu built on it equal numeric.h compiled with gcc
# (-ffp-contract=off) bit for bit on 5M inputs over [-100, 100]; torch's exp and F.silu
# differ from it on about 0.4% of the inputs.
_EXP_MAGIC = 12582912.0  # 1.5 * 2^23: adding it rounds to an integer (round half to even)
_EXP_POLY = (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


def kernel_expf(x: torch.Tensor) -> torch.Tensor:
    """cm_expf: clamp to [-87, 88], Cody-Waite reduction by ln2, degree-6 polynomial."""
    x = x.float().clamp(-87.0, 88.0)
    t = x * _f32(1.44269504088896341) + _f32(_EXP_MAGIC)
    n = t - _f32(_EXP_MAGIC)
    r = reference.fmaf(n, _f32(-0.693359375), x)
    r = reference.fmaf(n, _f32(2.12194440e-4), r)
    p = torch.full_like(x, 1.9875691500e-4)
    for c in _EXP_POLY:
        p = reference.fmaf(p, r, _f32(c))
    p = reference.fmaf(p, r * r, r) + _f32(1.0)
    return p * torch.pow(_f32(2.0), n)


def kernel_silu(g: torch.Tensor) -> torch.Tensor:
    """cm_siluf: gate / (1 + exp(-gate))."""
    g = g.float()
    return g / (_f32(1.0) + kernel_expf(-g))


def kernel_silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """cm_siluf on the gate half times the up half: (gate / (1 + exp(-gate))) * up."""
    n = h.shape[-1] // 2
    return kernel_silu(h[..., :n]) * h[..., n:].float()


def _kernel_min(lim: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """cm_minf(lim, x) = lim < x ? lim : x: x when x is NaN."""
    return torch.where(lim < x, lim, x)


def _kernel_clamp_sym(x: torch.Tensor, lim: torch.Tensor) -> torch.Tensor:
    """cm_clamp_symf: cm_maxf(-lim, cm_minf(lim, x)), NaN kept."""
    x = _kernel_min(lim, x)
    return torch.where(-lim > x, -lim, x)


def kernel_swiglu_clamp(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """cm_swiglu_clampf on interleaved (gate, up) columns."""
    lim = _f32(limit)
    g = _kernel_min(lim, h[..., 0::2].float())
    u = _kernel_clamp_sym(h[..., 1::2].float(), lim)
    s = _f32(1.0) / (_f32(1.0) + kernel_expf(-(g * _f32(alpha))))
    return (g * s) * (u + _f32(1.0))


def kernel_silu_clamp(h: torch.Tensor, limit: float) -> torch.Tensor:
    """cm_silu_clampf on the gate half and the up half: silu(min(gate, limit)) *
    clamp(up, -limit, limit)."""
    n = h.shape[-1] // 2
    lim = _f32(limit)
    g = _kernel_min(lim, h[..., :n].float())
    return kernel_silu(g) * _kernel_clamp_sym(h[..., n:].float(), lim)


# cm_geluf of numeric.h: x Phi(x) from erfc(|x| / sqrt2) = t exp(P(t) - x^2 / 2),
# t = 2 / (2 + |x| / sqrt2), with x^2 / 2 and P - x^2 / 2 split into rounded value and
# exact rest. The coefficients of P, highest degree first.
_GELU_POLY = (1.372142285e-01, -6.386329532e-01, 1.057038665e+00, -5.630434155e-01,
              -1.908636242e-01, 6.022059545e-02, 1.448902208e-02, 3.908611834e-01,
              9.981399775e-01, -1.265423656e+00)


def kernel_gelu(x: torch.Tensor) -> torch.Tensor:
    """cm_geluf: erf-GELU, x * Phi(x), in the kernels' operation order."""
    x = x.float()
    h = _f32(0.5) * x
    zz = h * x
    lo = reference.fmaf(h, x, -zz)
    t = _f32(2.0) / (_f32(2.0) + x.abs() * _f32(0.707106781))
    p = torch.full_like(x, _GELU_POLY[0])
    for c in _GELU_POLY[1:]:
        p = reference.fmaf(p, t, _f32(c))
    s = p - zz
    err = p - (s + zz)
    deep = s < _f32(-64.0)
    e = kernel_expf(torch.where(deep, s + _f32(22.1875), s))
    q = torch.where(zz < _f32(104.0), (_f32(0.5) * t) * reference.fmaf(e, err - lo, e),
                    _f32(0.0))
    scale = torch.where(deep, _f32(2.312550290e-10), _f32(1.0))
    return torch.where(x < 0, (x * q) * scale, x * (_f32(1.0) - q * scale))


def kernel_gelu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """cm_geluf on the gate half times the up half."""
    n = h.shape[-1] // 2
    return kernel_gelu(h[..., :n]) * h[..., n:].float()


def kernel_activate(h, alpha=None, limit=None, activation=None) -> torch.Tensor:
    """reference.activate with the kernels' activations."""
    if alpha is not None:
        return kernel_swiglu_clamp(h, alpha, limit)
    if limit is not None:
        return kernel_silu_clamp(h, limit)
    return kernel_gelu_and_mul(h) if activation == "gelu" else kernel_silu_and_mul(h)


# The routing scores of numeric.h: cm_sigmoidf, and cm_sqrtsoftplusf with its log1p (the
# Cephes logf polynomial on [1, 2] and Goldberg's correction).
_LOG_POLY = (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)


def kernel_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """cm_sigmoidf: 1 / (1 + exp(-x))."""
    return _f32(1.0) / (_f32(1.0) + kernel_expf(-x.float()))


def kernel_log_1_2f(w: torch.Tensor) -> torch.Tensor:
    """cm_log_1_2f: log(w) for w in [1, 2]."""
    e = torch.where(w > _f32(1.41421356237), _f32(1.0), _f32(0.0))
    f = torch.where(e != 0, w * _f32(0.5), w) - _f32(1.0)
    z = f * f
    p = torch.full_like(f, 7.0376836292e-2)
    for c in _LOG_POLY:
        p = reference.fmaf(p, f, _f32(c))
    y = (p * f) * z
    y = reference.fmaf(e, _f32(-2.12194440e-4), y)
    y = reference.fmaf(z, _f32(-0.5), y)
    return reference.fmaf(e, _f32(0.693359375), f + y)


def kernel_log1pf(u: torch.Tensor) -> torch.Tensor:
    """cm_log1pf: log(1 + u) for u in [0, 1]."""
    w = _f32(1.0) + u
    d = w - _f32(1.0)
    return torch.where(d == 0, u, kernel_log_1_2f(w) * (u / d))


def kernel_sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """cm_sqrtsoftplusf: exp(x / 2) below -16, else sqrt(max(x, 0) + log1p(exp(-|x|)))."""
    x = x.float()
    tail = kernel_expf(_f32(0.5) * x)
    sp = torch.where(x > 0, x, _f32(0.0)) + kernel_log1pf(kernel_expf(-x.abs()))
    # sqrtf is correctly rounded; torch's fp32 sqrt is not always (one ulp off on ~0.6% of
    # inputs), the double sqrt rounded to fp32 is
    return torch.where(x < -16, tail, torch.sqrt(sp.double()).float())


@contextlib.contextmanager
def kernel_gating():
    """Within the block, reference.py's routing uses the kernels' exp, sigmoid and
    sqrtsoftplus: reference.route then gives the ops' bits."""
    names = ("routing_exp", "routing_sigmoid", "routing_sqrtsoftplus")
    saved = [getattr(reference, n) for n in names]
    for n, fn in zip(names, (kernel_expf, kernel_sigmoid, kernel_sqrtsoftplus)):
        setattr(reference, n, fn)
    try:
        yield
    finally:
        for n, fn in zip(names, saved):
            setattr(reference, n, fn)


@contextlib.contextmanager
def kernel_activations():
    """Within the block, reference.py computes its activations as the kernels do."""
    names = ("silu_and_mul", "swiglu_clamp", "silu_clamp", "gelu_and_mul")
    saved = [getattr(reference, n) for n in names]
    for n, fn in zip(names, (kernel_silu_and_mul, kernel_swiglu_clamp, kernel_silu_clamp,
                             kernel_gelu_and_mul)):
        setattr(reference, n, fn)
    try:
        yield
    finally:
        for n, fn in zip(names, saved):
            setattr(reference, n, fn)


def slot_order_reference(x, tw, ti, expert_fn) -> torch.Tensor:
    """A quantized scheme's reference with the two remaining differences to the kernels
    removed: the kernels' exp (kernel_activations) and the sum over the topk slots in slot
    order (the kernels' order; reference.py sums per expert). expert_fn(rows, e) returns
    one expert's fp32 output for the token rows x[rows] (before the topk weight)."""
    M, K = x.shape
    ids = ti.long()
    g = tw.float()
    ys = torch.zeros(M, ids.shape[1], K)
    with kernel_activations():
        for e in ids.unique().tolist():
            if e < 0:
                continue
            rows, slots = (ids == e).nonzero(as_tuple=True)
            ys[rows, slots] = expert_fn(rows, e) * g[rows, slots, None]
    acc = torch.zeros(M, K)
    for j in range(ids.shape[1]):
        acc = acc + ys[:, j]
    return acc.to(x.dtype)


def _expert_bias(bias, e):
    return None if bias is None else bias[e]


def int8_exact_reference(x, w1, s1, w2, s2, tw, ti, w1_bias=None, w2_bias=None,
                         alpha=None, limit=None, activation=None) -> torch.Tensor:
    """reference.fused_experts(..., moe_comp_method=1) in the kernels' exact order
    (slot_order_reference). The INT8 kernels must equal this bit for bit (integer GEMMs,
    every fp32 step in order)."""

    def expert(rows, e):
        return reference.expert_mlp_int8(x[rows], w1[e], s1[e], w2[e], s2[e],
                                         _expert_bias(w1_bias, e), _expert_bias(w2_bias, e),
                                         alpha, limit, activation)

    return slot_order_reference(x, tw, ti, expert)


def int4_exact_reference(x, w, tw, ti, w1_bias=None, w2_bias=None, alpha=None,
                         limit=None, activation=None) -> torch.Tensor:
    """reference.fused_experts(..., moe_comp_method=3) in the kernels' exact order
    (slot_order_reference) for the unpacked weights ``w.u1`` / ``w.u2`` of a
    cpumoe_testing.Int4Weights: the INT4 kernels must equal it bit for bit."""
    (w1, z1, s1), (w2, z2, s2) = w.u1, w.u2

    def expert(rows, e):
        return reference.expert_mlp_int4(x[rows], w1[e], z1[e], s1[e], w2[e], z2[e], s2[e],
                                         _expert_bias(w1_bias, e), _expert_bias(w2_bias, e),
                                         alpha, limit, activation)

    return slot_order_reference(x, tw, ti, expert)


def e4m3_value(code: int) -> float:
    """The e4m3fn value of a byte, from the format's definition (independent of torch):
    s.eeee.mmm, bias 7; e = 0: subnormal (m/8) * 2^-6; 0x7f/0xff: NaN; no infinities."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return float("nan")
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def fma_chain_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [T, R] @ w[O, R].T as the kernels compute it: for each output element one fp32
    FMA chain acc = fmaf(a[t, r], w[o, r], acc) over r = 0, 1, ..., starting from 0."""
    a, w = a.float(), w.float()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
    for r in range(a.shape[1]):
        acc = reference.fmaf(a[:, r:r + 1], w[None, :, r], acc)
    return acc


def fp8_block_linear(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """a [T, IC] @ the FP8 weight w [OC, IC] (float8_e4m3fn) with block scales, as the kernels
    compute it (common/ukernels.h): per K block, P = one FMA chain over the block's k of
    a * (value * 2^-8) from 0, then C = fmaf(P, scale, C), blocks in order; finally C * 256."""
    bn, bk = block
    oc, ic = w.shape
    d = w.float() * 2.0 ** -8  # exact
    s = scale.float().repeat_interleave(bn, 0)[:oc]  # [OC, K blocks]
    c = torch.zeros(a.shape[0], oc, dtype=torch.float32)
    for kb, k0 in enumerate(range(0, ic, bk)):
        p = fma_chain_matmul(a[:, k0:k0 + bk], d[:, k0:k0 + bk])
        c = reference.fmaf(p, s[None, :, kb], c)
    return c * 256.0


def fp8_expert_exact(x, w1, s1, w2, s2, block, b1=None, b2=None, alpha=None,
                     limit=None, activation=None) -> torch.Tensor:
    """One FP8 expert on rows x [T, K] in the kernels' operation order (fp32 [T, K] before
    the topk weight): block-scaled FMA chains (fp8_block_linear), + bias, the kernels'
    activation, rounding to x's dtype, block-scaled FMA chains, + bias."""
    h = fp8_block_linear(x, w1, s1, block)
    if b1 is not None:
        h = h + b1.float()
    a = kernel_activate(h, alpha, limit, activation)
    a = a.to(x.dtype).float()
    y = fp8_block_linear(a, w2, s2, block)
    if b2 is not None:
        y = y + b2.float()
    return y


def fp8_exact_reference(x, w1, s1, w2, s2, tw, ti, block, w1_bias=None, w2_bias=None,
                        alpha=None, limit=None, activation=None) -> torch.Tensor:
    """reference.fused_experts(..., moe_comp_method=2) in the kernels' exact operation
    order (fp8_expert_exact, slot_order_reference). The FP8 kernels must equal this bit for
    bit."""

    def expert(rows, e):
        return fp8_expert_exact(x[rows], w1[e], s1[e], w2[e], s2[e], block,
                                _expert_bias(w1_bias, e), _expert_bias(w2_bias, e), alpha,
                                limit, activation)

    return slot_order_reference(x, tw, ti, expert)


def fp8_shared_exact_reference(x, w1, s1, w2, s2, block, fused=None,
                               factor=None) -> torch.Tensor:
    """shared_expert_cpu(use_fp8_w8a16=True) in the kernels' order: the expert as above
    (weight 1), then + factor * fused_experts_out in fp32 (product rounded, then sum)."""
    y = fp8_expert_exact(x, w1, s1, w2, s2, block)
    acc = torch.zeros_like(y) + y
    if fused is not None:
        acc = acc + torch.tensor(factor, dtype=torch.float32) * fused.float()
    return acc.to(x.dtype)


def mxfp4_expert_exact(x, c1, s1, c2, s2, b1=None, b2=None, alpha=None, limit=None,
                       activation=None) -> torch.Tensor:
    """One MXFP4 expert on rows x [T, K] in the kernels' operation order (fp32 [T, K] before
    the topk weight): the weights decoded exactly (reference.dequantize_mxfp4), one FMA
    chain per output element (fma_chain_matmul), + bias, the kernels' activation, rounding
    to x's dtype, FMA chains, + bias: the bf16 scheme's order on the decoded weights."""
    h = fma_chain_matmul(x, reference.dequantize_mxfp4(c1, s1))
    if b1 is not None:
        h = h + b1.float()
    a = kernel_activate(h, alpha, limit, activation).to(x.dtype).float()
    y = fma_chain_matmul(a, reference.dequantize_mxfp4(c2, s2))
    if b2 is not None:
        y = y + b2.float()
    return y


def mxfp4_exact_reference(x, c1, s1, c2, s2, tw, ti, w1_bias=None, w2_bias=None, alpha=None,
                          limit=None, activation=None) -> torch.Tensor:
    """reference.fused_experts(..., moe_comp_method=4) in the kernels' exact operation order
    (mxfp4_expert_exact, slot_order_reference), for unpacked codes and scales. The MXFP4
    kernels of the fp32-chain class must equal this bit for bit."""

    def expert(rows, e):
        return mxfp4_expert_exact(x[rows], c1[e], s1[e], c2[e], s2[e], _expert_bias(w1_bias, e),
                                  _expert_bias(w2_bias, e), alpha, limit, activation)

    return slot_order_reference(x, tw, ti, expert)
