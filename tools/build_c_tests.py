"""Builds the C test driver (tests/c/*.c) against the C core with AddressSanitizer and
UndefinedBehaviorSanitizer, then runs it.

Every kernel source is compiled with exactly its tier's flags, as setup.py does (both take
them from tools/kernel_build.py), plus SANITIZE; the driver sees only the public header.
Objects go to BUILD_DIR (default build/c-tests); nothing is cached. The driver runs every
tier this CPU has, natively.

--emulate builds the core for the tiers this CPU lacks (CI's AVX2-only EPYC never runs the
avx512 code otherwise): every vector tier's sources (*-avx2.c, *-avx512.c, ...) are compiled
WITHOUT their tier's ISA flags, at baseline x86-64, through SIMDe (header-only; pip install
cmeel-simde==0.8.2). tests/c/emulate/ comes first on their include path: its immintrin.h
maps the Intel intrinsics to SIMDe's portable code and adds what SIMDe 0.8.2 lacks or
rounds differently. Those objects also get -DCM_PORTABLE_INTRINSICS, which swaps the two
inline-asm sites SIMDe cannot run (fp8's vcvtph2ps from memory, the probes' register
barriers) for intrinsics; every object and the driver get -DCPUMOE_EMULATE_TIERS, with which
the dispatcher treats every built tier as supported and cpumoe_isa_native() tells which the
CPU runs itself. Sanitizers stay on. The driver then runs the tiers the CPU lacks (none on a
CPU with every tier: pass --emulate-all to run every vector tier emulated), and
tests/c/emulate/test_shim.c checks the shim against Intel's semantics (and, on a CPU with
AVX-512, those statements against the hardware). Objects go to build/c-tests-emulate.
Measured on a 2-core AVX-512 machine shared with other jobs: the build takes 80-90 s of CPU,
the run with --emulate-all 30 s (of which the probes' 12e6-iteration int8 loop is most), so
the driver runs its usual problem sizes.

Without --emulate it also builds and runs tests/c/emulate/test_bf16_amx_conformance.c, which
holds the bf16 and AMX models (tests/c/emulate/bf16_amx_model.h, what the emulated avx512bf16
and amx tiers run on) to the instructions bit for bit where the CPU has them (AVX512_BF16,
AMX), and says what it skipped elsewhere; the models' fault checks run everywhere.

Usage: python tools/build_c_tests.py [--emulate] [--build-dir DIR] [--no-run]
           [--emulate-all] [SECTION] [-v]
tests/c/kernels/*.c are tests of single kernels, each its own program linked with the
core's objects (native or emulated, as built): e.g. the avx512bf16 kernels bit for bit
against fmaf chains and the vdpbf16ps model.

Exit status: the driver's (1 when a check failed; a sanitizer report aborts it), or the shim
test's, the conformance test's or a kernel test's when that failed.
"""

import argparse
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernel_build import (
    BASE_CFLAGS,
    INCLUDE,
    KERNELS,
    ROOT,
    TIER_FLAGS,
    compile_command,
    kernel_sources,
    tier_of,
)

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O1",
            "-DCPUMOE_CHECK_PRECONDITIONS",
            "-fno-omit-frame-pointer"]
DRIVER_SOURCES = sorted((ROOT / "tests" / "c").glob("*.c"))
EMULATE_DIR = ROOT / "tests" / "c" / "emulate"
CONFORMANCE_SOURCE = EMULATE_DIR / "test_bf16_amx_conformance.c"
# Tests of single kernels, each its own program linked with the core's objects.
KERNEL_TEST_SOURCES = sorted((ROOT / "tests" / "c" / "kernels").glob("*.c"))
EMULATE_DEFINE = "-DCPUMOE_EMULATE_TIERS"
# Emulated objects only: -Wno-psabi, since passing a 32/64-byte vector without AVX changes
# the calling convention, which gcc notes once per function; every object of this build is
# compiled the same way, so the note says nothing.
EMULATE_FLAGS = [EMULATE_DEFINE, "-DCM_PORTABLE_INTRINSICS", "-Wno-psabi"]
SIMDE_HINT = "pip install cmeel-simde==0.8.2"


