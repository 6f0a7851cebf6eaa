"""``python -m cpumoe.bench``: the same command as ``python -m cpumoe bench``; also how the
capped baseline starts its worker subprocess (:mod:`cpumoe.bench.capped`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
