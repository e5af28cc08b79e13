"""Every system alone in a process of its own: the order of an invocation's runs (`schedule`),
the parent's side (`run_isolated`) and the child's (`worker`, `run_one`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .catalogue import ANCHOR, IN_PROCESS_SYSTEMS
from .ceilings import ceiling_inputs
from .common import child_env
from .plan import BenchSetupError, Plan
from .systems import Row, build_system


@dataclass
class Run:
    """One system's pass over every prompt, in a process of its own (``pid``) unless it is in
    `IN_PROCESS_SYSTEMS`."""

    system: str
    index: int
    pid: int
    load_s: float
    rows: list[Row]
    ceiling: dict | None = None
    """What `ceiling_inputs` measured in this run's process, when it was asked to."""
    info: dict | None = None
    """What the system says of its build (llama.cpp's version and CPU features, the native
    engine's matmul paths), when it says anything."""

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens per second over the run's prompts (as `summarise` counts them)."""
        seconds = sum(r.decode_s for r in self.rows)
        return sum(max(r.new_tokens - 1, 0) for r in self.rows) / seconds if seconds > 0 else 0.0

    @property
    def prefill_s(self) -> float:
        """Mean prefill seconds over the run's prompts."""
        return statistics.mean(r.prefill_s for r in self.rows) if self.rows else 0.0


def schedule(systems: list[str], repeats: int) -> list[str]:
    """The runs of one invocation, in order: ``repeats`` passes over ``systems``, pass i
    rotated to start at system i. With the anchor (`ANCHOR`) and other systems, the anchor runs
    before the first pass, between passes and after the last instead of inside them."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    anchored = ANCHOR in systems and len(systems) > 1
    others = [s for s in systems if s != ANCHOR] if anchored else list(systems)
    order = [ANCHOR] if anchored else []
    for i in range(repeats):
        k = i % len(others)
        order += others[k:] + others[:k] + ([ANCHOR] if anchored else [])
    return order


def run_isolated(argv: list[str], order: list[str], ceiling_from: str | None,
                 run_here) -> list[Run]:
    """Run each entry of ``order`` (see `schedule`) in a fresh ``python -m benchmarks.engine``
    process, given this invocation's ``argv`` with ``--systems`` set to the one system;
    `IN_PROCESS_SYSTEMS` go to ``run_here(system, index)`` instead. The first run of
    ``ceiling_from`` also measures the lookup ceiling's inputs (`ceiling_inputs`)."""
    runs: list[Run] = []
    ceiling_asked = False
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        for index, system in enumerate(order):
            print(f"run {index + 1}/{len(order)}: {system}", file=sys.stderr)
            if system in IN_PROCESS_SYSTEMS:
                runs.append(run_here(system, index))
                continue
            out = Path(tmp) / f"run-{index}.json"
            command = [sys.executable, "-m", "benchmarks.engine", *argv,
                       "--systems", system, "--worker-out", str(out)]
            if system == ceiling_from and not ceiling_asked:
                command.append("--worker-ceiling")
                ceiling_asked = True
            code = subprocess.run(command, env=child_env()).returncode
            if code != 0 or not out.is_file():
                raise BenchSetupError(f"{system}'s process exited with code {code} (its error is "
                                      "above)")
            payload = json.loads(out.read_text())
            rows = [Row(**row) for row in payload["rows"]]
            for row in rows:
                row.run = index
            runs.append(Run(system, index, payload["pid"], payload["load_s"], rows,
                            payload.get("ceiling"), payload.get("info")))
    return runs


def run_one(system: str, index: int, plan: Plan, args, path: Path | None,
            prompts: list[tuple[str, dict]], ceiling: bool = False, fresh: bool = False) -> Run:
    """Load ``system`` in this process, warm it up and run every prompt (``ceiling``: also
    measure `ceiling_inputs` on it afterwards; ``fresh``: each prompt on a system that forgot
    the earlier ones, see `run_all`)."""
    loop = asyncio.new_event_loop()
    runners: dict = {}
    try:
        t = time.perf_counter()
        runners[system] = build_system(system, plan, args, path, loop)
        load_s = time.perf_counter() - t
        print(f"loaded {system} in {load_s:.1f}s (pid {os.getpid()})", file=sys.stderr)
        rows = run_all(runners, prompts, args.max_tokens, fresh)
        inputs = ceiling_inputs(runners[system].engine, prompts, plan.sets) if ceiling else None
        info = runners[system].info() if hasattr(runners[system], "info") else None
    finally:
        close_all(runners, loop)
    for row in rows:
        row.pid, row.run = os.getpid(), index
    return Run(system, index, os.getpid(), load_s, rows, inputs, info)


def worker(args, plan: Plan, path: Path | None, prompts: list[tuple[str, dict]]) -> int:
    """The child side of `run_isolated`: run the one system of ``plan`` (`run_one`) and write
    ``{"pid", "load_s", "rows", "ceiling"}`` as JSON to ``--worker-out``."""
    (system,) = plan.systems
    run = run_one(system, 0, plan, args, path, prompts, args.worker_ceiling,
                  fresh=bool(getattr(args, "prefill", None)))
    payload = {"pid": run.pid, "load_s": run.load_s, "rows": [asdict(r) for r in run.rows],
               "ceiling": run.ceiling, "info": run.info}
    Path(args.worker_out).write_text(json.dumps(payload))
    return 0


def run_all(runners: dict, prompts: list[tuple[str, dict]], max_tokens: int,
            fresh: bool = False) -> list[Row]:
    """One warm-up per system, then every prompt on every system, interleaved (``fresh``: each
    runner forgets the earlier prompts first, its ``forget()``: no prefix is reused)."""
    warm = [{"role": "user", "content": "Say hello."}]
    for runner in runners.values():
        runner.run(warm, 8)
    rows: list[Row] = []
    for i, (prompt_set, prompt) in enumerate(prompts):
        for system, runner in runners.items():
            if fresh and hasattr(runner, "forget"):
                runner.forget()
            row = runner.run(prompt["messages"], max_tokens)
            row.system, row.prompt_set, row.prompt_id = system, prompt_set, prompt["id"]
            rows.append(row)
            print(f"[{i + 1}/{len(prompts)}] {prompt['id']:10s} {system:10s} {row.new_tokens:4d} tok "
                  f"decode {max(row.new_tokens - 1, 0) / max(row.decode_s, 1e-9):6.1f} tok/s "
                  f"prefill {row.prefill_s:5.2f}s", file=sys.stderr)
    return rows


def close_all(runners: dict, loop: asyncio.AbstractEventLoop) -> None:
    """Close every runner (a failing one does not stop the others), then the event loop."""
    for system, runner in runners.items():
        try:
            runner.close()
        except Exception as exc:  # report, keep closing the rest
            print(f"closing {system} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    with contextlib.suppress(Exception):
        loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
