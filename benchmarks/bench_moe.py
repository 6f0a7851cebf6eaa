#!/usr/bin/env python
"""Runs the cpumoe model-shape benchmark as a script; same options as `python -m cpumoe bench`.

    python benchmarks/bench_moe.py [--shape all] [--m 1,4,16] [--json out.json] ...

See benchmarks/README.md for what is measured and how.
"""

import os
import sys

# Let the script run from a source checkout without installing (extension built in place).
_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python")
if os.path.isdir(os.path.join(_PY, "cpumoe")) and _PY not in sys.path:
    sys.path.insert(0, os.path.abspath(_PY))

from cpumoe.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
