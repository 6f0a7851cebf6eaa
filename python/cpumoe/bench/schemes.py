"""Weight schemes (:data:`SCHEMES`, ``--scheme``): for each, the weight generator that turns
random float weights into the scheme's packed tensors and keyword arguments of
:func:`cpumoe.fused_experts`, and the dequantized weights the eager baseline reads;
:class:`ExpertWeights` holds one shape's weights in one scheme."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from ..ops import (
    MoeCompMethod,
    convert_scale_packed,
    convert_weight_packed,
    convert_weight_packed_scale_zp,
    fused_experts,
)
from ..quant import (
    quantize_fp8_blockwise,
    quantize_int4,
    quantize_int8_per_channel,
    quantize_mxfp4,
)
from ..reference import dequantize_int4, dequantize_mxfp4, unpack_int4_checkpoint
from .baselines import _rel_diff, baseline_moe, int4pack_unavailable
from .machine import weight_copy
from .shapes import DTYPES, Shape, _dtype_name, make_routings

FP8_BLOCK = (128, 128)  # DeepSeek-V3 style weight_block_size of the fp8 scheme
INT4_GROUPS = (128, 64, 32)  # int4 group size: the first that divides both K and N
INT4_COMP_BYTES = 128  # int32 per column after each packed int4 block (docs/FORMATS.md)


@dataclass
class SchemeWeights:
    """What a scheme's weight generator returns: the packed ``w1``/``w2`` cpumoe reads (None
    when not packing), the other keyword arguments of :func:`cpumoe.fused_experts` (scales,
    zeros, block size; ``moe_comp_method`` comes from the :class:`Scheme`) and what the
    scheme's torch baseline reads (``torch_data``)."""

    w1p: Optional[torch.Tensor]
    w2p: Optional[torch.Tensor]
    kwargs: dict
    torch_data: Optional[tuple] = None


# A weight generator: (w1 [E, 2N, K], w2 [E, K, N] random float weights in the activation
# dtype, generator, pack) -> SchemeWeights. A quantized scheme overwrites w1/w2 with its
# dequantized weights (what the eager baseline then reads).
WeightGenerator = Callable[[torch.Tensor, torch.Tensor, torch.Generator, bool], SchemeWeights]


# The compute ceiling of a scheme's rows by activation dtype (``Scheme.peak_kinds``; the kinds
# of :meth:`~cpumoe.bench.machine.Limits.peak`). 16-bit, FP8 and MXFP4 weights with bf16
# activations are judged against the bf16 peak (AMX tdpbf16ps on amx, whose tile GEMM takes
# bf16 weights and FP8 or MXFP4 decoded to bf16; the fp32 FMA loop on the tiers that widen
# bf16),
# with fp16 activations against the fp32 FMA peak (fp16 is widened to fp32 on every tier).
# INT8 runs u8*s8 dot products whatever the activation dtype; INT4 its own loop of 4-bit
# weights by s8 activations (the u8*s8 loop on the tiers whose INT4 kernels run the same
# instruction; avx2's vpmaddubsw of nibbles does twice the products of its INT8 loop).
FLOAT_PEAKS = {"bf16": "bf16", "fp16": "fp32_fma"}
U8S8_PEAKS = {"bf16": "u8s8", "fp16": "u8s8"}
U4S8_PEAKS = {"bf16": "u4s8", "fp16": "u4s8"}


@dataclass(frozen=True)
class Scheme:
    """One weight scheme of the benchmark: a row of :data:`SCHEMES`."""

    name: str
    method: MoeCompMethod
    text: str  # what it is, for --help and the table header
    peak_kinds: Dict[str, str] = field(hash=False)  # activation dtype -> its rows' ceiling
    make_weights: WeightGenerator
    torch_baseline: Optional[str] = None  # key of BASELINES: torch's own path for these weights
    unavailable: Optional[Callable[[torch.dtype], Optional[str]]] = None  # why cpumoe can't run it

    @property
    def float_weights(self) -> bool:
        """bf16/fp16: the weights are in the activation dtype, which the scheme fixes."""
        return self.name in DTYPES

    def peak_kind(self, dtype) -> str:
        """The compute ceiling (``"fp32_fma"``, ``"bf16"``, ``"u8s8"`` or ``"u4s8"``) of this
        scheme's rows with activations of ``dtype`` (a name of DTYPES or a torch dtype; bf16 and fp16
        fix their own, as in :class:`ExpertWeights`)."""
        return self.peak_kinds[self.name if self.float_weights else _dtype_name(dtype)]


