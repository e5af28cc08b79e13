"""One OOLONG-style task under the stock RLM harness (the ``rlms`` library) with agentrt underneath.

The RLM runs as its authors ship it -- its own system prompt, loop and answer protocol -- with
only the REPL swapped: ``environment="agentrt"`` (agentrt's sandbox and tool speculation, see
`agentrt.integrations.rlm`) or ``"local"`` (rlms' own ``exec``, for comparison). The root model
is any OpenAI-compatible server; ``llm_query`` goes to another (the simulated sub-model of
`benchmarks.oolong.server`, or a real one).

`run_rlm_task` returns a `RlmRun` (answer, wall time, turns, tool calls, status, trace); the
OOLONG runner (``--harness rlm``) turns it into a record. For replay mode, `scripted_root` serves
the task's reference trajectory (`trajectories.trajectory`, with each ``FINAL(...)`` written in
the RLM's ``answer`` protocol by `rlm_protocol`) as the root, at a set token rate.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from agentrt.results import RunStats
from agentrt.trace import Trace

from ..scripted_server import ScriptedServer
from .trajectories import trajectory
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


def scripted_root(task: Task, style: str, tokens_per_second: float) -> ScriptedServer:
    """A root model that streams ``task``'s reference trajectory (RLM protocol), unstarted."""
    return ScriptedServer([rlm_protocol(r) for r in trajectory(task, style)],
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


