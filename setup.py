"""Build of cpumoe: per-tier C kernels, then the PyTorch extension that links them.

The C core (csrc/kernels) is compiled here with the system C compiler, one flag set per ISA
tier chosen by the file name suffix (the tables are in tools/kernel_build.py, which the
C test build shares). torch's extension builder would give all files one flag set and
compile .c as C++, so the objects are built before it and linked in.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from kernel_build import (  # noqa: E402
    INCLUDE,
    KERNELS,
    compile_command,
    kernel_dependencies,
    kernel_sources,
)


class BuildWithKernels(BuildExtension):
    def build_extensions(self):
        cc = os.environ.get("CC", "cc")
        out_dir = Path(self.build_temp) / "kernels"
        jobs = []
        for src in kernel_sources():
            obj = out_dir / src.relative_to(KERNELS).with_suffix(".o")
            jobs.append((src, obj, compile_command(cc, src, obj)))

        def compile_one(job):
            src, obj, cmd = job
            obj.parent.mkdir(parents=True, exist_ok=True)
            deps = kernel_dependencies(src)
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
            sources=[
                "csrc/bindings/registration.cpp",
                "csrc/bindings/checks.cpp",
                "csrc/bindings/schemes.cpp",
                "csrc/bindings/fused_experts.cpp",
                "csrc/bindings/shared_expert.cpp",
                "csrc/bindings/packers.cpp",
                "csrc/bindings/runtime.cpp",
            ],
            include_dirs=[str(INCLUDE)],
            # -fopenmp: at::parallel_for (the runner in ops.cpp) is an OpenMP parallel region
            # compiled into this file; without the flag it runs every worker on the calling
            # thread. The link resolves libgomp.so.1 to the copy torch has already loaded.
            extra_compile_args=["-O2", "-std=c++20", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildWithKernels},
    python_requires=">=3.9",
)