def simde_include_dir():
    """The directory holding simde/x86/avx512.h: from the cmeel-simde distribution's file
    list, else from a cmeel.prefix/include next to any sys.path entry; None if absent."""
    try:
        dist = importlib.metadata.distribution("cmeel-simde")
        for f in dist.files or []:
            if f.as_posix().endswith("include/simde/x86/avx512.h"):
                return Path(dist.locate_file(f)).parents[2]
    except importlib.metadata.PackageNotFoundError:
        pass
    roots = [*sys.path, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    for root in roots:
        candidate = Path(root or ".") / "cmeel.prefix" / "include"
        if (candidate / "simde" / "x86" / "avx512.h").is_file():
            return candidate
    return None


def compile_jobs(cc, out, emulate, simde):
    """(object, command) for every kernel source and driver source."""
    jobs = []
    for src in kernel_sources():
        obj = out / "core" / src.relative_to(KERNELS).with_suffix(".o")
        if emulate and tier_of(src) != "scalar":
            cmd = [cc, *BASE_CFLAGS, *TIER_FLAGS["scalar"], *SANITIZE, *EMULATE_FLAGS,
                   f"-I{EMULATE_DIR}", "-isystem", str(simde), f"-I{INCLUDE}", f"-I{KERNELS}",
                   "-c", str(src), "-o", str(obj)]
        else:
            cmd = compile_command(cc, src, obj, SANITIZE + ([EMULATE_DEFINE] if emulate else []))
        jobs.append((obj, cmd))
    for src in DRIVER_SOURCES:  # baseline flags, public header only
        obj = out / "tests" / src.with_suffix(".o").name
        jobs.append((obj, [cc, *BASE_CFLAGS, *SANITIZE, *([EMULATE_DEFINE] if emulate else []),
                           f"-I{INCLUDE}", "-c", str(src), "-o", str(obj)]))
    return jobs


def shim_test_commands(cc, out, simde):
    """The shim test twice: through the shim (as the emulated kernels see the intrinsics),
    and against the compiler's own <immintrin.h>, at baseline flags: its test functions name
    their ISA in a target attribute and run only where the CPU has it."""
    src = EMULATE_DIR / "test_shim.c"
    builds = []
    for name, flags in (("test_shim_emulated", [*EMULATE_FLAGS, f"-I{EMULATE_DIR}", "-isystem",
                                                 str(simde)]),
                        ("test_shim_native", [])):
        exe = out / name
        builds.append((exe, [cc, *BASE_CFLAGS, *flags, *SANITIZE, f"-I{KERNELS}", str(src),
                             "-o", str(exe), "-lm"]))
    return builds


def conformance_test_command(cc, out):
    """The bf16/AMX conformance program, at baseline flags: its functions that run the
    instructions name them in a target attribute and run only where the CPU has them."""
    exe = out / "test_bf16_amx_conformance"
    return exe, [cc, *BASE_CFLAGS, *SANITIZE, f"-I{KERNELS}", str(CONFORMANCE_SOURCE), "-o",
                 str(exe), "-lm"]


def run_compiles(jobs):
    def compile_one(job):
        obj, cmd = job
        obj.parent.mkdir(parents=True, exist_ok=True)
        return subprocess.run(cmd, capture_output=True, text=True), cmd

    failed = False
    with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 2, 2)) as pool:
        for result, cmd in pool.map(compile_one, jobs):
            if result.returncode != 0 or result.stderr:
                print(" ".join(cmd), result.stdout, result.stderr, sep="\n", file=sys.stderr)
            failed |= result.returncode != 0
    return not failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emulate", action="store_true",
                        help="vector tiers through SIMDe, run the tiers this CPU lacks")
    parser.add_argument("--build-dir", type=Path)
    parser.add_argument("--no-run", action="store_true", help="build only")
    # the rest goes to the driver (a section, -v, --emulate-all)
    args, driver_args = parser.parse_known_args()
    cc = os.environ.get("CC", "cc")
    out = args.build_dir or ROOT / "build" / ("c-tests-emulate" if args.emulate else "c-tests")

    simde = None
    if args.emulate:
        simde = simde_include_dir()
        if simde is None:
            print(f"build_c_tests: SIMDe headers not found ({SIMDE_HINT})", file=sys.stderr)
            return 2
    jobs = compile_jobs(cc, out, args.emulate, simde)
    shim_tests = shim_test_commands(cc, out, simde) if args.emulate else []
    if not args.emulate:  # a native test: the same program in both builds would run twice
        shim_tests.append(conformance_test_command(cc, out))
    if not run_compiles(jobs + shim_tests):
        return 2
    exe = out / "test_cpumoe"
    subprocess.run([cc, *SANITIZE, *(str(obj) for obj, _ in jobs), "-o", str(exe), "-lpthread",
                    "-lm"], check=True)
    core_objects = [str(obj) for obj, _ in jobs if "core" in obj.parts]
    for src in KERNEL_TEST_SOURCES:  # baseline flags: the kernels come from the core objects
        kernel_exe = out / src.stem
        subprocess.run([cc, *BASE_CFLAGS, *SANITIZE,
                        *([EMULATE_DEFINE] if args.emulate else []), f"-I{INCLUDE}",
                        f"-I{KERNELS}", f"-I{ROOT / 'tests' / 'c'}", str(src), *core_objects,
                        "-o", str(kernel_exe), "-lpthread", "-lm"], check=True)
        shim_tests.append((kernel_exe, None))
    if args.no_run:
        return 0
    env = dict(os.environ)
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    shim_status = 0
    for shim_exe, _ in shim_tests:
        shim_status |= subprocess.run([str(shim_exe)], env=env).returncode
    status = subprocess.run([str(exe), *driver_args], env=env).returncode
    return status or shim_status


if __name__ == "__main__":
    sys.exit(main())
