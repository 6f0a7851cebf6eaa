"""Build of cpumoe: per-tier C kernels, then the PyTorch extension that links them.

The C core (csrc/kernels) is compiled here with the system C compiler, one flag set per ISA
tier chosen by the file name suffix (the tables are in tools/kernel_build.py, which the
C test build shares). torch's extension builder would give all files one flag set and
compile .c as C++, so the objects are built before it and linked in.
"""

import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
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


def _command_output(cmd):
    """stdout of ``cmd`` run in the checkout, or None when it cannot run or fails."""
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


class BuildPyWithBuildInfo(build_py):
    """Also writes cpumoe/_build_info.py into the build output, never into the source tree:
    the benchmark runs from the installed package, where the checkout is out of reach, and
    records the commit, whether the tree was dirty and the C compiler the kernels got.
    Untracked files count as dirty because every csrc/kernels/**/*.c is compiled."""

    def run(self):
        super().run()
        commit = (_command_output(["git", "rev-parse", "HEAD"]) or "").strip() or "unknown"
        status = _command_output(["git", "status", "--porcelain"])
        cc = os.environ.get("CC", "cc")
        version = (_command_output([*shlex.split(cc), "--version"]) or "").strip()
        info = {"GIT_COMMIT": commit,
                "DIRTY": "unknown" if status is None else bool(status.strip()),
                "COMPILER": version.splitlines()[0] if version else "unknown", "CC": cc}
        target = Path(self.build_lib) / "cpumoe" / "_build_info.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text('"""Written by setup.py when the package was built."""\n\n'
                          + "".join(f"{k} = {v!r}\n" for k, v in info.items()))


setup(
    name="cpumoe",
    version="0.1.0",
    package_dir={"": "python"},
    packages=["cpumoe", "cpumoe.bench", "cpumoe.bench.peers", "cpumoe.distributed"],
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
                "csrc/bindings/routing.cpp",
                "csrc/bindings/linear.cpp",
                "csrc/bindings/runtime.cpp",
                "csrc/bindings/forwarding.cpp",
            ],
            include_dirs=[str(INCLUDE)],
            # -fopenmp: at::parallel_for (the runner in runtime.cpp) is an OpenMP parallel region
            # compiled into this file; without the flag it runs every worker on the calling
            # thread. The link resolves libgomp.so.1 to the copy torch has already loaded.
            extra_compile_args=["-O2", "-std=c++20", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildWithKernels,
              "build_py": BuildPyWithBuildInfo},
    python_requires=">=3.9",
)
