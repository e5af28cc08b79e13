"""``python -m benchmarks.engine_bench``: the engine benchmark, now the package `benchmarks.engine`."""

import sys

from benchmarks.engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
