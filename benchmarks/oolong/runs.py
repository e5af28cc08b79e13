"""One OOLONG run: a task, a mode and a repeat, on the root engine the runner built.

Root kinds:

- ``forced``: the reference trajectory streamed through the native engine by teacher forcing
  (`agentrt.engine.ForcedEngine`): real forwards at the real context length, real tau;
- ``replay``: the reference trajectory streamed at a fixed token rate (``--root-tps``);
- ``native`` / ``vllm`` / ``openai``: a live model writes the code.

Isolation: before every run (every wave, with concurrent tasks) the root engine's drafter state
and prefix cache are reset where the backend can do it (`NativeEngine.reset`), then the task's
system prompt (and few-shot turns), which hold nothing of its answer, are prefilled, so every
mode starts from the same engine state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from agentrt import Agent
from agentrt.engine.base import Engine, SamplingParams, complete
from agentrt.llm_tools import make_llm_tools

from .root_prompt import SYSTEM_PROMPT, task_message
from .scoring import score
from .server import MODEL_NAME
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
    """Where ``llm_query`` goes: an OpenAI-compatible URL, or an engine in this process."""

    kind: str
    url: str | None = None
    model: str = MODEL_NAME
    engine: Engine | None = None

    def make_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        from agentrt.engine import OpenAIEngine

        return OpenAIEngine(base_url=self.url, model=self.model, server_metrics=False)


@dataclass
class Root:
    """The root engines of one runner invocation, per decoding mode."""

    kind: str
    engines: dict[str, Engine | None] = field(default_factory=dict)
    """``plain`` / ``specdec`` engines (native: the engines forced text goes through); None for
    replay, which makes a fresh engine per run."""
    few_shot: dict[str, list] = field(default_factory=dict)
    """Few-shot turns per task id (live roots only)."""

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


def engine_counters(before: Any, after: Any) -> tuple[float | None, int, float]:
    """(tau, generated tokens, generation seconds) between two metric snapshots."""
    if before is None or after is None:
        return None, 0, 0.0
    steps = after.verify_steps - before.verify_steps
    accepted = after.accepted_tokens - before.accepted_tokens
    tau = (accepted + steps) / steps if steps else None
    return tau, after.generated_tokens - before.generated_tokens, after.wall_s - before.wall_s


async def run_one(task: Task, style: str, mode: str, repeat: int, setting: Setting, root: Root,
                  sub: SubModel, args: Any) -> dict[str, Any]:
    """Run ``task`` once in ``mode``; the record the summary and the trace files use."""
    tools_mode, decode = mode.split("+")
    engine = root.engine_for(task, style, decode, setting)
    sub_engine = sub.make_engine()
    tools = make_llm_tools(sub_engine, SamplingParams(max_tokens=args.sub_max_tokens),
                           max_concurrency=args.tool_concurrency)
    agent = Agent(engine, tools=tools, builtin_tools=False,
                  speculation=tools_mode == "speculative", max_turns=args.max_turns,
                  system_prompt=SYSTEM_PROMPT, examples=root.few_shot.get(task.id, []),
                  sampling=SamplingParams(max_tokens=args.max_tokens,
                                          temperature=args.temperature, seed=args.seed))
    before = _metrics(engine)
    started = time.time()
    try:
        result = await agent.run(task_message(task.question), task.context)
    finally:
        if sub.engine is None:
            await sub_engine.aclose()
    tau, tokens, gen_s = engine_counters(before, _metrics(engine))
    if tokens <= 0 or gen_s <= 0:  # no engine counters: count replay pieces over the stream time
        from agentrt.engine.replay import split_tokens

        from ..overlap import generation_spans

        tokens = sum(len(split_tokens(t.response)) for t in result.turns)
        gen_s = sum(end - start for start, end in generation_spans(result.trace).values())
    answer = None if result.answer is None else str(result.answer)
    code = "\n".join(t.code for t in result.turns)
    return {
        "setting": setting.tag, "started": started, "task": task.id, "type": task.task, "style": style,
        "context_tokens": task.context_tokens, "mode": mode, "repeat": repeat,
        "answer": answer, "gold": task.answer, "answer_type": task.answer_type,
        "score": score(answer, task.answer, task.answer_type) if answer is not None else 0.0,
        "status": result.status, "error": result.error, "wall_s": result.wall_s,
        "code_ok": bool(result.turns) and any(t.blocks for t in result.turns)
                   and all(b.error is None for t in result.turns for b in t.blocks),
        "shape": SHAPE[style] if root.kind in SCRIPTED else shape_of(code),
        "turns_n": len(result.turns), "tau": tau, "tokens": tokens,
        "tok_s": tokens / gen_s if tokens > 0 and gen_s > 0 else None,
        "stats": result.stats.to_dict(),
        "turns": [{"response": t.response, "output": t.output, "error": t.error}
                  for t in result.turns],
        "trace": result.trace.to_dict(),
    }
