"""One OOLONG-style task under the stock RLM harness (the ``rlms`` library) with agentrt underneath.

The RLM runs as its authors ship it -- its own system prompt, loop and answer protocol -- with
only the REPL swapped: ``environment="agentrt"`` (agentrt's sandbox and tool speculation, see
`agentrt.integrations.rlm`) or ``"local"`` (rlms' own ``exec``, for comparison). The root model
is any OpenAI-compatible server; ``llm_query`` goes to another (the simulated sub-model of
`benchmarks.oolong.server`, or a real one).

`run_rlm_task` returns a `RlmRun` (answer, wall time, turns, tool calls, status, trace) shaped like
the runner's records. For replay mode, `scripted_root` serves the task's reference program
(`benchmarks.oolong.programs`, with its ``FINAL(...)`` written in the RLM's ``answer`` protocol by
`rlm_protocol`) as the root, at a set token rate.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from agentrt.results import RunStats
from agentrt.trace import Trace

from ..scripted_server import ScriptedServer
from .programs import reference_response
from .tasks import Task

ROOT_MODEL = "reference-root"
_FINAL_LINE = re.compile(r"^([ \t]*)FINAL\((.*)\)[ \t]*$", re.M)


@dataclass
class RlmRun:
    """The outcome of one task under the RLM harness."""

    answer: str | None
    """The RLM's response (None when the run raised)."""
    status: str
    """``final`` (the code set ``answer["ready"]``), ``max_turns`` (the RLM ran out of
    iterations and answered from its history) or ``error``."""
    wall_s: float
    turns: int
    """Root responses (RLM iterations, the closing answer after the last one included)."""
    tool_calls: int
    """Sub-model calls the executed code made (``rlm_calls`` of every block)."""
    early_calls: int
    """Of those, calls served by an early (speculative) call."""
    environment: str
    error: str | None = None
    trace: Trace = field(default_factory=Trace)
    """agentrt's event timeline of the run (empty for ``environment="local"``)."""
    stats: RunStats = field(default_factory=RunStats)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    """The RLM's own log of the run (``RLMLogger`` trajectory)."""

    def to_dict(self) -> dict[str, Any]:
        return {"answer": self.answer, "status": self.status, "wall_s": self.wall_s,
                "turns": self.turns, "tool_calls": self.tool_calls,
                "early_calls": self.early_calls, "environment": self.environment,
                "error": self.error, "stats": self.stats.to_dict(),
                "trace": self.trace.to_dict()}


def rlm_protocol(response: str) -> str:
    """``response`` with each ``FINAL(expr)`` line written as the RLM's ``answer`` assignment."""
    return _FINAL_LINE.sub(r'\1answer["content"] = \2\n\1answer["ready"] = True', response)


def scripted_root(task: Task, shape: str, tokens_per_second: float) -> ScriptedServer:
    """A root model that streams ``task``'s reference program (RLM protocol), unstarted."""
    return ScriptedServer([rlm_protocol(reference_response(task, shape))],
                          tokens_per_second=tokens_per_second, root_model=ROOT_MODEL)


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def run_rlm_task(task: Task, *, root_url: str, root_model: str, sub_url: str, sub_model: str,
                 environment: str = "agentrt", speculation: bool = True, max_turns: int = 3,
                 sub_max_tokens: int = 1024, temperature: float = 0.0,
                 api_key: str = "EMPTY") -> RlmRun:
    """Run ``task`` through ``rlm.RLM`` (context as its prompt, the question as its root prompt)."""
    import agentrt.integrations.rlm  # noqa: F401  (registers the environment "agentrt")
    from rlm import RLM
    from rlm.logger import RLMLogger

    trace, stats = Trace(), RunStats()
    env_kwargs: dict[str, Any] = {}
    if environment == "agentrt":
        env_kwargs = {"speculation": speculation, "trace": trace, "stats": stats}
    logger = RLMLogger()
    rlm = RLM(
        backend="openai",
        backend_kwargs={"model_name": root_model, "base_url": _v1(root_url), "api_key": api_key},
        other_backends=["openai"],
        other_backend_kwargs=[{"model_name": sub_model, "base_url": _v1(sub_url),
                               "api_key": api_key}],
        environment=environment, environment_kwargs=env_kwargs, max_iterations=max_turns,
        sampling_args={"temperature": temperature},
        sub_sampling_args={"max_tokens": sub_max_tokens}, logger=logger)
    started = time.perf_counter()
    answer, error = None, None
    try:
        answer = str(rlm.completion(task.context, root_prompt=task.question).response)
    except Exception as exc:  # a failed run is reported, never counted as an answer
        error = f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - started
    iterations = (logger.get_trajectory() or {}).get("iterations", [])
    calls = [c for it in iterations for block in it.get("code_blocks", [])
             for c in block["result"]["rlm_calls"]]
    finished = any(block["result"].get("final_answer") is not None
                   for it in iterations for block in it.get("code_blocks", []))
    status = "error" if error else "final" if finished else "max_turns"
    return RlmRun(answer=answer, status=status, wall_s=wall,
                  turns=len(iterations),
                  tool_calls=len(calls),
                  early_calls=sum(1 for c in calls if c.get("agentrt", {}).get("early")),
                  environment=environment, error=error, trace=trace, stats=stats,
                  iterations=iterations)


def _warm_up() -> None:
    """Pay one-time costs (imports, the first client) before any timed run."""
    import agentrt.integrations.rlm  # noqa: F401
    from rlm.clients import get_client

    get_client("openai", {"model_name": ROOT_MODEL, "base_url": "http://127.0.0.1:9/v1",
                          "api_key": "EMPTY"})


