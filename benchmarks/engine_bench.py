"""``python -m benchmarks.engine_bench``: the engine benchmark (the same as ``python -m benchmarks.engine``)."""

import sys

from benchmarks.engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
