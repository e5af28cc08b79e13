"""One OOLONG run: a task, a mode and a repeat, on the root engine the runner built.

Root kinds:

- ``forced``: the reference trajectory streamed through the native engine by teacher forcing
  (`agentrt.engine.ForcedEngine`): real forwards at the real context length, real tau;
- ``replay``: the reference trajectory streamed at a fixed token rate (``--root-tps``);
- ``native`` / ``vllm`` / ``openai``: a live model writes the code.

Sub-models: an OpenAI-compatible URL (the simulated deployment by default), a native engine
generating freely, or ``forced``: the simulated answers teacher-forced through the root's own
native engine (`forced_sub.ForcedSubModel`), at `SUB_QUERY_PRIORITY` as the agent sends them to
an engine it shares with its root.

Isolation: before every run (every wave, with concurrent tasks) the root engine's drafter state
and prefix cache are reset where the backend can do it (`NativeEngine.reset`), then the task's
system prompt (and few-shot turns), which hold nothing of its answer, are prefilled, so every
mode starts from the same engine state (a forced sub-model's too: it is the same engine).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from agentrt import Agent, ReplLimits
from agentrt.agent import SUB_QUERY_PRIORITY
from agentrt.engine.base import Engine, SamplingParams, complete
from agentrt.engine.metrics import DecodeMetrics
from agentrt.llm_tools import make_llm_tools

from .forced_sub import ForcedSubModel, snapshot
from .root_prompt import SYSTEM_PROMPT, task_message
from .scoring import score
from .server import MODEL_NAME, Oracle
from .tasks import Task
from .trajectories import SHAPE, shape_of, trajectory

ROOT_KINDS = ("forced", "replay", "native", "vllm", "openai")
SCRIPTED = ("forced", "replay")


@dataclass(frozen=True)
class Setting:
    """What varies between groups of runs: tasks run at once, and the replay root's speed."""

    concurrency: int = 1
    root_tps: float | None = None

    @property
    def tag(self) -> str:
        return f"c{self.concurrency}" + ("" if self.root_tps is None else f"-tps{self.root_tps:g}")

    @property
    def label(self) -> str:
        parts = [f"{self.concurrency} task{'s' if self.concurrency > 1 else ''} at once"]
        if self.root_tps is not None:
            parts.append(f"root {self.root_tps:g} tok/s")
        return ", ".join(parts)


@dataclass
class SubModel:
    """Where ``llm_query`` goes: an OpenAI-compatible URL, an engine in this process, or (with
    ``oracle``) the oracle's answers forced through the root's native engine."""

    kind: str
    url: str | None = None
    model: str = MODEL_NAME
    engine: Engine | None = None
    oracle: Oracle | None = None
    forced: dict[int, DecodeMetrics] = field(default_factory=dict)
    """Per root engine (by id), every forced sub-call it served, whichever run made it."""

    def make_engine(self, root_engine: Engine | None = None) -> Engine:
        """The engine one run's ``llm_query`` calls use (``root_engine``: the native engine the
        run's root streams through, which a forced sub-model shares)."""
        if self.oracle is not None:
            return ForcedSubModel(root_engine, self.oracle,
                                  self.forced.setdefault(id(root_engine), DecodeMetrics()))
        if self.engine is not None:
            return self.engine
        from agentrt.engine import OpenAIEngine

        return OpenAIEngine(base_url=self.url, model=self.model, server_metrics=False)

    def forced_metrics(self, root_engine: Engine | None) -> DecodeMetrics | None:
        """What the forced sub-calls on ``root_engine`` (every run's) have cost so far; None
        without a forced sub-model."""
        if self.oracle is None:
            return None
        return snapshot(self.forced.setdefault(id(root_engine), DecodeMetrics()))


@dataclass
class Root:
    """The root engines of one runner invocation, per decoding mode."""

    kind: str
    engines: dict[str, Engine | None] = field(default_factory=dict)
    """``plain`` / ``specdec`` engines (native: the engines forced text goes through); None for
    replay, which makes a fresh engine per run."""
    few_shot: dict[str, list] = field(default_factory=dict)
    """Few-shot turns per task id (live roots only)."""
    served_model: str = ""
    """``--engine openai``: the model name the server serves."""
    peer: Any = None
    """The peer's driver (`benchmarks.peer.PeerDriver`), with ``--peer``."""

    def engine_for(self, task: Task, style: str, decode: str, setting: Setting) -> Engine:
        if self.kind == "replay":
            from agentrt.engine import ReplayEngine

            return ReplayEngine(trajectory(task, style), tokens_per_second=setting.root_tps)
        engine = self.engines[decode]
        if self.kind == "forced":
            from agentrt.engine import ForcedEngine

            return ForcedEngine(engine, trajectory(task, style))
        return engine

    def isolation(self) -> str:
        if self.kind == "replay":
            return "replay roots are stateless (a fresh engine per run)"
        if all(hasattr(e, "reset") for e in self.engines.values() if e is not None):
            return ("drafter state (cross-request corpus, adaptive-k estimates) and prefix cache "
                    "reset before every run, then the task's system prompt prefilled")
        return ("this backend cannot reset its caches: modes are only rotated in order per "
                "task (a later mode may reuse an earlier mode's cached prefixes)")


