"""Checks that only tier files contain instructions of their tier.

Every object compiled from csrc/kernels is disassembled; a file without a tier
suffix (and every *-scalar.c) must contain no VEX/EVEX instruction (no ymm/zmm/k
registers, no v-prefixed AVX mnemonics), and *-avx2.c must contain no zmm or
opmask registers. This is how we know the binary runs on a baseline x86-64 CPU
without having one: the CPU probe, pipeline and packers execute before any tier
is chosen.

Usage: python tools/check_tier_isolation.py BUILD_DIR   (exit 1 on a violation)
"""

import re
import subprocess
import sys
from pathlib import Path

AVX_ANY = re.compile(r"%[xyz]mm(1[6-9]|2\d|3[01])|%[yz]mm\d|%k[0-7]\b|\tv[a-z0-9]+\s")
AVX512_ONLY = re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])|%k[0-7]\b")


def tier_of(name: str) -> str:
    for tier in ("avx512", "avx2", "scalar"):
        if name.endswith("-" + tier):
            return tier
    return "baseline"


def main(build_dir: str) -> int:
    objects = sorted(p for p in Path(build_dir).rglob("*.o") if "kernels" in p.parts)
    if not objects:
        print(f"no kernel objects under {build_dir}", file=sys.stderr)
        return 1
    bad = 0
    for obj in objects:
        tier = tier_of(obj.stem)
        if tier == "avx512":
            continue
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                             capture_output=True, text=True).stdout
        pattern = AVX512_ONLY if tier == "avx2" else AVX_ANY
        hits = [line.strip() for line in asm.splitlines() if pattern.search(line)]
        status = "ok" if not hits else f"{len(hits)} forbidden instructions, e.g. {hits[0]}"
        print(f"{obj.name:32s} {tier:8s} {status}")
        bad += bool(hits)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build"))
