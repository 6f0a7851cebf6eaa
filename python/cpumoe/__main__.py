"""``python -m cpumoe``: ``info`` (CPU, ISA tiers, threads) and ``bench`` (model-shape benchmark)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _import_error(e: BaseException) -> int:
    print(f"cpumoe: cannot import the extension ({e}).\n"
          "Build it in place first: python setup.py build_ext --inplace", file=sys.stderr)
    return 1


def info_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpumoe info",
                                description="Show the CPU, the ISA tiers and the tier in use.")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")
    args = p.parse_args(argv)
    try:
        from .bench import build_info, machine_info
    except ImportError as e:
        return _import_error(e)
    info = machine_info()
    info["build"] = build_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    llc = info["last_level_cache_bytes"]
    rows = [
        ("CPU", info["cpu_model"]),
        ("logical CPUs", str(info["logical_cpus"])
         + (f" (last-level cache {llc / (1 << 20):.0f} MiB)" if llc else "")),
        ("CPU features", " ".join(info["cpu_features"]) or "(none)"),
        ("tiers built", ", ".join(info["built_isas"])),
        ("best supported", info["best_isa"]),
        ("tier in use", info["tier"]),
        ("why", info["isa_reason"]),
        ("CPUMOE_ISA", info["cpumoe_isa_env"] if info["cpumoe_isa_env"] is not None else "(not set)"),
        ("cpumoe", info["cpumoe_version"]),
        ("built from", _built_from(info["build"])),
        ("C compiler", info["build"]["compiler"]),
        ("torch", info["torch_version"]),
        ("torch threads", str(info["threads"])),
        ("python", info["python_version"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return 0


def _built_from(build: dict) -> str:
    """The commit the package was built from and whether the tree had changes."""
    state = {True: " (tree had changes)", False: ""}.get(build["dirty"], " (tree state unknown)")
    return f"commit {build['git_commit']}{state}"


def bench_main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        from . import bench
    except ImportError as e:
        return _import_error(e)
    return bench.main(argv)


COMMANDS = {
    "info": (info_main, "show the CPU, its features, the ISA tiers built and the one in use"),
    "bench": (bench_main, "benchmark fused_experts (every weight scheme) on model shapes vs "
                          "the measured roofline and PyTorch (python -m cpumoe bench --help); "
                          "'bench compare A.json B.json' sets two saved runs side by side; "
                          "'bench routing' times the routing ops against the layer they route; "
                          "'bench linear' the dense linear ops"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m cpumoe",
        description="cpumoe: fused Mixture-of-Experts operators for x86 CPUs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<7} {h}" for k, (_, h) in COMMANDS.items())
        + "\n\nRun 'python -m cpumoe COMMAND --help' for a command's options.")
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND",
                   help="one of: " + ", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    if not argv:
        p.print_help()
        return 2
    ns = p.parse_args(argv[:1])
    return COMMANDS[ns.command][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
