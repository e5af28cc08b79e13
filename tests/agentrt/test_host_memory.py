"""What large tool payloads cost the runtime (the host process).

Speculated arguments are capped (per launch and per run: a call past a cap runs when its
statement executes, with the sequential run's answer), nothing of a run's arguments or results
stays alive once the run has ended, and a large tool result reaches the sandbox without the host
making serialised copies of it. Real sandbox workers, a scripted model (ReplayEngine).
"""

from __future__ import annotations

import gc
import tracemalloc

import anyio
import pytest

from agentrt import Agent, ReplayEngine, SpeculationBudget, tool

MB = 1_000_000


def fence(code: str) -> str:
    return f"```repl\n{code.strip()}\n```"


class Sizes:
    """Tools over large strings, counting their invocations."""

    def __init__(self) -> None:
        self.invocations = 0

    def tools(self):
        sizes = self

        @tool(speculate=True, pure=True)
        async def size(text: str) -> int:
            """The length of ``text``."""
            sizes.invocations += 1
            await anyio.sleep(0.01)
            return len(text)

        @tool(speculate=True, pure=True)
        async def mirror(text: str) -> str:
            """``text`` reversed (a result as large as the argument)."""
            sizes.invocations += 1
            return text[::-1]

        return [size, mirror]


def _calls_code(tool_name: str, sizes: list[int]) -> str:
    """One call per size, each with a string of that size; the answer sums the sizes."""
    wrap = "len({})" if tool_name == "mirror" else "{}"
    lines = ["out = []"]
    lines += ["out.append(" + wrap.format(f"{tool_name}({chr(65 + i)!r} * {n})") + ")"
              for i, n in enumerate(sizes)]
    lines += ["print(out)", "FINAL(sum(out))"]
    return fence("\n".join(lines))


def run_both(code: str, **agent_kw):
    """The script run sequentially, then speculatively: [(result, tools), ...]. The model
    streams at 40 tokens/s, so that a shadow reaches every call before its block has streamed
    even on a loaded machine."""
    out = []
    for speculation in (False, True):
        sizes = Sizes()
        agent = Agent(ReplayEngine([code], 40), tools=sizes.tools(), speculation=speculation,
                      builtin_tools=False, max_turns=1, warm_repls=0, **agent_kw)
        out.append((agent.run_sync("task"), sizes))
    return out


def assert_same(seq, spec) -> None:
    (r1, s1), (r2, s2) = seq, spec
    assert r1.status == r2.status == "final", (r1.error, r2.error)
    assert repr(r1.answer) == repr(r2.answer)
    assert [(t.output, t.error) for t in r1.turns] == [(t.output, t.error) for t in r2.turns]
    assert s1.invocations == s2.invocations
    stats = r2.stats
    assert stats.launched == stats.hits + stats.wasted + stats.retracted, stats


def too_large(result) -> list[dict]:
    return [e.data for e in result.trace.of("spec_too_large")]


# -- the caps ------------------------------------------------------------------------------------

def test_an_argument_past_the_launch_cap_is_not_launched_early():
    code = _calls_code("size", [1_000, 300_000, 2_000])
    seq, spec = run_both(code, speculation_budget=SpeculationBudget(
        max_arg_bytes_per_launch=100_000))
    assert_same(seq, spec)
    result = spec[0]
    assert result.answer == 303_000
    assert result.stats.launched == 2 and result.stats.hits == 2  # the two small calls
    assert result.stats.misses == 1
    events = too_large(result)
    assert len(events) == 1  # once per call site, however many shadows met it
    assert events[0]["tool"] == "size" and events[0]["cap"] == "launch"
    assert events[0]["limit"] == 100_000 and events[0]["arg_bytes"] > 300_000
    early = [e.data for e in result.trace.of("tool_started") if e.data["mode"] == "early"]
    assert len(early) == 2


def test_launches_past_the_run_total_run_when_their_statements_execute():
    code = _calls_code("size", [100_000] * 5)
    seq, spec = run_both(code, speculation_budget=SpeculationBudget(
        max_arg_bytes_per_run=250_000))
    assert_same(seq, spec)
    result = spec[0]
    assert result.stats.launched == 2  # 2 x 100 KB fit in 250 KB; a third would not
    assert result.stats.hits == 2 and result.stats.misses == 3
    events = too_large(result)
    assert {e["cap"] for e in events} == {"run"} and len(events) == 3
    assert all(e["limit"] == 250_000 for e in events)


def test_default_caps_keep_fifteen_megabyte_arguments_sequential():
    code = _calls_code("size", [15 * MB] * 2)
    seq, spec = run_both(code)
    assert_same(seq, spec)
    assert spec[0].stats.launched == 0
    # traced once for each call site a shadow reached before the block executed (one or both)
    events = too_large(spec[0])
    assert 1 <= len(events) == len({e["lineno"] for e in events}) <= 2
    assert all(e["cap"] == "launch" and e["arg_bytes"] > 15 * MB for e in events)


# -- release after the run -----------------------------------------------------------------------

def _large_objects_alive(min_len: int) -> list[str]:
    """The large strings and bytes that some container, frame or coroutine still refers to
    (garbage in reference cycles included: nothing is collected here)."""
    found = []
    for holder in gc.get_objects():
        for item in gc.get_referents(holder):
            if type(item) in (str, bytes, bytearray) and len(item) >= min_len:
                found.append(f"{type(item).__name__} of {len(item)} in {type(holder).__name__}")
    return found


def test_nothing_of_the_arguments_or_results_is_alive_after_the_run():
    """Arguments under the caps are launched early and their results delivered; once
    `run_sync` returns, without a garbage collection, no object of the run refers to any of
    them (nor to a key or trace field holding a copy)."""
    code = _calls_code("mirror", [1_500_000] * 4)
    sizes = Sizes()
    agent = Agent(ReplayEngine([code], 200), tools=sizes.tools(), builtin_tools=False,
                  max_turns=1, warm_repls=0)
    gc.collect()
    assert not _large_objects_alive(1_000_000)
    gc.disable()  # what is released must be released by the runtime, not by a collection
    try:
        result = agent.run_sync("task")
        alive = _large_objects_alive(1_000_000)
    finally:
        gc.enable()
    assert result.status == "final", result.error
    assert result.answer == 6_000_000
    # every early call the shadow made in time was claimed (how many it made depends on load)
    assert result.stats.launched >= 1 and result.stats.hits == result.stats.launched
    assert alive == []


# -- the result path -----------------------------------------------------------------------------

@pytest.mark.parametrize("speculate", [False, True])
def test_a_large_result_reaches_the_sandbox_without_copies(speculate):
    """A 30 MB result costs the host about the result itself: the Python allocations' peak
    stays within 1.5x of it plus a small constant (the result path used to make three copies:
    its trace digest, its pickle and the frame)."""
    size = 30 * MB

    @tool(speculate=speculate, pure=speculate)
    async def fetch(name: str) -> str:
        """A large document."""
        await anyio.sleep(0.05 if speculate else 0)
        return "x" * size

    code = fence("doc = fetch('a')\nprint(len(doc), doc[:3])\nFINAL(len(doc))")
    agent = Agent(ReplayEngine([code], 30), tools=[fetch], builtin_tools=False, max_turns=1,
                  warm_repls=0)
    tracemalloc.start()
    try:
        result = agent.run_sync("task")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == "final", result.error
    assert result.answer == size and result.turns[0].output.strip() == f"{size} xxx"
    if speculate:
        assert result.stats.hits == 1
    assert peak <= 1.5 * size + 8 * MB, f"peak {peak / MB:.0f} MB for a {size // MB} MB result"