SYSTEMS = ("local", "agentrt-sequential", "agentrt", "agentrt-agent", "spec-ptc")
"""Under the RLM harness: ``local`` (rlms' own REPL), ``agentrt-sequential`` (agentrt's REPL, no
speculation), ``agentrt`` (with speculation). Outside it, on the same reference program and
stream (``FINAL`` protocol, a few tokens shorter): ``agentrt-agent`` (agentrt's own loop, the OOLONG
runner's replay mode ``speculative+plain``) and ``spec-ptc`` (the peer, `benchmarks.peer`)."""


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.oolong.rlm_harness``: replay-mode OOLONG tasks under the RLM harness.

    Each task's reference program is streamed as the root (``--tokens-per-second``); the
    simulated sub-model answers ``llm_query``. Systems run task by task, interleaved, so machine
    load hits them alike; a run that fails or does not finish is never counted as a speedup.
    """
    import argparse
    import json
    import statistics
    import sys
    from pathlib import Path

    import anyio

    from ..peer import PeerDriver, PeerUnavailable, oolong_job, peer_python
    from .bench import SimulatedProcess, SubModel, run_one
    from .generate import generate, parse_sizes
    from .programs import shape_for
    from .scoring import score
    from .server import MODEL_NAME, add_latency_arguments
    from .tasks import save_tasks

    parser = argparse.ArgumentParser(prog="python -m benchmarks.oolong.rlm_harness",
                                     description=main.__doc__)
    parser.add_argument("--sizes", default="4k,16k")
    parser.add_argument("--per-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens-per-second", type=float, default=34.5,
                        help="root replay rate (the native engine's plain decode rate)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results" / "oolong-rlm")
    add_latency_arguments(parser)
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    tasks = generate(parse_sizes(args.sizes), args.per_size, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    peer, note = None, None
    if "spec-ptc" in systems:
        try:
            peer = PeerDriver(peer_python())
        except PeerUnavailable as exc:
            note = f"Note: {exc}"
            print(note, file=sys.stderr)
    server = SimulatedProcess(save_tasks(tasks, args.out / "tasks.jsonl"), args)
    agent_args = argparse.Namespace(
        replay_plain_tps=args.tokens_per_second, replay_spec_tps=args.tokens_per_second,
        sub_max_tokens=1024, tool_concurrency=None, max_turns=args.max_turns, max_tokens=4096,
        temperature=0.0, seed=args.seed)
    rows: list[dict[str, Any]] = []
    _warm_up()
    try:
        for index, task in enumerate(tasks):
            shape = shape_for(index)
            for system in systems:
                if system == "spec-ptc":
                    if peer is None:
                        continue
                    result = peer.run(oolong_job(
                        task.id, reference_response(task, shape), task.context,
                        args.tokens_per_second, server.url, MODEL_NAME, 1024))
                    answer = result.get("answer_text")
                    row = {"status": result.get("status", "error"), "error": result.get("error"),
                           "wall_s": result.get("wall_s"), "answer": answer,
                           "tool_calls": result.get("hits", 0) + result.get("misses", 0),
                           "early_calls": result.get("hits", 0)}
                elif system == "agentrt-agent":
                    record = anyio.run(run_one, task, index, "speculative+plain", None,
                                       SubModel("simulated", server.url), agent_args)
                    row = {"status": record["status"], "error": record["error"],
                           "wall_s": record["wall_s"], "answer": record["answer"],
                           "tool_calls": sum(record["stats"]["tool_calls"].values()),
                           "early_calls": record["stats"]["hits"]}
                else:
                    with scripted_root(task, shape, args.tokens_per_second) as root:
                        run = run_rlm_task(
                            task, root_url=root.url, root_model=ROOT_MODEL, sub_url=server.url,
                            sub_model=MODEL_NAME, max_turns=args.max_turns,
                            environment="local" if system == "local" else "agentrt",
                            speculation=system == "agentrt")
                    row = {k: v for k, v in run.to_dict().items() if k not in ("trace",)}
                row |= {"task": task.id, "system": system, "shape": shape,
                        "score": score(row["answer"] or "", task.answer, task.answer_type)
                        if row["status"] == "final" else 0.0}
                rows.append(row)
                print(f"{task.id[:32]:32} {system:19} {row['status']:9} "
                      f"{row['wall_s'] or 0:6.2f}s  score {row['score']:.2f}  "
                      f"early {row['early_calls']}/{row['tool_calls']}", flush=True)
    finally:
        server.close()
        if peer is not None:
            peer.close()
    lines = [f"{len(tasks)} tasks, root replayed at {args.tokens_per_second:g} tok/s, simulated "
             "sub-model; speedup = local wall / wall, median over tasks that finished in both.",
             "", "| system | median s | speedup vs local | mean score | finished |",
             "|---|---|---|---|---|"]
    local = {r["task"]: r for r in rows if r["system"] == "local" and r["status"] == "final"}
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        done = [r for r in mine if r["status"] == "final"]
        if not mine:
            continue
        ratios = [local[r["task"]]["wall_s"] / r["wall_s"] for r in done if r["task"] in local]
        median = statistics.median(r["wall_s"] for r in done) if done else float("nan")
        speedup = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        lines.append(f"| {system} | {median:.2f} | {speedup} | "
                     f"{statistics.mean(r['score'] for r in mine):.2f} | {len(done)}/{len(mine)} |")
    if note:
        lines += ["", note]
    table = "\n".join(lines)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "runs.json").write_text(json.dumps(rows, indent=1, default=repr))
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
