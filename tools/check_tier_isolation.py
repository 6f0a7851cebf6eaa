"""Checks that each object of the C core contains only instructions its tier's flags allow.

Every object compiled from csrc/kernels is disassembled. Its tier is its source's suffix
(tools/kernel_build.py; files without one are baseline). An instruction family may appear
only in objects whose tier's flags (with its ancestors', from csrc/include/cpumoe/tiers.h)
enable it: a baseline object (the CPU probe, pipeline, packers, which run before any tier
is chosen) has no VEX/EVEX instruction at all, an avx2 object no zmm or opmask register,
and so on for every family below. This is how we know the binary runs on a baseline
x86-64 CPU, and each tier on a CPU with exactly its features, without having one.

Usage: python tools/check_tier_isolation.py BUILD_DIR   (exit 1 on a violation)
"""

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_build import TIER_FLAGS, TIERS  # noqa: E402

# Instruction families: the compiler flags that enable each (any one of them), and what its
# instructions look like in objdump's AT&T output.
FAMILIES = [
    (("-mavx", "-mavx2"),
     re.compile(r"%[xyz]mm(1[6-9]|2\d|3[01])|%[yz]mm\d|%k[0-7]\b|\tv[a-z0-9]+\s")),
    (("-mavx512f",), re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])|%k[0-7]\b")),
    (("-mavx512vnni", "-mavxvnni"), re.compile(r"\tvpdp(bu?sd|wssd)s?\s")),
    (("-mavx512bf16",), re.compile(r"\t(vdpbf16ps|vcvtne2?ps2bf16)\s")),
    (("-mavx512vbmi",), re.compile(r"\tvperm(i2|t2)?b\s|\tvpmultishiftqb\s")),
    (("-mamx-tile",),
     re.compile(r"\t(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|"
                r"tilerelease)\s")),
    (("-mamx-bf16",), re.compile(r"\ttdpbf16ps\s")),
    (("-mamx-int8",), re.compile(r"\ttdpb[su][su]d\s")),
]


def forbidden_patterns(tier):
    """The families none of whose enabling flags the tier's flags (with its ancestors') have."""
    flags = set(TIER_FLAGS[tier])
    return [(enabling[0], pattern) for enabling, pattern in FAMILIES
            if not flags.intersection(enabling)]


def tier_of_object(obj: Path) -> str:
    for row in TIERS:
        if obj.stem.endswith("-" + row["name"]):
            return row["name"]
    return TIERS[0]["name"]


def main(build_dir: str) -> int:
    objects = sorted(p for p in Path(build_dir).rglob("*.o") if "kernels" in p.parts)
    if not objects:
        print(f"no kernel objects under {build_dir}", file=sys.stderr)
        return 1
    bad = 0
    for obj in objects:
        tier = tier_of_object(obj)
        patterns = forbidden_patterns(tier)
        if not patterns:
            continue
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                             capture_output=True, text=True).stdout
        hits = [(flag, line.strip()) for line in asm.splitlines()
                for flag, pattern in patterns if pattern.search(line)]
        status = ("ok" if not hits else
                  f"{len(hits)} instructions its flags do not enable, e.g. {hits[0][1]} "
                  f"(needs {hits[0][0]})")
        name = "/".join(obj.parts[obj.parts.index("kernels") + 1:])
        print(f"{name:40s} {tier:8s} {status}")
        bad += bool(hits)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build"))
