"""cpumoe: fused Mixture-of-Experts operators for x86 CPUs.

Importing the package registers the ops under ``torch.ops.cpumoe``:

* ``fused_experts_cpu`` (SGLang's 13-argument schema; ``.bias`` overload with the
  17-argument schema: biases, GPT-OSS ``alpha``/``limit`` or DeepSeek-V4's ``limit`` alone;
  ``.activation`` with the 18-argument one; ``.out``, vLLM's out-variant),
* ``fused_experts_fp32_cpu`` (cpumoe only: the float32 sum before the one rounding, for
  expert parallelism: :mod:`cpumoe.distributed`),
* ``shared_expert_cpu`` (and ``.mxfp4``, SGLang's newer schema: ``use_mxfp4``,
  ``alpha``/``limit``),
* ``convert_weight_packed``, ``convert_scale_packed`` (MXFP4 scales),
  ``convert_weight_packed_scale_zp``,
* the dense linear ops on the same kernels: ``weight_packed_linear``,
  ``int8_scaled_mm_with_quant``, ``fp8_scaled_mm_cpu``, ``int4_scaled_mm_cpu``,
* the routing before the experts: ``topk_softmax_cpu``, ``topk_sigmoid_cpu``,
  ``grouped_topk_cpu``, ``biased_grouped_topk_cpu`` (SGLang's schemas),
  ``biased_topk_cpu`` (vLLM's) and ``hash_topk_cpu`` (both's),

and typed wrappers with the same names in lower case, without ``_cpu``, live here
(:func:`fused_experts`, :func:`shared_expert`, :func:`convert_weight_packed`,
:func:`topk_softmax`, :func:`biased_grouped_topk`, ...).
The kernels pick the best ISA tier of the CPU once at import; ``CPUMOE_ISA``
caps it, :func:`isa` says which tier runs.

``import cpumoe.sglang`` and ``import cpumoe.vllm`` register the same ops under SGLang's
(``torch.ops.sgl_kernel``) and vLLM's (``torch.ops._C``) namespaces where those libraries
have not (docs/SGLANG.md).
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import (
    _C,  # noqa: F401  (registers torch.ops.cpumoe.*)
    _fake,  # noqa: F401  (meta kernels for torch.compile)
    quant,  # noqa: F401  (quantization helpers: cpumoe.quant)
    reference,  # noqa: F401  (the executable spec: cpumoe.reference)
)
from .ops import (
    MoeCompMethod,
    biased_grouped_topk,
    biased_topk,
    convert_scale_packed,
    convert_weight_packed,
    convert_weight_packed_scale_zp,
    fp8_scaled_mm,
    fused_experts,
    fused_experts_fp32,
    fused_experts_into,
    grouped_topk,
    hash_topk,
    int4_scaled_mm,
    int8_scaled_mm_with_quant,
    shared_expert,
    topk_sigmoid,
    topk_softmax,
    weight_packed_linear,
)

__version__ = "0.1.0"

__all__ = [
    "MoeCompMethod",
    "best_isa",
    "biased_grouped_topk",
    "biased_topk",
    "built_isas",
    "supported_isas",
    "convert_scale_packed",
    "convert_weight_packed",
    "convert_weight_packed_scale_zp",
    "cpu_features",
    "fp8_scaled_mm",
    "fused_experts",
    "fused_experts_fp32",
    "fused_experts_into",
    "grouped_topk",
    "hash_topk",
    "int4_scaled_mm",
    "int8_scaled_mm_with_quant",
    "isa",
    "isa_reason",
    "numerics_class",
    "set_isa",
    "shared_expert",
    "topk_sigmoid",
    "topk_softmax",
    "weight_packed_linear",
]


def isa() -> str:
    """Name of the ISA tier the ops run on: one of cpumoe.built_isas(), e.g. 'scalar', 'avx2',
    'avx2vnni', 'avx512', 'avx512bf16' or 'amx'."""
    return _C.active_isa()


def best_isa() -> str:
    """Best tier this CPU (and this build) supports, ignoring any cap."""
    return _C.best_isa()


def set_isa(name: str) -> None:
    """Caps the active tier at ``name`` (for tests and bug reports); a tier this CPU cannot
    run falls back to its nearest ancestor it can (the tiers form a tree: avx2vnni and avx512
    both build on avx2; docs/KERNELS.md). Same effect as ``CPUMOE_ISA``."""
    _C.set_isa(name)


def isa_reason() -> str:
    """Why the active tier was chosen, e.g. 'avx2 (capped by CPUMOE_ISA=avx2; ...)'."""
    return _C.isa_reason()


def cpu_features() -> list:
    """CPU features found by cpuid/xgetbv that matter to cpumoe."""
    return _C.cpu_features().split()


def built_isas() -> list:
    """Tiers compiled into this build, worst first (rank order: the best tier a CPU
    supports is the last of these it can run)."""
    return list(_C.built_isas())


def supported_isas() -> list:
    """The built tiers this CPU can run, worst first."""
    return list(_C.supported_isas())


def numerics_class(tier: str) -> str:
    """Numerics class of a tier's results, e.g. 'fp32-chain'. Tiers of one class give
    bit-identical outputs; across classes they agree within the tolerance of
    docs/NUMERICS.md."""
    return _C.numerics_class(tier)
