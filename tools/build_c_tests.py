"""Builds the C test driver (tests/c/*.c) against the C core with AddressSanitizer and
UndefinedBehaviorSanitizer, then runs it.

Every kernel source is compiled with exactly its tier's flags, as setup.py does (both take
them from tools/kernel_build.py), plus SANITIZE; the driver sees only the public header.
Objects go to BUILD_DIR (default build/c-tests); nothing is cached.

Usage: python tools/build_c_tests.py [--build-dir DIR] [--no-run] [SECTION] [-v]
Exit status: the driver's (1 when a check failed; a sanitizer report aborts it).
"""

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernel_build import BASE_CFLAGS, INCLUDE, KERNELS, ROOT, compile_command, kernel_sources

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O1",
            "-DCPUMOE_CHECK_PRECONDITIONS",
            "-fno-omit-frame-pointer"]
DRIVER_SOURCES = sorted((ROOT / "tests" / "c").glob("*.c"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "c-tests")
    parser.add_argument("--no-run", action="store_true", help="build only")
    args, driver_args = parser.parse_known_args()  # the rest goes to the driver (a section, -v)
    cc = os.environ.get("CC", "cc")
    out = args.build_dir

    jobs = []
    for src in kernel_sources():
        obj = out / "core" / src.relative_to(KERNELS).with_suffix(".o")
        jobs.append((obj, compile_command(cc, src, obj, SANITIZE)))
    for src in DRIVER_SOURCES:  # baseline flags, public header only
        obj = out / "tests" / src.with_suffix(".o").name
        jobs.append((obj, [cc, *BASE_CFLAGS, *SANITIZE, f"-I{INCLUDE}", "-c", str(src),
                           "-o", str(obj)]))

    def compile_one(job):
        obj, cmd = job
        obj.parent.mkdir(parents=True, exist_ok=True)
        return subprocess.run(cmd, capture_output=True, text=True), cmd

    failed = False
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for result, cmd in pool.map(compile_one, jobs):
            if result.returncode != 0 or result.stderr:
                print(" ".join(cmd), result.stdout, result.stderr, sep="\n", file=sys.stderr)
            failed |= result.returncode != 0
    if failed:
        return 2
    exe = out / "test_cpumoe"
    subprocess.run([cc, *SANITIZE, *(str(obj) for obj, _ in jobs), "-o", str(exe), "-lpthread",
                    "-lm"], check=True)
    if args.no_run:
        return 0
    env = dict(os.environ)
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    return subprocess.run([str(exe), *driver_args], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
