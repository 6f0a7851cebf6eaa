"""How the C core (csrc/kernels) is compiled: its sources and the flags of each ISA tier.

Shared by setup.py (kernel objects of the extension) and tools/build_c_tests.py (the same
objects with sanitizers, for the C test driver), so that both compile every file with
exactly its tier's flags. The tier is chosen by the file name suffix:

    *-scalar.c   baseline x86-64 (no flags beyond it)
    *-avx2.c     -mavx2 -mfma -mf16c
    *-avx512.c   -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni (+ avx2 flags)
    other *.c    baseline (pipeline, packers, dispatch: must run on any x86-64)

Never -march tuned to the build host: the same binary runs on any x86-64 CPU and picks its
tier at run time.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "csrc" / "kernels"
INCLUDE = ROOT / "csrc" / "include"

BASE_CFLAGS = [
    "-std=c11", "-O3", "-fPIC", "-fvisibility=hidden",
    # Every tier must give the same bits: no silent FMA contraction, fmaf where meant.
    "-ffp-contract=off", "-fno-math-errno",
    "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
    "-march=x86-64", "-mtune=generic",
]
TIER_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mavx512vnni", "-mprefer-vector-width=512"],
}


def tier_of(path: Path) -> str:
    stem = path.stem
    for tier in ("avx512", "avx2", "scalar"):
        if stem.endswith("-" + tier):
            return tier
    return "scalar"


def kernel_sources():
    return sorted(KERNELS.rglob("*.c"))


def kernel_dependencies(src: Path):
    """Files whose change makes the object of `src` stale."""
    return [src, *KERNELS.rglob("*.h"), INCLUDE / "cpumoe" / "cpumoe.h"]


def compile_command(cc: str, src: Path, obj: Path, extra_flags=()):
    """The command that compiles one kernel source with its tier's flags; `extra_flags`
    come after them (so e.g. -O1 overrides -O3)."""
    flags = BASE_CFLAGS + TIER_FLAGS[tier_of(src)] + list(extra_flags)
    return [cc, *flags, f"-I{INCLUDE}", f"-I{KERNELS}", "-c", str(src), "-o", str(obj)]