def _float_weights(w1, w2, g, pack) -> SchemeWeights:
    return SchemeWeights(convert_weight_packed(w1) if pack else None,
                         convert_weight_packed(w2) if pack else None, {})


def _int8_weights(w1, w2, g, pack) -> SchemeWeights:
    """Per-channel int8 of the random weights (:func:`cpumoe.quant.quantize_int8_per_channel`);
    torch_data = (q1, s1, q2, s2) for the int8pack baseline."""
    q1, s1 = _quantize_experts(w1)
    q2, s2 = _quantize_experts(w2)
    return SchemeWeights(convert_weight_packed(q1) if pack else None,
                         convert_weight_packed(q2) if pack else None,
                         {"w1_scale": s1, "w2_scale": s2}, (q1, s1, q2, s2))


def _fp8_weights(w1, w2, g, pack) -> SchemeWeights:
    """e4m3 weights with 128x128 block scales (:func:`cpumoe.quant.quantize_fp8_blockwise`;
    partial blocks where K or N is not a multiple of 128)."""
    q1, s1 = _quantize_experts(w1, fp8=True)
    q2, s2 = _quantize_experts(w2, fp8=True)
    return SchemeWeights(convert_weight_packed(q1) if pack else None,
                         convert_weight_packed(q2) if pack else None,
                         {"w1_scale": s1, "w2_scale": s2, "block_size": list(FP8_BLOCK)})


def _mxfp4_weights(w1, w2, g, pack) -> SchemeWeights:
    """MXFP4 of the random weights (:func:`cpumoe.quant.quantize_mxfp4`: e2m1 codes, an e8m0
    scale per 32 input features), codes packed by :func:`cpumoe.convert_weight_packed`,
    scales by :func:`cpumoe.convert_scale_packed`."""
    c1, s1 = _mxfp4_experts(w1)
    c2, s2 = _mxfp4_experts(w2)
    return SchemeWeights(convert_weight_packed(c1) if pack else None,
                         convert_weight_packed(c2) if pack else None,
                         {"w1_scale": convert_scale_packed(s1),
                          "w2_scale": convert_scale_packed(s2)})


