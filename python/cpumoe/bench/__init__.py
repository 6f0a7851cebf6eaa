"""Model-shape benchmark of ``fused_experts`` with roofline figures (``python -m cpumoe bench``).

For every (shape, weight scheme, M) case it times ``cpumoe.fused_experts`` on weights
packed once, and the PyTorch code a user would otherwise run, and reports each against
the machine limits of docs/PERFORMANCE.md, all measured in the same run:

* streaming-read bandwidth: ``_C.probe_read`` over a buffer several times the
  last-level cache (:func:`measure_read_bandwidth`), measured at the start and again
  at the end of the run;
* fp32 FMA peak of the active tier: ``_C.probe_fma``, a register-only loop on each of
  torch's threads (:func:`measure_fma_peak`); the ceiling of the fp16 rows and of the fp8
  rows with fp16 activations (both run on fp32 FMAs on every tier);
* bf16 peak of the active tier: ``_C.probe_bf16``, the loop the tier's bf16 GEMMs peak at
  (:func:`measure_bf16_peak`): AMX ``tdpbf16ps`` on the ``amx`` tier, the fp32 FMA loop
  on the tiers that widen bf16 to fp32; the ceiling of the bf16 rows and of the fp8 rows
  with bf16 activations (the amx tile GEMM takes FP8 decoded to bf16), measured only when
  one of them is benchmarked;
* u8*s8 peak of the active tier: ``_C.probe_int8``, the same kind of loop of u8*s8 dot
  products (AMX ``tdpbusd`` on amx, VNNI ``vpdpbusd`` on avx512) (:func:`measure_int8_peak`);
  the ceiling of the int8 scheme, measured only when it is benchmarked;
* u4*s8 peak of the active tier: ``_C.probe_int4``, the loop its INT4 kernels run
  (:func:`measure_int4_peak`): on avx2 ``vpmaddubsw`` of nibbles, twice the products per
  instruction of its INT8 loop; elsewhere the u8*s8 loop, the instruction INT4 runs there
  too; the ceiling of the int4 scheme, measured only when it is benchmarked.

Each row's bound is the larger of bytes / bandwidth and operations / peak (the roofline);
``%bound`` is that bound over the measured time. A row's ``peak_kind`` (``fp32_fma``,
``bf16``, ``u8s8`` or ``u4s8``) says which peak it is judged against (:meth:`Scheme.peak_kind`, by
scheme and activation dtype), and the header names the loop each peak ran on the tier
(:func:`peak_loop`). With ``--threads 1,2`` every case is also timed at the other thread
counts (limits measured at each count too).

Weight schemes (``--scheme``) are the rows of :data:`SCHEMES`: ``bf16`` / ``fp16`` (weights
and activations in that dtype), ``int8`` (INT8 W8A8), ``fp8`` (FP8 W8A16, 128x128 block
scales) and ``int4`` (INT4 W4A8, AWQ group-quantized; skipped with the reason when this
build of cpumoe rejects ``moe_comp_method=3``). Each has a weight generator that turns
random float weights into the scheme's tensors and the dequantized float weights the
eager baseline reads.

Baselines (:data:`BASELINES`): the eager per-expert loop in the activation dtype
(:func:`baseline_moe`; for quantized schemes over the dequantized weights); for int8 a
per-expert loop over ``torch._weight_int8pack_mm`` (:func:`baseline_int8pack_moe`) and for
int4 one over ``torch._weight_int4pack_mm_for_cpu`` (:func:`baseline_int4pack_moe`) where
torch has them; and, with ``--baseline-isa NAME``, the eager loop again in a subprocess
started with ``ONEDNN_MAX_CPU_ISA=NAME`` (:func:`run_capped_baseline`), e.g.
``avx512_core_vnni`` to see what the eager code does on a CPU without AVX512-BF16 and AMX.
With ``--peers``, other libraries' CPU MoE kernels that are installed (SGLang's, vLLM's,
llama.cpp's ggml, KTransformers') are timed on the same routings and threads, each checked
against cpumoe within its weight format's tolerance first (:mod:`cpumoe.bench.peers`).

Routing is decode-realistic: every timed call gets a fresh, pre-generated routing
(random distinct experts per token, softmax-normalised fp32 weights, int32 ids), and
cpumoe's calls cycle through copies of the weights, as through the layers of a model
(:func:`default_weight_layers`), so expert weights come from DRAM rather than from cache.
cpumoe and the baselines see the same routings (the subprocess regenerates them from the
seed). ``benchmarks/README.md`` describes the method and the output fields; ``--plot
FILE.png`` draws the roofline picture (:func:`write_plot`, needs matplotlib). The JSON
document (``--json``) also records what the package was built from (:func:`build_info`),
and ``python -m cpumoe bench compare A.json B.json`` sets two of them side by side
(:mod:`cpumoe.bench.compare`).

The modules, by responsibility: :mod:`~cpumoe.bench.cli` (options, entry point, the run),
:mod:`~cpumoe.bench.shapes` (model shapes, routings), :mod:`~cpumoe.bench.machine`
(machine information and limits), :mod:`~cpumoe.bench.schemes` (each scheme's tensors),
:mod:`~cpumoe.bench.baselines` (the PyTorch baselines), :mod:`~cpumoe.bench.capped` (the
eager baseline under a capped oneDNN ISA), :mod:`~cpumoe.bench.timing` (timing loops,
interleaving), :mod:`~cpumoe.bench.report` (table, JSON, picture) and
:mod:`~cpumoe.bench.compare` (two runs side by side); ``bench routing`` and ``bench linear``
are commands of their own (:mod:`~cpumoe.bench.routing`, :mod:`~cpumoe.bench.linear`: the
dense linear ops against the bandwidth, the peak and torch's and vLLM's linear ops).
The names below are re-exported here, as they were importable from the single module this
package replaced.

Importable for tests: :func:`main` (returns 0), :func:`measure_read_bandwidth`,
:func:`measure_fma_peak`, :func:`measure_bf16_peak`, :func:`measure_int8_peak`,
:func:`measure_int4_peak`,
:func:`run_case`, :func:`baseline_moe`, :func:`baseline_int8pack_moe`,
:func:`baseline_int4pack_moe`, :func:`run_capped_baseline`, :func:`machine_info`,
:func:`write_plot`. Smoke run (seconds):
``main(["--shape", "custom:8,2,256,128", "--scheme", "bf16,int8", "--m", "1,4", "--iters", "2"])``.
"""

