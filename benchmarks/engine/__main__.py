"""``python -m benchmarks.engine``: the engine benchmark (also each system's own process)."""

import sys

from .cli import main

sys.exit(main())
