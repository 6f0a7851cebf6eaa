"""KTransformers' CPU MoE kernels (PyPI ``kt-kernel``). Its extension modules do not link
libtorch; the build for this CPU (``kt_kernel/_kt_kernel_ext_<variant>.*.so``, picked from
``/proc/cpuinfo`` by the same ladder as kt-kernel's own loader) is imported directly, so
the Python package and its dependencies are not needed.

Objects: a worker pool ``CPUInfer(WorkerPoolConfig)`` (one subpool of n threads), a
``MOEConfig(E, topk, K, N, gpu_experts_mask)`` with ``pool``, ``max_len`` and the weights,
then ``<class>(config)``, ``load_weights_task(expert map int64 [E])`` (it copies the weights
into its own buffers) and, per call, ``forward_task(&qlen int32, topk, ids int64, weights
fp32, x bf16, out bf16, False)``, each submitted to the pool and waited for with ``sync``.
Activations are bf16 only. Weights, by row and peer:

* ``kt``: bf16 rows -> ``AMXBF16_MOE`` where the build has it (AMX CPUs), else
  ``AVX2BF16_MOE`` (the choice kt-kernel's own wrapper makes), fed per-expert pointers into
  cpumoe's ``w1``/``w2``; int8 rows -> the llamafile ``MOE`` on Q8_0, int4 rows -> on Q4_0
  (ggml block formats made with the extension's ``utils.from_float`` from the float weights
  cpumoe's scheme was made from; N must be a multiple of 256 there).
* ``kt_gptq``: int4 rows -> symmetric GPTQ int4 (``qweight [K/8, N]`` int32, 8 nibbles along
  K, value ``(q - 8) * scale``, fp32 ``scales [K/group, N]``, cpumoe's int4 group size),
  run by the class kt-kernel selects: ``AVXVNNI256GPTQInt4Packed_MOE`` on CPUs with
  AVX-VNNI, else ``AVXVNNI256GPTQInt4_MOE``, else ``AVX2GPTQInt4_MOE``.

Its workers spin-wait between jobs, so on a machine with few cores a pool as large as
torch's thread count can lose to a smaller one: each case is timed with 1 worker thread and
with torch's count, and the faster is reported (both are in the record's
``<peer>_variants``). The objects print to stdout as they are made and freed; that is sent
to /dev/null.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import itertools
import os
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch

from .common import (
    AGREEMENT_BY_BITS,
    PeerFormat,
    cached,
    copies,
    cpu_flags,
    package_dir,
    quiet_stdout,
)

if TYPE_CHECKING:
    from ..schemes import ExpertWeights

KT_INSTALL = "pip install --no-deps kt-kernel==0.7.2"

# kt-kernel's builds, best first, with the CPU flags each needs (as its own loader checks).
_VARIANTS = (
    ("amx", {"amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw", "avx512_vnni",
             "avx512_vbmi", "avx512_bf16"}),
    ("avx512_bf16", {"avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi", "avx512_bf16"}),
    ("avx512_vbmi", {"avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi"}),
    ("avx512_vnni", {"avx512f", "avx512bw", "avx512_vnni"}),
    ("avx512_base", {"avx512f", "avx512bw"}),
    ("avx2", {"avx2"}),
)
_LLAMAFILE_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}
QK_K = 256  # the llamafile MOE splits N into blocks of this many


@functools.lru_cache(maxsize=None)
def kt_module() -> Tuple[Optional[object], Optional[str]]:
    """``(kt-kernel's extension module for this CPU, None)``, or ``(None, why not)``."""
    root = package_dir("kt_kernel")
    if root is None:
        return None, f"kt-kernel is not installed ({KT_INSTALL})"
    flags = cpu_flags()
    for variant, needs in _VARIANTS:
        if not needs <= flags:
            continue
        found = glob.glob(os.path.join(root, f"_kt_kernel_ext_{variant}.*.so"))
        if not found:
            continue
        flushing = _flushes_denormals()
        try:
            spec = importlib.util.spec_from_file_location("kt_kernel_ext", found[0])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as e:
            return None, f"loading {found[0]} failed: {str(e).splitlines()[0]}"
        finally:
            # the library is built with fast-math: loading it turns on flush-to-zero and
            # denormals-are-zero in this thread, which would change cpumoe's results
            # (and torch's) for the rest of the process
            if _flushes_denormals() != flushing:
                torch.set_flush_denormal(flushing)
        module.cpumoe_variant = variant
        return module, None
    return None, f"kt-kernel has no build for this CPU in {root} (it needs at least AVX2)"


def _flushes_denormals() -> bool:
    return float((torch.tensor([1e-40], dtype=torch.float32) * 1.0).item()) == 0.0


def kt_unavailable(dtype: torch.dtype) -> Optional[str]:
    if dtype != torch.bfloat16:
        return "KTransformers' kernels take bf16 activations only"
    return kt_module()[1]


def _gptq_class(kt) -> Tuple[Optional[str], float]:
    """The GPTQ int4 class kt-kernel would pick here, and its bytes per weight before
    scales (the unpacked AVX-VNNI class keeps an int8 copy of the weights)."""
    vnni = "avx_vnni" in cpu_flags()
    for name, packed, needs_vnni in (("AVXVNNI256GPTQInt4Packed_MOE", True, True),
                                     ("AVXVNNI256GPTQInt4_MOE", False, True),
                                     ("AVX2GPTQInt4_MOE", True, False)):
        if hasattr(kt.moe, name) and (vnni or not needs_vnni):
            return name, 0.5 if packed else 1.0
    return None, 0.0


def kt_format(key: str, w: ExpertWeights) -> Union[PeerFormat, str]:
    kt, _ = kt_module()
    N = w.shape.N
    if key == "kt_gptq":
        if w.scheme != "int4":
            return "KTransformers' GPTQ int4 kernels run int4 rows only"
        name, per_weight = _gptq_class(kt)
        if name is None:
            return f"this kt-kernel build ({kt.cpumoe_variant}) has no GPTQ int4 class"
        gs = _group_size(w)
        return PeerFormat("GPTQ int4 sym", per_weight + 4 / gs, AGREEMENT_BY_BITS[4],
                          f"{name}, group {gs}")
    if w.scheme == "bf16":
        name = "AMXBF16_MOE" if hasattr(kt.moe, "AMXBF16_MOE") else "AVX2BF16_MOE"
        return PeerFormat("bf16", 2.0, AGREEMENT_BY_BITS[16], name)
    if w.scheme in _LLAMAFILE_TYPES:
        if N % QK_K:
            return f"the llamafile MOE needs N a multiple of {QK_K}"
        t = _LLAMAFILE_TYPES[w.scheme]
        per_weight = 34 / 32 if t == "Q8_0" else 18 / 32
        tol = AGREEMENT_BY_BITS[8 if t == "Q8_0" else 4]
        return PeerFormat(t, per_weight, tol, "MOE (llamafile)")
    return f"no KTransformers kernel is mapped to {w.scheme} rows (bf16, int8, int4)"


def _group_size(w: ExpertWeights) -> int:
    """cpumoe's int4 group size for this shape (schemes imports the peers: imported here)."""
    from ..schemes import int4_group_size

    return int4_group_size(w.shape.K, w.shape.N)


def _from_float(kt, t: torch.Tensor, type_name: str) -> torch.Tensor:
    """``t [E, R, C]`` as ggml blocks of ``type_name`` made by kt-kernel: uint8 ``[E, ...]``."""
    kind = getattr(kt.kvcache.ggml_type, type_name)
    rows = []
    for e in range(t.shape[0]):
        src = t[e].float().contiguous()
        rows.append(kt.utils.from_float(src.data_ptr(), src.numel(), kind))
    return torch.stack(rows)


def gptq_symmetric(w: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [OC, IC]`` as symmetric GPTQ int4: ``qweight [IC/8, OC]`` int32 (the 8 nibbles of
    an int32 are 8 consecutive input channels, lowest first) and fp32 ``scales [IC/group,
    OC]``, value ``(q - 8) * scale``. Per group the scale maps the value of largest
    magnitude to -8 (all 16 levels used), as ggml's Q4_0 does."""
    OC, IC = w.shape
    g = w.float().view(OC, IC // group, group)
    idx = g.abs().argmax(-1, keepdim=True)
    scale = g.gather(-1, idx) / -8
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = ((g / scale).round() + 8).clamp(0, 15).to(torch.int32).view(OC, IC)
    q = q.t().contiguous().view(IC // 8, 8, OC)
    packed = torch.zeros(IC // 8, OC, dtype=torch.int32)
    for j in range(8):
        packed |= q[:, j] << (4 * j)
    return packed, scale.squeeze(-1).t().contiguous()


def _sources(kt, key: str, w: ExpertWeights) -> Dict[str, object]:
    """What :func:`_configure` hands the kernels (they copy it at load): made once per shape
    and scheme."""
    N = w.shape.N
    if key == "kt_gptq":
        def make():
            w1, w2 = w.source_weights()
            gs = _group_size(w)
            parts = {name: [gptq_symmetric(t[e], gs) for e in range(t.shape[0])]
                     for name, t in (("gate", w1[:, :N]), ("up", w1[:, N:]), ("down", w2))}
            return {"per_expert": parts, "group": gs}
        return cached(w, ("kt", "gptq"), make)
    if w.scheme == "bf16":
        return {"bf16": (w.w1, w.w2)}
    t = _LLAMAFILE_TYPES[w.scheme]

    def quantize():
        w1, w2 = w.source_weights()
        return {"blocks": tuple(_from_float(kt, a, t) for a in (w1[:, :N], w1[:, N:], w2)),
                "type": t}

    return cached(w, ("kt", t), quantize)


def _configure(kt, key: str, w: ExpertWeights, src: Dict[str, object], pool, mask, M: int):
    """A loaded kernel object for one weight copy on ``pool``."""
    E, N = w.shape.E, w.shape.N
    c = kt.moe.MOEConfig(E, w.shape.topk, w.shape.K, N, mask.data_ptr())
    c.layer_idx = 0
    c.pool = pool.backend_
    c.max_len = max(M, 1)
    if "bf16" in src:
        w1, w2 = src["bf16"]
        c.gate_projs = [[w1[e, :N].data_ptr() for e in range(E)]]
        c.up_projs = [[w1[e, N:].data_ptr() for e in range(E)]]
        c.down_projs = [[w2[e].data_ptr() for e in range(E)]]
        c.gate_scales = c.up_scales = c.down_scales = [[0] * E]
        cls = getattr(kt.moe, kt_format(key, w).detail)
    elif "per_expert" in src:
        parts = src["per_expert"]
        c.gate_projs = [[q.data_ptr() for q, _ in parts["gate"]]]
        c.up_projs = [[q.data_ptr() for q, _ in parts["up"]]]
        c.down_projs = [[q.data_ptr() for q, _ in parts["down"]]]
        c.gate_scales = [[s.data_ptr() for _, s in parts["gate"]]]
        c.up_scales = [[s.data_ptr() for _, s in parts["up"]]]
        c.down_scales = [[s.data_ptr() for _, s in parts["down"]]]
        c.quant_config.bits = 4
        c.quant_config.group_size = src["group"]
        c.quant_config.zero_point = False
        cls = getattr(kt.moe, _gptq_class(kt)[0])
    else:
        gate, up, down = src["blocks"]
        kind = getattr(kt.kvcache.ggml_type, src["type"])
        c.gate_proj, c.up_proj, c.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        c.gate_type = c.up_type = c.down_type = kind
        c.hidden_type = kt.kvcache.ggml_type.BF16
        c.m_block = 32
        c.group_min_len = 10
        c.group_max_len = max(M, 1)
        cls = kt.moe.MOE
    moe = cls(c)
    expert_map = torch.arange(E, dtype=torch.int64)
    pool.submit(moe.load_weights_task(expert_map.data_ptr()))
    pool.sync()
    return moe


def _own_copy(src: Dict[str, object], i: int) -> Dict[str, object]:
    """The GPTQ sources of weight copy ``i``: cloned past the first, since its packed class
    may read them in place rather than copy them at load (the bf16 and llamafile classes
    copy). The clones live as long as the kernel objects (:class:`KtMoe` keeps them)."""
    if i == 0 or "per_expert" not in src:
        return src
    parts = {name: [(q.clone(), s.clone()) for q, s in pairs]
             for name, pairs in src["per_expert"].items()}
    return {"per_expert": parts, "group": src["group"]}


class KtMoe:
    """One case's kernel objects on a pool of ``threads`` workers, one per weight copy cpumoe
    cycles through; made at the first call (so that a case builds one pool at a time),
    freed by :meth:`close`."""

    def __init__(self, key: str, w: ExpertWeights, x: torch.Tensor, threads: int):
        self.key, self.w, self.x, self.threads = key, w, x.contiguous(), threads
        self.M, self.K = x.shape
        self.qlen = torch.tensor([self.M], dtype=torch.int32)
        self.mask = torch.zeros(w.shape.E, dtype=torch.bool)  # no expert is on a GPU
        self.pool = None
        self.layers: List[object] = []
        self.sources: List[Dict[str, object]] = []
        self.calls = itertools.count()

    def _build(self) -> None:
        kt, _ = kt_module()
        src = _sources(kt, self.key, self.w)
        with quiet_stdout():
            config = kt.WorkerPoolConfig()
            config.subpool_count = 1
            config.subpool_numa_map = [0]
            config.subpool_thread_count = [self.threads]
            self.pool = kt.CPUInfer(config)
            for i in range(copies(self.w)):
                own = _own_copy(src, i)
                self.sources.append(own)  # lives as long as the objects that may read it
                self.layers.append(_configure(kt, self.key, self.w, own, self.pool, self.mask,
                                              self.M))

    def __call__(self, r) -> torch.Tensor:
        if self.pool is None:
            self._build()
        moe = self.layers[next(self.calls) % len(self.layers)]
        ids = r.topk_ids.to(torch.int64).contiguous()
        weights = r.topk_weights.float().contiguous()
        out = torch.empty(self.M, self.K, dtype=torch.bfloat16)
        self.pool.submit(moe.forward_task(self.qlen.data_ptr(), ids.shape[1], ids.data_ptr(),
                                          weights.data_ptr(), self.x.data_ptr(),
                                          out.data_ptr(), False))
        self.pool.sync()
        return out

    def close(self) -> None:
        if self.pool is not None:
            with quiet_stdout():
                self.layers = []
                self.pool = None
            self.sources = []


def kt_call(key: str):
    """The peer ``key``'s call maker: (weights, x) -> ``{label: call}``, one call per worker
    count (1 and torch's thread count); the faster is reported."""
    def make(w: ExpertWeights, x: torch.Tensor):
        counts = sorted({1, torch.get_num_threads()})
        return {f"{n} thread{'s' if n > 1 else ''}": KtMoe(key, w, x, n) for n in counts}

    return make
