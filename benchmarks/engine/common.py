"""What the engine benchmark's two suites share (single stream: `benchmarks.engine.cli`, many
requests at once: `benchmarks.engine.concurrency`) and other benchmarks use: the prompt sets, the
vLLM system names, the result files and the environment of a child process."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
PROMPT_DIR = BENCHMARKS / "prompts"
RESULTS_DIR = BENCHMARKS / "results"
PROMPT_SETS = ("agent_code", "chat", "copy_heavy")
VLLM_SYSTEMS = ("vllm", "vllm-spec")


def load_prompts(sets: list[str], limit: int | None) -> list[tuple[str, dict]]:
    """``(set name, prompt row)`` for the first ``limit`` prompts of each set in ``sets``
    (``benchmarks/prompts/<set>.jsonl``)."""
    prompts = []
    for name in sets:
        with open(PROMPT_DIR / f"{name}.jsonl") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts += [(name, row) for row in rows[:limit]]
    return prompts


def write_results(payload: dict, md: str, out: str | Path) -> Path:
    """Write ``engine-<time>.json`` (``payload``) and ``engine-<time>.md`` (``md``) into
    ``out``; returns the JSON file's path."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out_dir / f"engine-{stamp}.json"
    target.write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"engine-{stamp}.md").write_text(md)
    print(f"\nwrote {target} and .md")
    return target


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, for a benchmark
    that runs each system in a ``python -m benchmarks...`` process of its own."""
    path = os.pathsep.join(p for p in (str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, as a benchmark's header prints them."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())
