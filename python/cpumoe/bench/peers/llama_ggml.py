"""llama.cpp's ggml (PyPI ``ggml-python``: ggml built from source on install, with ctypes
bindings): the MoE block as llama.cpp builds it, run on ggml's CPU backend.

The graph, per call (ggml's shapes list the innermost dimension first):

    gate = mul_mat_id(W_gate [K, N, E], x [K, 1, M], ids [topk, M])   -> [N, topk, M]
    up   = mul_mat_id(W_up   [K, N, E], x, ids)                        -> [N, topk, M]
    a    = swiglu_split(gate, up)        (silu(gate) * up where the build lacks it)
    y    = mul_mat_id(W_down [N, K, E], a, ids) * topk_weights [1, topk, M]
    out  = y[:, 0, :] + ... + y[:, topk-1, :]                          -> [K, M]

Weights are made with ``ggml_quantize_chunk`` from the float weights cpumoe's scheme was
made from (:meth:`ExpertWeights.source_weights`): bf16 rows -> BF16, fp16 rows -> F16, int8
rows -> Q8_0, int4 rows -> Q4_0 (peer ``ggml``) and Q4_K (peer ``ggml_q4k``; K and N must be
multiples of 256). Activations enter as fp32 (ggml's activation type); for its quantized dot
products ggml converts them to the weights' ``vec_dot_type`` (Q8_0 for Q8_0 and Q4_0, Q8_K
for Q4_K, BF16 / F16 for the 16-bit types). The graph runs on a ggml threadpool of
``torch.get_num_threads()`` threads, made once per case, as llama.cpp keeps one.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch

from .common import AGREEMENT_BY_BITS, PeerFormat, cached, capped_flags, copies, peer_isa

if TYPE_CHECKING:
    from ..schemes import ExpertWeights

GGML_INSTALL = ("pip install --no-deps ggml-python==0.0.45 (built from source on install: "
                "needs cmake and a C compiler)")
# ggml compiles its SIMD paths in (for the building CPU, by default), so under --peer-isa the
# installed library must have none above the cap: ggml_cpu_has_<name> reports what it has,
# each name checked against the cap as the CPU flag it stands for (common.capped_flags).
_GGML_FEATURE_FLAGS = {"avx512": "avx512f", "avx512_vnni": "avx512_vnni",
                       "avx512_vbmi": "avx512_vbmi", "avx512_bf16": "avx512_bf16",
                       "avx_vnni": "avx_vnni", "amx_int8": "amx_int8"}
GGML_AVX2_INSTALL = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
                     "-DGGML_F16C=ON' pip install --no-deps --no-binary ggml-python --target DIR "
                     "ggml-python==0.0.45, then PYTHONPATH=DIR")

# The ggml type of each scheme's rows, for each of the two ggml peers; the agreement
# tolerance by bits per weight (common.py says why).
GGML_TYPES: Dict[str, Dict[str, str]] = {
    "ggml": {"bf16": "BF16", "fp16": "F16", "int8": "Q8_0", "int4": "Q4_0"},
    "ggml_q4k": {"int4": "Q4_K"},
}
_BITS = {"BF16": 16, "F16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_K": 4}
_REQUIRED = ("ggml_init", "ggml_mul_mat_id", "ggml_quantize_chunk", "ggml_threadpool_new",
             "ggml_graph_plan", "ggml_graph_compute", "ggml_view_2d")


@functools.lru_cache(maxsize=None)
def ggml_module() -> Tuple[Optional[object], Optional[str]]:
    """``(the ggml bindings, None)``, or ``(None, why not)``."""
    try:
        from ggml import ggml as bindings
    except ModuleNotFoundError:
        return None, f"ggml-python is not installed ({GGML_INSTALL})"
    except Exception as e:  # the package is there but its library did not load
        return None, f"importing ggml failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    missing = [n for n in _REQUIRED if not hasattr(bindings, n)]
    if missing:
        return None, f"this ggml-python lacks {', '.join(missing)} ({GGML_INSTALL})"
    bindings.ggml_cpu_init()
    return bindings, None


def ggml_unavailable(dtype: torch.dtype) -> Optional[str]:
    G, why = ggml_module()
    cap = peer_isa()
    if G is None or cap is None:
        return why
    above = [n for n, flag in _GGML_FEATURE_FLAGS.items()
             if not capped_flags({flag}) and getattr(G, f"ggml_cpu_has_{n}", lambda: 0)()]
    if above:
        return (f"this ggml-python is built with {', '.join(above)}, above --peer-isa {cap}; "
                f"one built for AVX2 only: {GGML_AVX2_INSTALL}")
    return None


def _type_id(G, name: str) -> int:
    return getattr(G, f"GGML_TYPE_{name}")


def ggml_format(key: str, w: ExpertWeights) -> Union[PeerFormat, str]:
    name = GGML_TYPES[key].get(w.scheme)
    if name is None:
        return ("ggml types are mapped to "
                + ", ".join(f"{s} rows ({t})" for s, t in GGML_TYPES[key].items()) + " only")
    G, _ = ggml_module()
    t = _type_id(G, name)
    block = G.ggml_blck_size(t)
    if w.shape.K % block or w.shape.N % block:
        return f"{name} needs K and N multiples of {block}"
    return PeerFormat(name, G.ggml_type_size(t) / block, AGREEMENT_BY_BITS[_BITS[name]])


def _quantize(G, t: torch.Tensor, type_id: int) -> torch.Tensor:
    """``t [E, R, C]`` (any float dtype) as ggml rows of ``type_id``: uint8 ``[E, R *
    row_size]``, one expert per task on torch's thread count (ctypes releases the GIL)."""
    E, R, C = t.shape
    out = torch.empty(E, R * G.ggml_row_size(type_id, C), dtype=torch.uint8)

    def one(e: int) -> None:
        src = t[e].float().contiguous()
        done = G.ggml_quantize_chunk(type_id, ctypes.cast(src.data_ptr(),
                                                          ctypes.POINTER(ctypes.c_float)),
                                     ctypes.c_void_p(out[e].data_ptr()), 0, R, C, None)
        if done != out.shape[1]:
            raise RuntimeError(f"ggml_quantize_chunk wrote {done} bytes, expected {out.shape[1]}")

    with concurrent.futures.ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(one, range(E)))
    return out