def _mxfp4_experts(w: torch.Tensor):
    """Per expert: MXFP4 codes [E, OC, IC/2] and e8m0 scales [E, OC, IC/32] of ``w [E, OC,
    IC]``; ``w`` is overwritten with the decoded weights (exact in bf16; in fp16 rounded), what
    the eager baseline reads. One expert at a time, so the temporaries stay small."""
    E, OC, IC = w.shape
    codes = torch.empty(E, OC, IC // 2, dtype=torch.uint8)
    scales = torch.empty(E, OC, IC // 32, dtype=torch.uint8)
    for e in range(E):
        c, s = quantize_mxfp4(w[e])
        codes[e].copy_(c)
        scales[e].copy_(s)
        w[e].copy_(dequantize_mxfp4(c, s))
    return codes, scales


def int4_group_size(K: int, N: int) -> int:
    """The int4 group size of a shape: the first of :data:`INT4_GROUPS` dividing K and N
    (w1's input is K, w2's is N, and both share one group size)."""
    for gs in INT4_GROUPS:
        if K % gs == 0 and N % gs == 0:
            return gs
    raise ValueError(f"no int4 group size in {INT4_GROUPS} divides K={K} and N={N}")


def _int4_weights(w1, w2, g, pack) -> SchemeWeights:
    """AWQ int4 of the random weights (:func:`cpumoe.quant.quantize_int4`, groups of
    :func:`int4_group_size` along the input dimension, scales in the activation dtype),
    packed with :func:`cpumoe.convert_weight_packed_scale_zp`; torch_data holds torch's
    int4pack form of the same weights (if this torch has it)."""
    gs = int4_group_size(w1.shape[2], w2.shape[2])
    torch_form = pack and int4pack_unavailable(w1.dtype) is None
    ck1, t1 = _int4_experts(w1, gs, torch_form)
    ck2, t2 = _int4_experts(w2, gs, torch_form)
    w1p = w2p = None
    kwargs: dict = {}
    if pack:
        w1p, z1, s1 = convert_weight_packed_scale_zp(*ck1, 0)
        w2p, z2, s2 = convert_weight_packed_scale_zp(*ck2, 0)
        kwargs = {"w1_scale": s1, "w2_scale": s2, "w1_zero": z1, "w2_zero": z2}
    return SchemeWeights(w1p, w2p, kwargs, (*t1, *t2, gs) if torch_form else None)


def _int4_experts(w: torch.Tensor, gs: int, torch_form: bool):
    """Per expert of ``w [E, OC, IC]``: the AWQ checkpoint ``(qweight, qzeros, scales)``
    (stacked over E) and, with ``torch_form``, torch's int4pack tensors of the same
    weights (see :func:`baseline_int4pack_moe`), else None; ``w`` is overwritten with the
    dequantized weights. One expert at a time, so the temporaries stay small."""
    E, OC, IC = w.shape
    G = IC // gs
    qweight = torch.empty(E, IC, OC // 8, dtype=torch.int32)
    qzeros = torch.empty(E, G, OC // 8, dtype=torch.int32)
    scales = torch.empty(E, G, OC, dtype=w.dtype)
    packed = torch.empty(E, OC, IC // 2, dtype=torch.uint8) if torch_form else None
    scale_zero = torch.empty(E, G, OC, 2, dtype=w.dtype) if torch_form else None
    for e in range(E):
        ck = quantize_int4(w[e], gs, "awq", scales_dtype=w.dtype)
        for dst, src in zip((qweight, qzeros, scales), ck):
            dst[e].copy_(src)
        q, z, s = unpack_int4_checkpoint(*ck, 0)  # [OC, IC], [OC, G], [OC, G]
        w[e].copy_(dequantize_int4(q, z, s))
        if torch_form:
            # torch dequantizes (q - 8) * scale + zero, so zero = (8 - z) * scale
            packed[e].copy_(torch._convert_weight_to_int4pack_for_cpu(q, 2))
            scale_zero[e].copy_(torch.stack([s, (8 - z) * s], dim=-1).transpose(0, 1))
    return (qweight, qzeros, scales), ((packed, scale_zero) if torch_form else None)


def _int4_unavailable(dtype: torch.dtype) -> Optional[str]:
    """None when cpumoe runs INT4 W4A8 here, checked once per activation dtype on a tiny
    layer against the eager loop over the dequantized weights; else why not."""
    if dtype in _INT4_REASON:
        return _INT4_REASON[dtype]
    if not hasattr(torch.ops.cpumoe, "convert_weight_packed_scale_zp"):
        reason = ("int4 not built yet: this cpumoe has no "
                  "torch.ops.cpumoe.convert_weight_packed_scale_zp")
    else:
        try:  # a tiny layer against the eager loop over its dequantized weights
            shape = Shape("int4-check", E=4, topk=2, K=256, N=128)
            w = ExpertWeights(shape, dtype, seed=1, scheme="int4")
            g = torch.Generator().manual_seed(1)
            x = torch.randn(3, shape.K, generator=g).to(w.dtype)
            r = make_routings(1, 3, shape.E, shape.topk, g)[0]
            out = fused_experts(x, w.w1p, w.w2p, r.topk_weights, r.topk_ids, is_vnni=True,
                                **w.kwargs)
            diff = _rel_diff(out, baseline_moe(x, w.w1, w.w2, r.topk_weights, r.topk_ids))
            reason = None if diff < 5e-2 else (
                f"int4: cpumoe differs from the eager loop over the dequantized weights by "
                f"{diff:.1e} (relative L2) on a test layer")
        except Exception as e:  # the op rejects moe_comp_method=3 (or the packer fails)
            reason = f"int4 not built yet: {type(e).__name__}: {str(e).splitlines()[0]}"
    _INT4_REASON[dtype] = reason
    return reason


_INT4_REASON: Dict[torch.dtype, Optional[str]] = {}

SCHEMES: Dict[str, Scheme] = {s.name: s for s in (
    Scheme("bf16", MoeCompMethod.UNQUANT, "bf16 weights and activations", FLOAT_PEAKS,
           _float_weights),
    Scheme("fp16", MoeCompMethod.UNQUANT, "fp16 weights and activations", FLOAT_PEAKS,
           _float_weights),
    Scheme("int8", MoeCompMethod.INT8_W8A8, "INT8 W8A8 (moe_comp_method=1): per-channel int8 "
           "weights, activations quantized per token", U8S8_PEAKS, _int8_weights, "int8pack"),
    Scheme("fp8", MoeCompMethod.FP8_W8A16, "FP8 W8A16 (moe_comp_method=2): e4m3 weights, "
           "128x128 block scales", FLOAT_PEAKS, _fp8_weights),
    Scheme("int4", MoeCompMethod.INT4_W4A8, "INT4 W4A8 (moe_comp_method=3): AWQ int4 weights, "
           "groups of 128 (64 or 32 where K or N needs it), activations quantized per token",
           U4S8_PEAKS, _int4_weights, "int4pack", _int4_unavailable),
    Scheme("mxfp4", MoeCompMethod.MXFP4, "MXFP4 (moe_comp_method=4, gpt-oss): e2m1 weights, an "
           "e8m0 scale per 32 input features, decoded exactly to bf16", FLOAT_PEAKS,
           _mxfp4_weights),
)}


def scheme_unavailable(name: str, dtype) -> Optional[str]:
    """None when cpumoe can run scheme ``name`` here with activations of ``dtype``."""
    check = SCHEMES[name].unavailable
    return check(DTYPES[_dtype_name(dtype)]) if check else None


class ExpertWeights:
    """Random expert weights of one shape and weight scheme: ``w1 [E, 2N, K]``,
    ``w2 [E, K, N]`` in the activation dtype (for the eager baseline; the dequantized
    weights for a quantized scheme), the packed ``w1p``, ``w2p`` and the other keyword
    arguments (``kwargs``) cpumoe reads, and what the scheme's torch baseline reads
    (``torch_data``).

    Values are normal with std 1/sqrt(K) (w1) and 1/sqrt(N) (w2), so activations stay
    O(1) and fp16 does not overflow. For speed they are copied from a 16 Mi-value random
    pool at random offsets; values do not affect timing. ``scheme`` is a name of
    :data:`SCHEMES` (default: ``dtype``'s); ``bf16``/``fp16`` fix the activation dtype,
    the quantized schemes use ``dtype``'s. The scheme's weight generator makes the rest.
    """

    def __init__(self, shape: Shape, dtype: str = "bf16", seed: int = 0, pack: bool = True,
                 scheme: Optional[str] = None):
        self.shape = shape
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.scheme = scheme or _dtype_name(self.dtype)
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got '{scheme}'")
        if SCHEMES[self.scheme].float_weights:
            self.dtype = DTYPES[self.scheme]
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.w1, self.w2 = self._random_weights(g)
        made = SCHEMES[self.scheme].make_weights(self.w1, self.w2, g, pack)
        self.w1p, self.w2p = made.w1p, made.w2p
        self.kwargs = {"moe_comp_method": SCHEMES[self.scheme].method, **made.kwargs}
        self.torch_data = made.torch_data
        self._layers = [(self.w1p, self.w2p, self.kwargs)]  # see layers()
        self.peer_data: dict = {}  # the peers' forms of these weights (bench/peers)

    def _random_weights(self, g: torch.Generator):
        E, K, N = self.shape.E, self.shape.K, self.shape.N
        w1 = torch.empty(E, 2 * N, K, dtype=self.dtype)
        w2 = torch.empty(E, K, N, dtype=self.dtype)
        _fill_random(w1, 1.0 / math.sqrt(K), g)
        _fill_random(w2, 1.0 / math.sqrt(N), g)
        return w1, w2

    def source_weights(self):
        """The float weights ``(w1, w2)`` (activation dtype) the scheme's tensors were made
        from: ``w1``/``w2`` themselves for bf16/fp16, drawn again from the seed for the
        quantized schemes (whose ``w1``/``w2`` hold the dequantized weights). A peer that
        quantizes in its own format starts from these, as cpumoe's quantizer did."""
        if SCHEMES[self.scheme].float_weights:
            return self.w1, self.w2
        return self._random_weights(torch.Generator().manual_seed(self.seed))

    def layer_bytes(self) -> int:
        """Bytes of one copy of everything cpumoe reads (packed weights, scales, zeros)."""
        return self.expert_bytes() * self.shape.E

    def layers(self, count: int) -> List[tuple]:
        """``count`` copies of cpumoe's inputs as ``(w1p, w2p, kwargs)``: this object's own
        tensors first, then copies on the packers' huge pages (:func:`weight_copy`; made once
        and kept, see :func:`default_weight_layers`)."""
        while len(self._layers) < count:
            self._layers.append((weight_copy(self.w1p), weight_copy(self.w2p),
                                 {k: weight_copy(v) if isinstance(v, torch.Tensor) else v
                                  for k, v in self.kwargs.items()}))
        del self._layers[max(count, 1):]
        return list(self._layers)

    def made_layers(self) -> List[tuple]:
        """The copies :meth:`layers` made last (at least this object's own tensors): what
        cpumoe's calls cycle through, so that a peer can cycle through the same."""
        return list(self._layers)

    def expert_bytes(self) -> int:
        """Bytes cpumoe reads per expert touched: the packed weights and every per-expert
        tensor passed with them (scales, zero points), over E; e.g. int8 adds an fp32 scale
        and the packed layout's 4-byte compensation per output row (2N + K rows). int4
        leaves out the 128 bytes of compensation after each packed block
        ``[..., 16 bk + 128]``: its decode kernel sums the columns itself and never reads
        them (the prefill path does, where the bound is the arithmetic)."""
        tensors = [self.w1p, self.w2p] + [v for v in self.kwargs.values()
                                          if isinstance(v, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self.scheme == "int4":
            total -= sum(t.numel() // t.shape[-1] * INT4_COMP_BYTES for t in (self.w1p, self.w2p))
        return total // self.shape.E


def _quantize_experts(w: torch.Tensor, fp8: bool = False):
    """Per expert: int8 weights and fp32 scales [E, OC, 1] of ``w [E, OC, IC]`` (or, with
    ``fp8``, float8_e4m3fn weights and fp32 block scales [E, OC/128, IC/128]); ``w`` is
    overwritten with its dequantized values (rounded to its dtype). One expert at a time,
    so the fp32 temporaries stay small."""
    E, OC, IC = w.shape
    if fp8:
        bn, bk = FP8_BLOCK
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(E, -(-OC // bn), -(-IC // bk), dtype=torch.float32)
    else:
        q = torch.empty(w.shape, dtype=torch.int8)
        s = torch.empty(E, OC, 1, dtype=torch.float32)
    for e in range(E):
        qe, se = quantize_fp8_blockwise(w[e], FP8_BLOCK) if fp8 else quantize_int8_per_channel(w[e])
        q[e].copy_(qe)
        s[e].copy_(se)
        full = se.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[:OC, :IC] if fp8 else se
        w[e].copy_(qe.float() * full)
    return q, s


def _fill_random(t: torch.Tensor, std: float, g: torch.Generator, pool_elems: int = 1 << 24) -> None:
    flat = t.view(-1)
    n = flat.numel()
    pool = torch.empty(min(pool_elems, n), dtype=t.dtype).normal_(0.0, std, generator=g)
    P = pool.numel()
    pos = 0
    while pos < n:
        off = int(torch.randint(P, (1,), generator=g))
        take = min(P - off, n - pos)
        flat[pos:pos + take].copy_(pool[off:off + take])
        pos += take

