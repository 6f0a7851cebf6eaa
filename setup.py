"""Build of cpumoe: per-tier C kernels, then the PyTorch extension that links them.

The C core (csrc/kernels) is compiled here with the system C compiler, one flag
set per ISA tier, chosen by the file name suffix:

    *-scalar.c   baseline x86-64 (no flags beyond it)
    *-avx2.c     -mavx2 -mfma -mf16c
    *-avx512.c   -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni (+ avx2 flags)
    other *.c    baseline (pipeline, packers, dispatch: must run on any x86-64)

Never -march tuned to the build host: the same binary runs on any x86-64 CPU and picks its tier
at run time. torch's extension builder would give all files one flag set and
compile .c as C++, so the objects are built before it and linked in.
"""

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
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


class BuildWithKernels(BuildExtension):
    def build_extensions(self):
        cc = os.environ.get("CC", "cc")
        out_dir = Path(self.build_temp) / "kernels"
        jobs = []
        for src in kernel_sources():
            obj = out_dir / src.relative_to(KERNELS).with_suffix(".o")
            flags = BASE_CFLAGS + TIER_FLAGS[tier_of(src)]
            jobs.append((src, obj, [cc, *flags, f"-I{INCLUDE}", f"-I{KERNELS}", "-c", str(src), "-o", str(obj)]))

        def compile_one(job):
            src, obj, cmd = job
            obj.parent.mkdir(parents=True, exist_ok=True)
            deps = [src, *KERNELS.rglob("*.h"), INCLUDE / "cpumoe" / "cpumoe.h"]
            if obj.exists() and obj.stat().st_mtime >= max(d.stat().st_mtime for d in deps):
                return obj
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objects = [str(o) for o in pool.map(compile_one, jobs)]
        for ext in self.extensions:
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()


setup(
    name="cpumoe",
    version="0.1.0",
    package_dir={"": "python"},
    packages=["cpumoe"],
    ext_modules=[
        CppExtension(
            name="cpumoe._C",
            sources=["csrc/bindings/ops.cpp"],
            include_dirs=[str(INCLUDE)],
            extra_compile_args=["-O2", "-std=c++20"],
        )
    ],
    cmdclass={"build_ext": BuildWithKernels},
    python_requires=">=3.9",
)