# Names with a leading underscore are imported "as" themselves: re-exported on purpose,
# for the tests that patch or call them.
from ..ops import fused_experts
from .baselines import (
    BASELINES,
    Baseline,
    baseline_int4pack_moe,
    baseline_int8pack_moe,
    baseline_moe,
    int4pack_unavailable,
    int8pack_unavailable,
)
from .baselines import _rel_diff as _rel_diff
from .capped import run_capped_baseline
from .cli import (
    QUICK,
    add_arguments,
    build_parser,
    main,
    parse_pairs,
    parse_schemes,
    resolve_arguments,
    run,
    run_pairs,
)
from .compare import compare_documents, load_document
from .machine import (
    MAX_WEIGHT_LAYERS,
    Limits,
    OthersLoad,
    build_info,
    cpu_busy_fraction,
    cpu_model_name,
    default_read_buffer_bytes,
    default_weight_layers,
    last_level_cache_bytes,
    machine_info,
    measure_bf16_peak,
    measure_fma_peak,
    measure_int4_peak,
    measure_int8_peak,
    measure_limits,
    measure_read_bandwidth,
    peak_loop,
)
from .machine import _bf16_peak_samples as _bf16_peak_samples
from .machine import _fma_peak_samples as _fma_peak_samples
from .machine import _int4_peak_samples as _int4_peak_samples
from .machine import _int8_peak_samples as _int8_peak_samples
from .machine import _mem_available_bytes as _mem_available_bytes
from .report import (
    NOISY,
    case_others_fraction,
    format_header_row,
    format_row,
    table_columns,
    write_plot,
)
from .schemes import _INT4_REASON as _INT4_REASON
from .schemes import (
    FP8_BLOCK,
    INT4_GROUPS,
    SCHEMES,
    ExpertWeights,
    Scheme,
    SchemeWeights,
    int4_group_size,
    scheme_unavailable,
)
from .shapes import (
    ALL_M,
    DEFAULT_M,
    DEFAULT_SHAPE,
    DTYPES,
    SHAPES,
    Routing,
    Shape,
    make_routings,
    parse_shapes,
)
from .timing import run_case, run_interleaved

__all__ = [
    "ALL_M", "BASELINES", "DEFAULT_M", "DEFAULT_SHAPE", "DTYPES", "FP8_BLOCK", "INT4_GROUPS",
    "MAX_WEIGHT_LAYERS", "NOISY", "QUICK", "SCHEMES", "SHAPES", "Baseline", "ExpertWeights",
    "Limits", "OthersLoad", "Routing", "Scheme", "SchemeWeights", "Shape", "add_arguments",
    "baseline_int4pack_moe", "baseline_int8pack_moe", "baseline_moe", "build_info",
    "build_parser", "case_others_fraction", "compare_documents", "cpu_busy_fraction",
    "cpu_model_name", "default_read_buffer_bytes", "default_weight_layers",
    "format_header_row", "format_row", "fused_experts", "int4_group_size",
    "int4pack_unavailable", "int8pack_unavailable", "last_level_cache_bytes",
    "load_document", "machine_info", "main", "make_routings", "measure_bf16_peak",
    "measure_fma_peak", "measure_int4_peak", "measure_int8_peak", "measure_limits", "measure_read_bandwidth", "parse_pairs",
    "parse_schemes", "parse_shapes", "peak_loop", "resolve_arguments", "run", "run_capped_baseline",
    "run_case", "run_interleaved", "run_pairs", "scheme_unavailable", "table_columns",
    "write_plot",
]
