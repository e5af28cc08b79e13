"""Benchmark runner: ``python -m benchmarks.run <suite> [options]`` (also ``agentrt bench``).

Suites:
  patterns   tool speculation on the program-shape suite (sequential vs speculative)
  engine     token speculation: HF generate, the native engine with each proposer, vLLM
             and OpenAI-compatible servers (--engine native|vllm|openai)
  oolong     end to end on OOLONG-style tasks: {sequential, speculative} tools x
             {plain, speculative} decoding, live root model, simulated sub-model
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "patterns": "benchmarks.pattern_bench",
    "engine": "benchmarks.engine.cli",
    "oolong": "benchmarks.oolong.bench",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUITES[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
