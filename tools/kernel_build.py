"""How the C core (csrc/kernels) is compiled: its sources and the flags of each ISA tier.

Shared by setup.py (kernel objects of the extension) and tools/build_c_tests.py (the same
objects with sanitizers, for the C test driver), so that both compile every file with
exactly its tier's flags. The tiers, their parents and their flags come from the tier list
csrc/include/cpumoe/tiers.h (written once, also read by the C code). A file's tier is its
name's suffix, `*-<tier>.c`; files without a tier suffix (pipeline, packers, dispatch) get
baseline x86-64 flags: they must run on any x86-64 CPU.

Never -march tuned to the build host: the same binary runs on any x86-64 CPU and picks its
tier at run time.
"""

import functools
import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "csrc" / "kernels"
INCLUDE = ROOT / "csrc" / "include"
TIER_LIST = INCLUDE / "cpumoe" / "tiers.h"

BASE_CFLAGS = [
    "-std=c11", "-O3", "-fPIC", "-fvisibility=hidden",
    # Every tier must give the same bits: no silent FMA contraction, fmaf where meant.
    "-ffp-contract=off", "-fno-math-errno",
    "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
    "-march=x86-64", "-mtune=generic",
]

# Flags the kernels get where the compiler accepts them (one probe compile each; older
# clang lacks the first):
# - thread-local variables (the AMX tile state, the error message) through TLS descriptors:
#   a call into a few-instruction resolver, where the default model calls __tls_get_addr at
#   every access (1.4 % of FP8 prefill's samples on the AMX tier, whose tile kernels test
#   their thread's tile state at every call).
OPTIONAL_CFLAGS = ["-mtls-dialect=gnu2"]

_TIER_ROW = re.compile(
    r'^\s*X\((?P<enum>\w+),\s*(?P<name>\w+),\s*(?P<id>\d+),\s*(?P<parent>\w+),\s*'
    r'"(?P<numerics>[^"]*)",\s*"(?P<flags>[^"]*)",', re.M)


def read_tiers(path: Path = TIER_LIST):
    """The rows of the tier list in rank order (worst first): dicts with enum, name, id,
    parent, numerics, and flags = the tier's own flags plus its ancestors'."""
    rows = [m.groupdict() for m in _TIER_ROW.finditer(path.read_text())]
    if not rows:
        raise RuntimeError(f"no tier rows found in {path}")
    by_name = {}
    for row in rows:
        row["id"] = int(row["id"])
        own = row["flags"].split()
        if row["parent"] == row["name"]:
            row["flags"] = own
        elif row["parent"] in by_name:
            row["flags"] = by_name[row["parent"]]["flags"] + own
        else:
            raise RuntimeError(f"{path}: tier {row['name']} comes before its parent {row['parent']}")
        by_name[row["name"]] = row
    return rows


TIERS = read_tiers()
TIER_NAMES = [row["name"] for row in TIERS]
BASELINE_TIER = TIERS[0]["name"]
TIER_FLAGS = {row["name"]: row["flags"] for row in TIERS}


def tier_of(path: Path) -> str:
    """The tier whose flags compile `path`: its `-<tier>` suffix, else the baseline."""
    stem = Path(path).stem
    for name in TIER_NAMES:
        if stem.endswith("-" + name):
            return name
    return BASELINE_TIER


def kernel_sources():
    return sorted(KERNELS.rglob("*.c"))


def kernel_dependencies(src: Path):
    """Files whose change makes the object of `src` stale."""
    return [src, *KERNELS.rglob("*.h"), *(INCLUDE / "cpumoe").glob("*.h")]


@functools.lru_cache(maxsize=None)
def supported_optional_flags(cc: str) -> tuple:
    """The OPTIONAL_CFLAGS that `cc` compiles a C file with."""
    def accepts(flag: str) -> bool:
        try:
            probe = subprocess.run([*shlex.split(cc), flag, "-x", "c", "-c", "-", "-o", os.devnull],
                                   input="int cm_probe;\n", capture_output=True, text=True,
                                   timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return probe.returncode == 0

    return tuple(flag for flag in OPTIONAL_CFLAGS if accepts(flag))


def compile_command(cc: str, src: Path, obj: Path, extra_flags=()):
    """The command that compiles one kernel source with its tier's flags; `extra_flags`
    come after them (so e.g. -O1 overrides -O3)."""
    flags = (BASE_CFLAGS + list(supported_optional_flags(cc)) + TIER_FLAGS[tier_of(src)] +
             list(extra_flags))
    return [cc, *flags, f"-I{INCLUDE}", f"-I{KERNELS}", "-c", str(src), "-o", str(obj)]