def ggml_weights(w: ExpertWeights, type_name: str) -> List[Tuple[torch.Tensor, ...]]:
    """``(gate, up, down)`` as ggml rows of ``type_name``, once per shape and scheme, in as
    many copies as cpumoe's calls cycle through."""
    G, _ = ggml_module()
    N = w.shape.N

    def make():
        w1, w2 = w.source_weights()
        t = _type_id(G, type_name)
        return _quantize(G, w1[:, :N], t), _quantize(G, w1[:, N:], t), _quantize(G, w2, t)

    first = cached(w, ("ggml", type_name), make)
    return cached(w, ("ggml", type_name, copies(w)),
                  lambda: [first] + [tuple(a.clone() for a in first)
                                     for _ in range(copies(w) - 1)])


class GgmlMoe:
    """One case's graph (fixed M and topk), its threadpool and work buffer; each call
    points the graph's leaves at the routing and at the next weight copy, runs it and
    returns the output in ``x``'s dtype. :meth:`close` frees the ggml objects."""

    def __init__(self, G, layers, type_name: str, x: torch.Tensor, topk: int, N: int,
                 threads: int):
        self.G, self.layers, self.dtype = G, layers, x.dtype
        M, K = x.shape
        self.x32 = x.float().contiguous()
        t = _type_id(G, type_name)
        leaves = G.ggml_init(G.ggml_init_params(mem_size=16 * G.ggml_tensor_overhead(),
                                                mem_buffer=None, no_alloc=True))
        E = layers[0][0].shape[0]
        self.w_gate = G.ggml_new_tensor_3d(leaves, t, K, N, E)
        self.w_up = G.ggml_new_tensor_3d(leaves, t, K, N, E)
        self.w_down = G.ggml_new_tensor_3d(leaves, t, N, K, E)
        self.x = G.ggml_new_tensor_3d(leaves, G.GGML_TYPE_F32, K, 1, M)
        self.ids = G.ggml_new_tensor_2d(leaves, G.GGML_TYPE_I32, topk, M)
        self.weights = G.ggml_new_tensor_3d(leaves, G.GGML_TYPE_F32, 1, topk, M)
        self.x.contents.data = self.x32.data_ptr()
        # the intermediates: gate, up, activation [N, topk, M]; y and y * weights
        # [K, topk, M]; topk - 1 sums [K, M]; plus the graph and per-tensor overheads
        floats = M * topk * (3 * N + 2 * K) + (topk - 1) * K * M
        size = 4 * floats + 64 * G.ggml_tensor_overhead() + G.ggml_graph_overhead() + (1 << 20)
        nodes = G.ggml_init(G.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        self.contexts = [leaves, nodes]
        gate = G.ggml_mul_mat_id(nodes, self.w_gate, self.x, self.ids)
        up = G.ggml_mul_mat_id(nodes, self.w_up, self.x, self.ids)
        if hasattr(G, "ggml_swiglu_split"):
            act = G.ggml_swiglu_split(nodes, gate, up)
        else:
            act = G.ggml_mul(nodes, G.ggml_silu(nodes, gate), up)
        y = G.ggml_mul(nodes, G.ggml_mul_mat_id(nodes, self.w_down, act, self.ids),
                       self.weights)
        nb = y.contents.nb
        out = None
        for j in range(topk):
            v = G.ggml_view_2d(nodes, y, K, M, nb[2], j * nb[1])
            out = v if out is None else G.ggml_add(nodes, out, v)
        if topk == 1:
            out = G.ggml_cont(nodes, out)
        self.graph = G.ggml_new_graph(nodes)
        G.ggml_build_forward_expand(self.graph, out)
        self.pool = G.ggml_threadpool_new(ctypes.byref(G.ggml_threadpool_params_default(threads)))
        self.plan = G.ggml_graph_plan(self.graph, threads, self.pool)
        self.work = torch.empty(max(int(self.plan.work_size), 1), dtype=torch.uint8)
        self.plan.work_data = ctypes.cast(self.work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        buf = (ctypes.c_char * (4 * K * M)).from_address(out.contents.data)
        self.out = torch.frombuffer(buf, dtype=torch.float32).view(M, K)
        self.calls = itertools.count()

    def __call__(self, r) -> torch.Tensor:
        G = self.G
        ids = r.topk_ids.to(torch.int32).contiguous()
        weights = r.topk_weights.float().contiguous()
        gate, up, down = self.layers[next(self.calls) % len(self.layers)]
        for leaf, t in ((self.w_gate, gate), (self.w_up, up), (self.w_down, down),
                        (self.ids, ids), (self.weights, weights)):
            leaf.contents.data = t.data_ptr()
        status = G.ggml_graph_compute(self.graph, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {status}")
        return self.out.to(self.dtype)

    def close(self) -> None:
        if self.pool is not None:
            self.G.ggml_threadpool_free(self.pool)
            for ctx in self.contexts:
                self.G.ggml_free(ctx)
            self.pool = None


def ggml_call(key: str):
    """The peer ``key``'s call maker: (weights, x) -> :class:`GgmlMoe` on this case."""
    def make(w: ExpertWeights, x: torch.Tensor) -> GgmlMoe:
        G, _ = ggml_module()
        name = GGML_TYPES[key][w.scheme]
        return GgmlMoe(G, ggml_weights(w, name), name, x, w.shape.topk, w.shape.N,
                       torch.get_num_threads())

    return make