def messages_before_task(task: Task, signatures: str, examples: list) -> list[dict[str, str]]:
    from agentrt import prompts

    return [{"role": "system",
             "content": prompts.system_prompt(signatures, task.context, SYSTEM_PROMPT)},
            *examples]


async def isolate(root: Root, decode: str, tasks: list[Task], signatures: str) -> None:
    """Reset the engine a wave of runs uses, then prefill what their prompts share with no
    knowledge of the answer: the system prompt (and the few-shot turns)."""
    engine = root.engines.get(decode)
    if engine is None:
        return
    reset = getattr(engine, "reset", None)
    if reset is not None:
        import anyio

        await anyio.to_thread.run_sync(reset)
    for task in tasks:
        messages = messages_before_task(task, signatures, root.few_shot.get(task.id, []))
        await complete(engine, messages, SamplingParams(max_tokens=1))


def _metrics(engine: Engine | None) -> Any:
    target = getattr(engine, "engine", engine)  # ForcedEngine wraps the native engine
    return target.metrics() if target is not None and hasattr(target, "metrics") else None


def engine_counters(before: Any, after: Any, others_before: Any = None,
                    others_after: Any = None) -> tuple[float | None, int, float]:
    """(tau, generated tokens, generation seconds) between two metric snapshots, less what
    requests that were not roots' (forced sub-calls: ``others_*``, snapshots taken with them)
    added in between."""
    if before is None or after is None:
        return None, 0, 0.0
    fields = ("verify_steps", "accepted_tokens", "generated_tokens", "wall_s")
    def others(f: str) -> float:
        return 0 if others_after is None else getattr(others_after, f) - getattr(others_before, f)

    steps, accepted, tokens, wall = (getattr(after, f) - getattr(before, f) - others(f)
                                     for f in fields)
    tau = (accepted + steps) / steps if steps else None
    return tau, tokens, wall


PEER_MODE = "spec-ptc"
LOCAL_MODE = "local"
"""Tool modes besides sequential / speculative: the peer (replay roots, ``--peer``) and, under
``--harness rlm``, the RLM library's own ``exec`` REPL (the baseline there)."""


