"""``agentrt demo``: one agent task end to end on the native engine with SmolLM2-135M-Instruct.

The same task runs twice on the same model with greedy decoding: once as a plain agent (no
speculative decoding, tools run when their block is complete), once with everything agentrt
does (speculative decoding + the shadow interpreter). The answers are the same; the time is not.

SmolLM2-135M is a very small model, so the prompt carries one worked example as an earlier chat
turn, and the tool (`word_count`) stands for a remote call with a fixed latency.
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio

from agentrt.engine import SamplingParams

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
SYSTEM = (
    "You are a Python agent. Answer with one ```repl code block that uses the list `context` "
    "and the tool `word_count(text)`, and ends with FINAL(answer). Tools:\n{tool_lines}"
)
EXAMPLE = [
    {"role": "user", "content": "Which review in context is the longest?"},
    {"role": "assistant", "content": (
        "```repl\ncounts = [word_count(review) for review in context]\n"
        "longest = context[counts.index(max(counts))]\nprint(counts)\nFINAL(longest)\n```"
    )},
]
TASK = "Which review in context is the shortest?"


def make_tools():
    from agentrt.tools import tool

    @tool(speculate=True)
    async def word_count(text: str) -> int:
        """Number of words in a text (a remote service: ~0.4 s per call)."""
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


async def _warm_up(engine) -> None:
    from agentrt.engine import complete

    await complete(engine, [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))


def run_once(label: str, *, speculative: bool, dtype: str) -> tuple[RunResult, object]:
    from agentrt.engine import NativeEngine

    engine = NativeEngine(dtype=dtype, speculation="suffix" if speculative else None, seed=0)
    agent = Agent(
        engine, tools=make_tools(), speculation=speculative, builtin_tools=False, max_turns=3,
        system_prompt=SYSTEM, examples=EXAMPLE, sampling=SamplingParams(max_tokens=160),
        on_event=_live_printer(label),
    )
    try:
        anyio.run(_warm_up, engine)  # start-up (weights, cost measurement) is not part of the run
        result = agent.run_sync(TASK, REVIEWS)
    finally:
        anyio.run(engine.aclose)
    return result, engine.metrics()


def main(args: argparse.Namespace | None = None) -> int:
    dtype = getattr(args, "dtype", "bf16")
    only_plain = bool(getattr(args, "no_speculation", False))
    print(f"agentrt demo: SmolLM2-135M-Instruct ({dtype}) on the native engine, CPU.")
    print(f"Task: {TASK}  (context: {len(REVIEWS)} reviews; tool latency {TOOL_LATENCY_S}s)")
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
    if len(rows) == 2:
        same = repr(rows[0][1].answer) == repr(rows[1][1].answer)
        print(f"\nsame answer: {'yes' if same else 'NO'}; speedup {rows[0][1].wall_s / rows[1][1].wall_s:.2f}x "
              f"(demo took {time.monotonic() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
