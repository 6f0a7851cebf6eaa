"""What every peer shares: the weight format a peer runs for a row (:class:`PeerFormat`),
the agreement tolerances by bits per weight, finding an installed package without
importing it, silencing a library's own ``printf``, and the weight copies a peer cycles
through (as cpumoe's calls do)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..schemes import ExpertWeights

# Largest relative difference (Frobenius norm) a peer's output may have from cpumoe's on the
# same inputs and routing before it is timed, by how the peer stores its weights. A wrong
# call (a layout, argument or expert-order mismatch, gate and up swapped) is off by O(1):
# about 1.4 for two unrelated outputs of equal norm.
#
# * 16-bit weights (bf16/fp16, or cpumoe's own packed weights: SGLang): both sides round
#   the intermediate to 16 bits and the output once; measured 2e-3 to 1.2e-2 (int4 on the
#   same packed weights), so 0.05.
PEER_AGREEMENT = 0.05
# * 8-bit weights quantized by the peer (ggml's / KTransformers' Q8_0, blocks of 32): cpumoe's
#   per-channel int8 (~1 %) and the peer's Q8_0 weights and Q8_0 activations (ggml
#   quantizes the activations of both GEMMs to Q8_0 for its dot products, ~1.5 % alone) are
#   independent errors; measured 2-3 %, so 0.08.
# * 4-bit weights quantized by the peer (Q4_0, Q4_K, symmetric GPTQ int4) against cpumoe's
#   AWQ int4: each is 12-20 % from the float layer by itself (4 bits on normal weights:
#   step ~0.3 sigma), independently, so their difference is ~20-30 %; 0.5 still rejects a
#   wrong call (~1.4).
AGREEMENT_BY_BITS = {16: PEER_AGREEMENT, 8: 0.08, 4: 0.5}


@dataclass(frozen=True)
class PeerFormat:
    """How a peer stores one row's weights: ``name`` (e.g. ``"Q4_K"``), the bytes it reads
    per weight (scales included; the issue's rule compares cpumoe with the fastest peer
    that stores as many bytes per weight or more), the agreement ``tolerance``, and what
    runs (``detail``: a kernel class, an ISA)."""

    name: str
    bytes_per_weight: float
    tolerance: float
    detail: str = ""


def package_dir(name: str) -> Optional[str]:
    """The directory of an installed package, found without importing it (importing vllm
    would pull in its whole serving stack), or None."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


# ``--peer-isa``: the peers pick their builds as on a CPU with no more than these instruction
# sets, so that they can be compared with cpumoe capped the same way (``CPUMOE_ISA``) on a
# bigger CPU: "avx2" (an AVX2-only CPU such as AMD Zen 3: no AVX-512, AVX-VNNI or AMX) or
# "avx512" (a Cascade Lake: AVX-512 F/BW/VL/DQ/CD and VNNI, nothing newer). None: this CPU.
PEER_ISAS = ("avx2", "avx512")
_CASCADE_LAKE_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni",
                        "avx512vnni"}
_peer_isa: Optional[str] = None


def set_peer_isa(name: Optional[str]) -> None:
    """Caps the peers' CPU at ``name`` (one of :data:`PEER_ISAS`, or None for none). Call it
    before any peer loads: each library is loaded once per process."""
    global _peer_isa
    if name is not None and name not in PEER_ISAS:
        raise ValueError(f"peer ISA {name!r}: expected one of {', '.join(PEER_ISAS)}")
    _peer_isa = name


def peer_isa() -> Optional[str]:
    return _peer_isa


def peer_isa_note() -> str:
    """" with --peer-isa NAME" under a cap, else "": for the peers' messages."""
    return f" with --peer-isa {_peer_isa}" if _peer_isa else ""


def capped_flags(flags) -> set:
    """``flags`` (``/proc/cpuinfo``'s names or :func:`cpumoe.cpu_features`') without those
    above the ``--peer-isa`` cap."""
    if _peer_isa is None:
        return set(flags)
    kept_avx512 = _CASCADE_LAKE_AVX512 if _peer_isa == "avx512" else set()

    def above(flag: str) -> bool:
        flag = flag.lower()
        return (flag.startswith("amx") or flag in ("avx_vnni", "avxvnni", "avx-vnni")
                or (flag.startswith("avx512") and flag not in kept_avx512))

    return {f for f in flags if not above(f)}


def cpu_flags() -> set:
    """The kernel's feature flags of the first CPU (``/proc/cpuinfo``), which is how the
    peers' own loaders pick their builds, less those above ``--peer-isa``; empty where it
    cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return capped_flags(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@contextlib.contextmanager
def quiet_stdout():
    """Sends file descriptor 1 to /dev/null for the duration: KTransformers' C++ prints to
    stdout as it builds and frees its objects, which would land in the bench's table. C's
    buffered stdout is flushed before the descriptor comes back."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def copies(w: ExpertWeights) -> int:
    """How many copies of the weights cpumoe's calls cycle through for this case (so that a
    peer reads its weights from DRAM as often as cpumoe does)."""
    return max(1, len(w.made_layers()))


def cached(w: ExpertWeights, key: tuple, make):
    """``w.peer_data[key]``, made by ``make()`` the first time: a peer's form of the weights
    is made once per shape and scheme and freed with them, not once per M."""
    if key not in w.peer_data:
        w.peer_data[key] = make()
    return w.peer_data[key]
