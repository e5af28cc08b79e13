"""Contracts of tool speculation: equivalence, no early side effects, bounded waste, faults.

Every test runs the real runtime (sandbox worker processes, shadow forks, the ledger) twice —
speculation off and on — on the same scripted model, and compares what a user would see.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt import Agent, ReplayEngine, SpeculationBudget, tool
from agentrt.engine import BaseEngine, Delta, SamplingParams, Usage


class ChunkedEngine(BaseEngine):
    """Streams scripted responses in random chunks at a random pace (seeded)."""

    name = "chunked"

    def __init__(self, responses: list[str], seed: int, max_chunk: int = 12,
                 max_pause: float = 0.004) -> None:
        self.responses = responses
        self.rng = random.Random(seed)
        self.max_chunk = max_chunk
        self.max_pause = max_pause
        self.calls = 0

    async def stream(self, messages: Sequence, params: SamplingParams | None = None
                     ) -> AsyncIterator[Delta]:
        text = self.responses[self.calls]
        self.calls += 1
        i = 0
        while i < len(text):
            n = self.rng.randint(1, self.max_chunk)
            yield Delta(text=text[i:i + n])
            i += n
            await anyio.sleep(self.rng.uniform(0, self.max_pause))
        yield Delta(text="", finish_reason="stop", usage=Usage(0, 0))


class World:
    """Deterministic tools, plus a log of effectful calls and of concurrency."""

    def __init__(self, latency: float = 0.01) -> None:
        self.latency = latency
        self.effects: list[tuple[int, bool]] = []
        self.balance = 0
        self.ledger = 0
        self.notes = 0
        self.invocations: dict[str, int] = {}
        self.running = 0
        self.peak = 0
        self.execs_open = 0

    def on_event(self, event) -> None:
        if event.kind == "exec_started":
            self.execs_open += 1
        elif event.kind == "exec_finished":
            self.execs_open -= 1

    async def work(self, name: str, seconds: float) -> None:
        """Count an invocation of ``name`` and take ``seconds``, tracking concurrency."""
        self.invocations[name] = self.invocations.get(name, 0) + 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await anyio.sleep(seconds)
        finally:
            self.running -= 1

    def tools(self):
        world = self

        @tool(speculate=True)
        async def f(x: int) -> int:
            """A pure function."""
            await world.work("f", world.latency)
            return (x * 7 + 3) % 101

        @tool(speculate=True)
        async def g(s: str) -> str:
            """A pure string function."""
            await world.work("g", world.latency)
            return s[::-1] + "!"

        @tool(speculate=True)
        async def boom(x: int) -> int:
            """Raises ValueError for odd input."""
            await world.work("boom", world.latency)
            if x % 2:
                raise ValueError(f"odd input {x}")
            return x // 2

        @tool(speculate=True, timeout=0.2)
        async def slow(x: int) -> int:
            """Takes too long for odd input."""
            await world.work("slow", 1.0 if x % 2 else 0.01)
            return x

        @tool
        async def record(x: int) -> int:
            """An effectful call: appends to a log."""
            world.effects.append((x, world.execs_open > 0))
            await anyio.sleep(world.latency)
            return len(world.effects)

        @tool
        async def put(x: int) -> int:
            """An effectful write to shared state."""
            world.balance += x
            world.effects.append((1000 + x, world.execs_open > 0))
            await anyio.sleep(world.latency)
            return world.balance

        @tool(speculate=True)
        async def peek() -> int:
            """A read of the shared state ``put`` writes."""
            await world.work("peek", world.latency)
            return world.balance

        @tool(writes={"ledger"})
        async def book(x: int) -> int:
            """An effectful write to the ledger scope only."""
            world.ledger += x
            world.effects.append((2000 + x, world.execs_open > 0))
            await anyio.sleep(world.latency)
            return world.ledger

        @tool(speculate=True, reads={"ledger"})
        async def audit() -> int:
            """A read of the ledger scope."""
            await world.work("audit", world.latency)
            return world.ledger

        @tool(writes={"notes"})
        async def jot(x: int) -> int:
            """An effectful write to the notes scope only."""
            world.notes += x
            world.effects.append((3000 + x, world.execs_open > 0))
            await anyio.sleep(world.latency)
            return world.notes

        @tool(speculate=True, reads={"notes", "ledger"})
        async def digest() -> int:
            """A read of the notes and ledger scopes."""
            await world.work("digest", world.latency)
            return world.notes * 100 + world.ledger

        @tool(speculate=True, pure=True)
        async def pf(x: int) -> int:
            """Pure: depends only on its argument."""
            await world.work("pf", world.latency)
            return (x * 5 + 1) % 97

        return [f, g, boom, slow, record, put, peek, book, audit, jot, digest, pf]


def fence(code: str) -> str:
    return f"```repl\n{code.strip()}\n```"


def run_both(responses: list[str], seed: int = 0, engine_factory=None, **agent_kw):
    """Run the script sequentially and speculatively; return both results and worlds."""
    out = []
    for speculation in (False, True):
        world = World(agent_kw.pop("latency", 0.01) if "latency" in agent_kw else 0.01)
        engine = (engine_factory or (lambda: ChunkedEngine(responses, seed)))()
        agent = Agent(engine, tools=world.tools(), speculation=speculation, builtin_tools=False,
                      max_turns=len(responses), capture_namespace=True, on_event=world.on_event,
                      **agent_kw)
        out.append((agent.run_sync("task", list(range(6))), world))
    return out


def assert_equivalent(seq, spec) -> None:
    (r1, w1), (r2, w2) = seq, spec
    assert r1.status == r2.status
    assert repr(r1.answer) == repr(r2.answer)
    assert [(t.output, t.error) for t in r1.turns] == [(t.output, t.error) for t in r2.turns]
    assert r1.namespace == r2.namespace
    assert w1.effects == w2.effects
    # no early side effects: every effectful call ran inside an authoritative execution
    assert all(inside for _, inside in w2.effects)
    s = r2.stats
    assert s.launched == s.hits + s.wasted + s.retracted, s
    assert w2.invocations.get("record", 0) == w1.invocations.get("record", 0)
    assert s.shadow_tool_calls_refused == 0


# -- property: random programs, random streaming ------------------------------------------------

_V = ["a", "b", "c"]


@st.composite
def expr(draw):
    kind = draw(st.sampled_from(["int", "var", "f", "fmod", "add"]))
    v = draw(st.sampled_from(_V))
    n = draw(st.integers(0, 9))
    return {
        "int": str(n),
        "var": v,
        "f": f"f({v})",
        "fmod": f"f({v} + {n}) % 3",
        "add": f"{v} + {n}",
    }[kind]


@st.composite
def statement(draw):
    t = draw(st.sampled_from(_V))
    v = draw(st.sampled_from(_V))
    e = draw(expr())
    n = draw(st.integers(0, 4))
    kind = draw(st.sampled_from([
        "assign", "for", "while", "if", "try", "def", "break", "continue", "comp", "effect",
        "print", "string", "raise", "alias", "default_arg", "rebind", "raise_now", "final",
        "write_read", "read_write", "scoped_write_read", "scoped_read_write", "disjoint",
        "pure_effect", "scoped_loop", "write_all_read_scoped",
    ]))
    return {
        "assign": f"{t} = {e}",
        "for": f"for i in range({n}):\n    {t} = {t} + f(i + {v})",
        "while": f"j = 0\nwhile j < {n}:\n    {t} += f(j)\n    j += 1",
        "if": f"if f({v}) % 2 == 0:\n    {t} = f({t} + 1)\nelif {v} > 50:\n    {t} = 1\nelse:\n    {t} = {e}",
        "try": f"try:\n    {t} = boom({v})\nexcept ValueError as err:\n    print('caught', err)",
        "def": f"def h(x):\n    return f(x) * 2 + {n}\n{t} = h({v})",
        "break": f"for i in range(5):\n    if f(i + {v}) % 3 == 0:\n        break\n    {t} += 1",
        "continue": f"for i in range({n}):\n    if i % 2:\n        continue\n    {t} += f(i)",
        "comp": f"{t} = sum([f(x) for x in range({n}) if x != {v}])",
        "effect": f"{t} = record({v}) + f({t})",
        "print": f"print('{t}=', {t}, g(str({v})))",
        "string": f"{t} = len(g(f'{{{v}}}-{{f({v})}}'))",
        "raise": f"if {v} > 90:\n    raise ValueError('too big')",
        # effectful tools reached by another name: an alias and a default argument bound in the
        # first turn, the speculatable name ``f`` rebound to the effectful tool
        "alias": f"{t} = rec({v}) + f({t})",
        "default_arg": f"{t} = via_default({v}) + f({n})",
        "rebind": f"f = record\n{t} = f({v})",
        "raise_now": f"{t} = f({v})\nraise ValueError('halt')\nrec({n})\n{t} = f({n})",
        "final": f"FINAL({t})\nrec({n})",
        # reads and writes of shared state
        "write_read": f"put({n})\n{t} = peek() + f({v})",
        "read_write": f"{t} = peek()\nput({v} % 5)\n{t} += peek()",
        # effect scopes: reads of an overlapping scope wait, disjoint and pure ones cross
        "scoped_write_read": f"book({n})\n{t} = audit() + pf({v}) + digest() + peek()",
        "scoped_read_write": f"{t} = audit()\nbook({v} % 5)\n{t} += audit() + pf({t})",
        "disjoint": f"jot({n})\n{t} = audit() + digest() + pf({n})",
        "pure_effect": f"{t} = pf({v}) + record({n}) + pf({t}) + audit()",
        "scoped_loop": f"for i in range({n}):\n    {t} += digest() + pf(i)\n    book(i)\n"
                       f"    jot(pf(i) % 3)",
        "write_all_read_scoped": f"put({n})\n{t} = audit() + pf({v})",
    }[kind]


@st.composite
def program(draw):
    init = ("a = context[1]\nb = context[2]\nc = 0\nrec = record\n"
            "def via_default(x, cb=record):\n    return cb(x)")
    stmts = draw(st.lists(statement(), min_size=2, max_size=7))
    split = draw(st.integers(0, len(stmts)))
    first, second = stmts[:split], stmts[split:]
    responses = ["Plan.\n" + fence(init + "\n" + "\n".join(first))]
    if second:
        cut = draw(st.integers(0, len(second)))  # two blocks in one response when 0 < cut
        blocks = [b for b in (second[:cut], second[cut:]) if b]
        responses.append("\n".join(fence("\n".join(b)) for b in blocks))
    responses.append(fence("FINAL([a, b, c])"))
    return responses


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(program(), st.integers(0, 10_000))
def test_equivalence_property(responses, seed):
    seq, spec = run_both(responses, seed)
    assert_equivalent(seq, spec)


@pytest.mark.slow
@pytest.mark.timeout(14400)
@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(program(), st.integers(0, 10_000))
def test_equivalence_property_long(responses, seed):
    seq, spec = run_both(responses, seed)
    assert_equivalent(seq, spec)


# -- fixed scenarios -----------------------------------------------------------------------------

def test_map_is_speculated_and_equivalent():
    responses = [fence("r = []\nfor x in context:\n    r.append(f(x))\nprint(r)\nFINAL(r)")]
    seq, spec = run_both(responses, engine_factory=lambda: ReplayEngine(responses, 30))
    assert_equivalent(seq, spec)
    assert spec[0].stats.hits == 6 and spec[0].stats.misses == 0
    assert spec[0].stats.hidden_s > 0
    kinds = {e.kind for e in spec[0].trace.events}
    assert {"spec_peek", "spec_launch", "spec_claim"} <= kinds


def test_identical_calls_are_separate_invocations():
    responses = [fence("votes = [f(1) for _ in range(4)]\nFINAL(votes)")]
    seq, spec = run_both(responses, engine_factory=lambda: ReplayEngine(responses, 30))
    assert_equivalent(seq, spec)
    assert seq[1].invocations["f"] == 4 and spec[1].invocations["f"] == 4


def test_effectful_call_only_runs_in_the_authoritative_run():
    responses = [fence("x = f(1)\nn = record(x)\ny = f(n)\nz = f(2)\nFINAL([x, n, y, z])")]
    seq, spec = run_both(responses, engine_factory=lambda: ReplayEngine(responses, 20))
    assert_equivalent(seq, spec)
    assert spec[1].effects == [(3 * 1 + 7 - 7 + 3, True)] or len(spec[1].effects) == 1
    # f(2) does not depend on the effectful call: it was still speculated
    launched = [e.data for e in spec[0].trace.events if e.kind == "spec_launch"]
    assert any(d["tool"] == "f" for d in launched)


def test_early_error_surfaces_only_where_the_run_reaches_it():
    # the open loop makes the shadow launch boom(5), boom(6), boom(7); the finished code
    # breaks after the first iteration, so boom(7)'s early error never surfaces
    code = "out = []\nfor i in range(3):\n    try:\n        out.append(boom(i + 5))\n" \
           "    except ValueError as e:\n        out.append(str(e))\n    break\nFINAL(out)"
    responses = [fence(code)]
    seq, spec = run_both(responses, engine_factory=lambda: ReplayEngine(responses, 15))
    assert_equivalent(seq, spec)
    assert seq[0].answer == ["odd input 5"]


def test_early_timeout_surfaces_exactly_as_sequential():
    code = "res = []\nfor x in [2, 3]:\n    try:\n        res.append(slow(x))\n" \
           "    except TimeoutError as e:\n        res.append('timeout: ' + str(e))\nFINAL(res)"
    responses = [fence(code)]
    seq, spec = run_both(responses, engine_factory=lambda: ReplayEngine(responses, 15))
    assert_equivalent(seq, spec)
    assert seq[0].answer[0] == 2 and seq[0].answer[1].startswith("timeout: ")


def test_runaway_peek_and_big_loops_stay_within_budget():
    # streamed slowly: the shadow sees `while i < 10:` before `i += 1` arrives
    code = "i = 0\ntotal = 0\nwhile i < 10:\n    total += f(i)\n    i += 1\n" \
           "s = 0\nfor k in range(300):\n    s += f(k)\nFINAL([total, s])"
    responses = [fence(code)]
    budget = SpeculationBudget(max_in_flight=3, max_per_turn=40, max_per_shadow=15)
    seq, spec = run_both(responses, engine_factory=lambda: ReplayEngine(responses, 12),
                         speculation_budget=budget)
    assert_equivalent(seq, spec)
    stats = spec[0].stats
    assert stats.launched <= 40
    assert spec[1].peak <= 3 + 1  # early calls in flight, plus the authoritative one


def test_engine_stream_dying_mid_block_cancels_early_calls():
    code = "r = [f(x) for x in range(5)]\nq = [f(x + 10) for x in range(5)]\nFINAL(r + q)"
    text = fence(code)
    world = World(latency=2.0)
    engine = ReplayEngine([text], tokens_per_second=40, fail_at={0: text.index("FINAL")})
    agent = Agent(engine, tools=world.tools(), speculation=True, builtin_tools=False)
    result = agent.run_sync("t")
    assert result.status == "error" and "EngineStreamError" in result.error
    assert result.stats.launched > 0
    assert result.stats.launched == result.stats.hits + result.stats.wasted + result.stats.retracted
    assert world.running == 0  # nothing left running
    kinds = [e.kind for e in result.trace.events]
    assert kinds[-1] == "run_finished" and "run_error" in kinds and "spec_cancel" in kinds
    assert result.wall_s < 2.0  # the 2 s early calls were cancelled, not awaited