def _digest(value: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _record(task: Task, style: str, mode: str, repeat: int, setting: Setting, root: Root,
            started: float, *, answer: Any, status: str, error: str | None, wall_s: float,
            calls: list | None, stats: dict[str, Any], turns: list[dict[str, Any]],
            code: str = "", trace: dict[str, Any] | None = None, tau: float | None = None,
            tokens: int = 0, gen_s: float = 0.0, sub: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """A run's record: what the summary and the trace files use."""
    answer = None if answer is None else str(answer)
    return {
        "setting": setting.tag, "started": started, "task": task.id, "type": task.task,
        "style": style, "context_tokens": task.context_tokens, "mode": mode, "repeat": repeat,
        "answer": answer, "gold": task.answer, "answer_type": task.answer_type,
        "score": score(answer, task.answer, task.answer_type) if answer is not None else 0.0,
        "status": status, "error": error, "wall_s": wall_s,
        "code_ok": bool(turns) and all(t.get("error") is None for t in turns),
        "shape": SHAPE[style] if root.kind in SCRIPTED else shape_of(code),
        "turns_n": len(turns), "tau": tau, "tokens": tokens,
        "tok_s": tokens / gen_s if tokens > 0 and gen_s > 0 else None,
        "calls": calls, "stats": stats, "turns": turns, "trace": trace or {"events": []},
        "sub": sub,
    }


async def run_one(task: Task, style: str, mode: str, repeat: int, setting: Setting, root: Root,
                  sub: SubModel, args: Any) -> dict[str, Any]:
    """Run ``task`` once in ``mode``; its record."""
    tools_mode = mode.split("+")[0]
    if tools_mode == PEER_MODE:
        return await _run_peer(task, style, mode, repeat, setting, root, sub, args)
    if args.harness == "rlm":
        return await _run_rlm(task, style, mode, repeat, setting, root, sub, args)
    return await _run_agent(task, style, mode, repeat, setting, root, sub, args)


async def _run_agent(task: Task, style: str, mode: str, repeat: int, setting: Setting,
                     root: Root, sub: SubModel, args: Any) -> dict[str, Any]:
    """One run of agentrt's own loop."""
    tools_mode, decode = mode.split("+")
    engine = root.engine_for(task, style, decode, setting)
    root_engine = root.engines.get(decode)
    sub_engine = sub.make_engine(root_engine)
    forced_sub = isinstance(sub_engine, ForcedSubModel)
    sub_params = SamplingParams(max_tokens=args.sub_max_tokens,
                                priority=SUB_QUERY_PRIORITY if forced_sub else 0)
    tools = make_llm_tools(sub_engine, sub_params, max_concurrency=args.tool_concurrency)
    wall = getattr(args, "cell_wall_s", None)
    limits = ReplLimits(wall_s=wall) if wall is not None else None
    agent = Agent(engine, tools=tools, builtin_tools=False, repl_limits=limits,
                  speculation=tools_mode == "speculative", max_turns=args.max_turns,
                  system_prompt=SYSTEM_PROMPT, examples=root.few_shot.get(task.id, []),
                  sampling=SamplingParams(max_tokens=args.max_tokens,
                                          temperature=args.temperature, seed=args.seed))
    before, sub_before = _metrics(engine), sub.forced_metrics(root_engine)
    started = time.time()
    try:
        result = await agent.run(task_message(task.question), task.context)
    finally:
        if sub.engine is None:
            await sub_engine.aclose()
    # the root's own: less every forced sub-call on its engine meanwhile (concurrent runs' too)
    tau, tokens, gen_s = engine_counters(before, _metrics(engine), sub_before,
                                         sub.forced_metrics(root_engine))
    if tokens <= 0 or gen_s <= 0:  # no engine counters: count replay pieces over the stream time
        from agentrt.engine.replay import split_tokens

        from ..overlap import generation_spans

        tokens = sum(len(split_tokens(t.response)) for t in result.turns)
        gen_s = sum(end - start for start, end in generation_spans(result.trace).values())
    calls = [[e.data["tool"], e.data["args"], e.data["result"], e.data["error"]]
             for e in result.trace.of("program_call")]
    return _record(task, style, mode, repeat, setting, root, started, answer=result.answer,
                   status=result.status, error=result.error, wall_s=result.wall_s, calls=calls,
                   stats=result.stats.to_dict(),
                   turns=[{"response": t.response, "output": t.output, "error": t.error}
                          for t in result.turns],
                   code="\n".join(t.code for t in result.turns), trace=result.trace.to_dict(),
                   tau=tau, tokens=tokens, gen_s=gen_s,
                   sub=sub_engine.counters() if forced_sub else None)


async def _run_rlm(task: Task, style: str, mode: str, repeat: int, setting: Setting,
                   root: Root, sub: SubModel, args: Any) -> dict[str, Any]:
    """One run under the stock RLM harness (``rlms``), its REPL agentrt's or its own."""
    import contextlib
    import functools

    import anyio

    from .rlm_harness import ROOT_MODEL, run_rlm_task, scripted_root

    tools_mode = mode.split("+")[0]
    started = time.time()
    with contextlib.ExitStack() as stack:
        if root.kind == "replay":
            server = stack.enter_context(scripted_root(task, style, setting.root_tps))
            root_url, root_model = server.base_url, ROOT_MODEL
        else:
            root_url, root_model = args.base_url, root.served_model
        run = await anyio.to_thread.run_sync(functools.partial(
            run_rlm_task, task, root_url=root_url, root_model=root_model, sub_url=sub.url,
            sub_model=sub.model, environment="local" if tools_mode == LOCAL_MODE else "agentrt",
            speculation=tools_mode == "speculative", max_turns=args.max_turns,
            sub_max_tokens=args.sub_max_tokens, temperature=args.temperature))
    calls, turns, code = [], [], []
    for it in run.iterations:
        for block in it.get("code_blocks", []):
            result = block.get("result", {})
            code.append(block.get("code", ""))
            turns.append({"response": it.get("response", ""), "output": result.get("stdout", ""),
                          "error": result.get("stderr") or None})
            calls += [["llm_query", _digest(c.get("prompt")), _digest(c.get("response")), None]
                      for c in result.get("rlm_calls", [])]
    stats = run.stats.to_dict()
    return _record(task, style, mode, repeat, setting, root, started, answer=run.answer,
                   status=run.status, error=run.error, wall_s=run.wall_s, calls=calls,
                   stats=stats, turns=turns, code="\n".join(code), trace=run.trace.to_dict())


async def _run_peer(task: Task, style: str, mode: str, repeat: int, setting: Setting,
                    root: Root, sub: SubModel, args: Any) -> dict[str, Any]:
    """One run of the peer (spec-ptc) on the same trajectory, stream pace and sub-model."""
    import anyio

    from ..peer import oolong_job

    started = time.time()
    result = await anyio.to_thread.run_sync(root.peer.run, oolong_job(
        task.id, trajectory(task, style), task.context, setting.root_tps, sub.url, sub.model,
        args.sub_max_tokens))
    error = result.get("error")
    status = "error" if error else result.get("status", "error")
    return _record(task, style, mode, repeat, setting, root, started,
                   answer=result.get("answer_text"), status=status, error=error,
                   wall_s=result.get("wall_s") or 0.0, calls=None,
                   stats={"hits": result.get("hits", 0), "wasted": result.get("wasted", 0),
                          "launched": result.get("launched", 0)},
                   turns=[{"response": "", "output": out, "error": err}
                          for out, err in result.get("turns", [])])
