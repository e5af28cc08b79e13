"""``agentrt demo``: one agent task end to end on the native engine with SmolLM2-135M-Instruct.

The same task runs twice on the same model with greedy decoding and the default prompt: once as
a plain agent (no speculative decoding, tools run when their block is complete), once with
everything agentrt does (speculative decoding + the shadow interpreter). A speedup is reported
only when both runs finish with the same answer; the answer is also checked against the truth.

The tool (`word_count`) stands for a remote call with a fixed latency.
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio

from agentrt.engine import SamplingParams

from . import prompts
from .agent import Agent
from .results import RunResult
from .trace import Event

TOOL_LATENCY_S = 0.4
REVIEWS = [
    "Great battery life and a sharp screen, would buy again.",
    "Stopped working after two days.",
    "Decent value for the price, although the speakers are quiet and the case feels cheap.",
    "Fine.",
    "The keyboard is comfortable and the trackpad is accurate, but it runs hot under load.",
    "Arrived late and the box was damaged, yet the laptop itself works perfectly well.",
]
TASK = "How many words does each review in context have? Use the word_count tool."
EXPECTED = [len(review.split()) for review in REVIEWS]


def make_tools():
    from agentrt.tools import tool

    @tool(speculate=True)
    async def word_count(text: str) -> int:
        """Number of words in a text."""
        await anyio.sleep(TOOL_LATENCY_S)
        return len(text.split())

    return [word_count]


def _live_printer(label: str):
    def on_event(event: Event) -> None:
        if event.kind == "delta":
            sys.stdout.write(event.data["text"])
            sys.stdout.flush()
        elif event.kind == "turn_started":
            print(f"\n--- {label}: model turn {event.data['turn'] + 1} ---")
        elif event.kind == "exec_finished":
            print(f"\n    [block {event.data['block'] + 1} executed at {event.t:.2f}s"
                  f"{'; error: ' + event.data['error'].splitlines()[0] if event.data['error'] else ''}]")
        elif event.kind == "spec_launch":
            print(f"\n    [early call {event.data['tool']} #{event.data['early_id']} at {event.t:.2f}s]",
                  end="")
    return on_event


async def _warm_up(engine, agent: Agent) -> None:
    """Start the engine (weights, step-cost measurement) and cache the agent's fixed prompt
    prefix (system prompt and example exchange), as an engine has after an agent's first task.
    The task itself is not sent."""
    from agentrt.engine import complete

    system = prompts.system_prompt(agent.registry.render_signatures(), REVIEWS)
    messages = [{"role": "system", "content": system}, *agent.examples,
                {"role": "user", "content": "Hi"}]
    await complete(engine, messages, SamplingParams(max_tokens=2))


def run_once(label: str, *, speculative: bool, dtype: str) -> tuple[RunResult, object]:
    from agentrt.engine import NativeEngine

    engine = NativeEngine(dtype=dtype, drafter="suffix" if speculative else None, seed=0)
    agent = Agent(
        engine, tools=make_tools(), speculation=speculative, max_turns=3,
        sampling=SamplingParams(max_tokens=160), on_event=_live_printer(label),
    )
    try:
        anyio.run(_warm_up, engine, agent)  # the same for both modes, not part of the run
        result = agent.run_sync(TASK, REVIEWS)
    finally:
        anyio.run(engine.aclose)
    return result, engine.metrics()


def main(args: argparse.Namespace | None = None) -> int:
    """Run the demo; 0 when every run finished (and, with both modes, gave the same answer)."""
    dtype = getattr(args, "dtype", "bf16")
    only_plain = bool(getattr(args, "no_speculation", False))
    print(f"agentrt demo: SmolLM2-135M-Instruct ({dtype}) on the native engine, CPU.")
    print(f"Task: {TASK}  (context: {len(REVIEWS)} reviews; tool latency {TOOL_LATENCY_S}s)")
    print("Each mode gets a fresh engine that has served the agent's fixed prompt prefix once "
          "(not the task).")
    t0 = time.monotonic()
    rows = []
    modes = [("plain", False)] + ([] if only_plain else [("agentrt", True)])
    for label, speculative in modes:
        result, metrics = run_once(label, speculative=speculative, dtype=dtype)
        rows.append((label, result, metrics))
        print(f"\n=> {label}: status={result.status} answer={result.answer!r} "
              f"wall={result.wall_s:.2f}s")
    print("\n| run | wall s | turns | answer | tok/s | tau | tool calls | early hits |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r, m in rows:
        calls = sum(r.stats.tool_calls.values())
        print(f"| {label} | {r.wall_s:.2f} | {len(r.turns)} | {str(r.answer)[:40]!r} | "
              f"{m.tokens_per_s:.1f} | {m.tau:.2f} | {calls} | {r.stats.hits} |")
    print()
    print(verdict([r for _, r, _ in rows]))
    print(f"(demo took {time.monotonic() - t0:.0f}s)")
    failed = any(not r.ok for _, r, _ in rows)
    differ = len(rows) == 2 and not same_answer(rows[0][1], rows[1][1])
    return 1 if failed or differ else 0


def same_answer(a: RunResult, b: RunResult) -> bool:
    return repr(a.answer) == repr(b.answer)


def verdict(results: list[RunResult]) -> str:
    """What the runs show: the speedup only when every run finished with the same answer."""
    labels = ["plain", "agentrt"][:len(results)]
    failed = [f"{label} ended with status {r.status}{': ' + r.error if r.error else ''}"
              for label, r in zip(labels, results) if not r.ok]
    if failed:
        return "NO SPEEDUP REPORTED: " + "; ".join(failed) + "."
    right = "correct" if results[0].answer == EXPECTED else f"wrong (the truth is {EXPECTED})"
    if len(results) == 1:
        return f"plain answered {results[0].answer!r}: {right}."
    plain, fast = results
    if not same_answer(plain, fast):
        return (f"NO SPEEDUP REPORTED: the answers differ (plain {plain.answer!r}, "
                f"agentrt {fast.answer!r}).")
    return (f"Both runs finished with the same answer, {plain.answer!r} ({right}); "
            f"agentrt was {plain.wall_s / fast.wall_s:.2f}x faster "
            f"({plain.wall_s:.2f}s -> {fast.wall_s:.2f}s).")


if __name__ == "__main__":
    sys.exit(main())
