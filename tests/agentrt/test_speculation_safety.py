"""Speculation keeps its promises against hostile model code.

Each test runs the real runtime twice on the same scripted model (speculation off, then on) and
compares what a user would see: the answers, the printed output and the log of effects. The
programs reach effectful tools the way a model could (aliases, default arguments, rebinding
across turns, code after ``raise`` or after ``FINAL``), mix reads and writes of shared state,
write loops whose update has not streamed yet, and pass huge arguments.
"""

from __future__ import annotations

import anyio
import pytest

from agentrt import Agent, ReplayEngine, tool
from agentrt.interpreter.frames import RefusedCall


class Bank:
    """Shared state behind the tools, with a log of every effect and invocation counts."""

    def __init__(self, latency: float = 0.02) -> None:
        self.latency = latency
        self.balance = 0
        self.effects: list[str] = []
        self.invocations: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.invocations[name] = self.invocations.get(name, 0) + 1

    def tools(self):
        bank = self

        @tool
        async def record_effect(tag: str) -> int:
            """Effectful: appends ``tag`` to the log."""
            bank._count("record_effect")
            bank.effects.append(tag)
            await anyio.sleep(bank.latency)
            return len(bank.effects)

        @tool
        async def deposit(amount: int) -> int:
            """Effectful: adds to the balance."""
            bank._count("deposit")
            bank.effects.append(f"deposit {amount}")
            bank.balance += amount
            await anyio.sleep(bank.latency)
            return bank.balance

        @tool(speculate=True)
        async def get_balance() -> int:
            """Read-only: the balance now."""
            bank._count("get_balance")
            value = bank.balance
            await anyio.sleep(bank.latency)
            return value

        @tool(speculate=True)
        async def lookup(x: int) -> int:
            """Pure."""
            bank._count("lookup")
            await anyio.sleep(bank.latency)
            return (x * 7 + 3) % 101

        @tool(speculate=True)
        async def check(x: int) -> bool:
            """Pure: true from 2 on."""
            bank._count("check")
            await anyio.sleep(bank.latency)
            return x >= 2

        @tool(speculate=True)
        async def measure(text: str) -> int:
            """Pure: the size of its argument."""
            bank._count("measure")
            return len(text)

        @tool(writes={"accounts"})
        async def transfer(amount: int) -> int:
            """Effectful, declared: writes the accounts scope only."""
            bank._count("transfer")
            bank.effects.append(f"transfer {amount}")
            bank.balance += amount
            await anyio.sleep(bank.latency)
            return bank.balance

        @tool(speculate=True, reads={"accounts"})
        async def account_balance() -> int:
            """A declared read of the accounts scope."""
            bank._count("account_balance")
            value = bank.balance
            await anyio.sleep(bank.latency)
            return value

        @tool(speculate=True, reads={"weather"})
        async def forecast(day: int) -> str:
            """A declared read of a scope no tool here writes."""
            bank._count("forecast")
            await anyio.sleep(bank.latency)
            return f"day {day}: {'rain' if day % 2 else 'sun'}"

        @tool(speculate=True, pure=True)
        async def score(x: int) -> int:
            """Pure: depends only on its argument."""
            bank._count("score")
            await anyio.sleep(bank.latency)
            return x * x + 1

        return [record_effect, deposit, get_balance, lookup, check, measure, transfer,
                account_balance, forecast, score]


def fence(code: str) -> str:
    return f"```repl\n{code.strip()}\n```"


def run_both(responses: list[str], tps: float = 40.0, latency: float = 0.02, **agent_kw):
    out = []
    for speculation in (False, True):
        bank = Bank(latency)
        agent = Agent(ReplayEngine(responses, tps), tools=bank.tools(), speculation=speculation,
                      builtin_tools=False, max_turns=len(responses), capture_namespace=True,
                      **agent_kw)
        out.append((agent.run_sync("task"), bank))
    return out


def assert_same(seq, spec) -> None:
    (r1, b1), (r2, b2) = seq, spec
    assert r1.status == r2.status
    assert repr(r1.answer) == repr(r2.answer)
    assert [(t.output, t.error) for t in r1.turns] == [(t.output, t.error) for t in r2.turns]
    assert b1.effects == b2.effects
    for name in ("record_effect", "deposit", "transfer"):
        assert b1.invocations.get(name, 0) == b2.invocations.get(name, 0), name
    s = r2.stats
    assert s.launched == s.hits + s.wasted + s.retracted, s
    assert s.shadow_tool_calls_refused == 0, s


# -- effectful tools reached by another name -------------------------------------------------

def test_alias_from_an_earlier_turn_never_runs_early():
    responses = [
        fence("e = record_effect\nprint('ready')"),
        fence("n = lookup(1)\ne('alias')\nm = lookup(2)\ne('alias2')\nFINAL([n, m])"),
    ]
    seq, spec = run_both(responses)
    assert_same(seq, spec)
    assert seq[1].effects == ["alias", "alias2"]


def test_default_argument_never_runs_early():
    responses = [
        fence("def g(cb=record_effect):\n    return cb('default')\nprint('defined')"),
        fence("x = lookup(3)\ny = g()\nz = g()\nFINAL([x, y, z])"),
    ]
    seq, spec = run_both(responses)
    assert_same(seq, spec)


def test_container_and_closure_never_run_early():
    responses = [
        fence("box = {'act': record_effect}\n"
              "def make():\n    act = box['act']\n    def inner(t):\n        return act(t)\n"
              "    return inner\nh = make()\nprint('ok')"),
        fence("a = lookup(1)\nbox['act']('from dict')\nh('from closure')\nFINAL(a)"),
    ]
    seq, spec = run_both(responses)
    assert_same(seq, spec)


def test_speculatable_name_rebound_to_an_effect_in_an_earlier_turn():
    responses = [
        fence("lookup = record_effect\nprint('rebound')"),
        fence("v = lookup('rebound call')\nw = lookup('again')\nFINAL([v, w])"),
    ]
    seq, spec = run_both(responses)
    assert_same(seq, spec)
    assert seq[1].effects == ["rebound call", "again"]


def test_code_after_raise_never_runs_early():
    responses = [
        fence("e = record_effect\nprint('ready')"),
        fence("x = lookup(1)\nraise ValueError('stop here')\ne('after raise')\ny = lookup(2)"),
        fence("FINAL(x)"),
    ]
    seq, spec = run_both(responses)
    assert_same(seq, spec)
    assert seq[1].effects == []


def test_blocks_after_final_never_run_early():
    responses = [
        fence("e = record_effect\nprint('ready')"),
        fence("x = lookup(1)\nFINAL(x)") + "\n" + fence("e('after final')\ny = lookup(9)"),
    ]
    seq, spec = run_both(responses)
    assert_same(seq, spec)
    assert seq[1].effects == []


# -- reads never overtake writes -------------------------------------------------------------

def test_read_after_write_in_one_block():
    responses = [fence("deposit(100)\nb = get_balance()\nFINAL(b)")]
    seq, spec = run_both(responses)
    assert_same(seq, spec)
    assert spec[0].answer == 100


def test_reads_and_writes_interleaved_in_a_loop():
    code = ("seen = []\nfor i in range(3):\n    seen.append(get_balance())\n    deposit(10)\n"
            "seen.append(get_balance())\nFINAL(seen)")
    seq, spec = run_both([fence(code)], tps=25)
    assert_same(seq, spec)
    assert spec[0].answer == [0, 10, 20, 30]


def test_read_before_write_still_speculated():
    responses = [fence("b = get_balance()\nc = lookup(4)\ndeposit(5)\nFINAL([b, c])")]
    seq, spec = run_both(responses)
    assert_same(seq, spec)
    assert spec[0].answer == [0, lookup_value(4)]
    assert spec[0].stats.hits >= 1


def lookup_value(x: int) -> int:
    return (x * 7 + 3) % 101


def early_claims(result, tool_name: str) -> tuple[int, int]:
    """(claims served by an early call, claims that missed) of ``tool_name``."""
    claims = [e.data for e in result.trace.events
              if e.kind == "spec_claim" and e.data["tool"] == tool_name]
    hits = sum(1 for c in claims if c["early_id"] is not None)
    return hits, len(claims) - hits


def launches(result, tool_name: str) -> int:
    return sum(1 for e in result.trace.events
               if e.kind == "spec_launch" and e.data["tool"] == tool_name)


# -- effect scopes -------------------------------------------------------------------------

def test_pure_calls_after_an_effect_are_launched_early():
    code = "n = record_effect('start')\nscores = [score(i) for i in range(4)]\nFINAL([n, scores])"
    seq, spec = run_both([fence(code)], latency=0.1)
    assert_same(seq, spec)
    assert spec[0].answer == [1, [1, 2, 5, 10]]
    assert early_claims(spec[0], "score") == (4, 0)


@pytest.mark.parametrize("effect, reader, early", [
    ("transfer(5)", "forecast(3)", True),  # a read of a scope the effect does not write
    ("transfer(5)", "account_balance()", False),  # a read of the scope it writes waits
    ("transfer(5)", "get_balance()", False),  # an undeclared read waits for any effect
    ("deposit(5)", "forecast(3)", False),  # an undeclared effect writes every scope
    ("deposit(5)", "score(3)", True),  # a pure call crosses every effect
])
def test_a_read_after_an_effect_waits_only_for_an_overlapping_scope(effect, reader, early):
    code = f"before = lookup(1)\ne = {effect}\nr = {reader}\nFINAL([before, e, r])"
    seq, spec = run_both([fence(code)], latency=0.1)
    assert_same(seq, spec)
    name = reader.split("(")[0]
    if early:
        assert early_claims(spec[0], name) == (1, 0)
    else:
        assert launches(spec[0], name) == 0 and early_claims(spec[0], name) == (0, 1)
    assert spec[0].answer[2] == seq[0].answer[2]
    if name in ("account_balance", "get_balance"):
        assert spec[0].answer[2] == 5  # the read saw the write


# -- bounded waste -------------------------------------------------------------------------

def test_unfinished_while_loop_launches_at_most_twice_the_calls():
    code = "i = 0\nwhile i < 5:\n    r = lookup(i)\n    i += 1\nFINAL(r)"
    seq, spec = run_both([fence(code)], tps=8)
    assert_same(seq, spec)
    stats = spec[0].stats
    assert stats.launched <= 2 * 5, stats
    assert spec[1].invocations["lookup"] <= 2 * 5


def test_identical_calls_of_a_streaming_for_loop_all_launch_before_it_closes():
    # a repeated key stops the tail's launches only inside a while (no progress); a for loop
    # advances by itself: its five identical calls go out before the loop statement closes
    code = ("votes = []\nfor _ in range(5):\n    votes.append(lookup(1))\nn = len(votes)\n"
            "FINAL(votes)")
    seq, spec = run_both([fence(code)], tps=8, latency=0.5)
    assert_same(seq, spec)
    events = spec[0].trace.events
    closed = next(e.t for e in events if e.kind == "statement_closed" and e.data["lineno"] == 2)
    early = [e.t for e in events if e.kind == "spec_launch" and e.data["tool"] == "lookup"]
    assert len(early) == 5 and max(early) < closed, (early, closed)
    assert spec[0].stats.hits == 5


def test_data_dependent_break_leaves_few_unused_early_calls():
    code = ("found = None\nfor i in range(20):\n    if check(i):\n        found = i\n"
            "        break\nFINAL(found)")
    seq, spec = run_both([fence(code)], tps=12, latency=0.002)
    assert_same(seq, spec)
    stats = spec[0].stats
    assert stats.launched - stats.hits <= 10, stats


def test_fully_parallel_loop_is_still_launched_ahead():
    code = "out = []\nfor i in range(12):\n    out.append(lookup(i))\nFINAL(out)"
    seq, spec = run_both([fence(code)], tps=30, latency=0.3)
    assert_same(seq, spec)
    assert spec[0].stats.hits == 12
    assert spec[0].wall_s < seq[0].wall_s * 0.6


@pytest.mark.parametrize("window", [4, 1])
def test_loop_with_a_data_dependent_break_launches_at_most_the_window_ahead(window):
    # lookup(i) takes longer than the whole block takes to stream, so every launch of the loop
    # goes out before its first result is known: lookup(0..2) are used (17 > 15 breaks), and
    # at most ``window`` more may have been launched ahead of the first unresolved one
    code = ("found = None\nfor i in range(20):\n    d = lookup(i)\n    if d > 15:\n"
            "        found = d\n        break\nFINAL(found)")
    seq, spec = run_both([fence(code)], latency=1.0, speculation_window=window)
    assert_same(seq, spec)
    assert spec[0].answer == lookup_value(2)
    stats = spec[0].stats
    assert stats.launched - stats.hits <= window, stats


def test_parallel_map_is_launched_whole_before_its_results_arrive():
    code = ("out = []\nfor i in range(16):\n    out.append(lookup(i))\nn = len(out)\n"
            "print('calls', n)\nFINAL(out)")
    seq, spec = run_both([fence(code)], latency=0.3)
    assert_same(seq, spec)
    assert spec[0].stats.launched == 16 and spec[0].stats.hits == 16, spec[0].stats


def test_speculation_window_is_checked():
    with pytest.raises(ValueError, match="speculation_window must be an int >= 0, got -1"):
        Agent(ReplayEngine(["x"]), speculation_window=-1)


def test_waste_counts_do_not_depend_on_timing():
    code = ("found = None\nfor i in range(8):\n    if check(i):\n        found = i\n"
            "        break\nFINAL(found)")
    counts = set()
    for _ in range(3):
        _, (spec, _bank) = run_both([fence(code)], tps=30)
        counts.add((spec.stats.launched, spec.stats.hits, spec.stats.wasted,
                    spec.stats.retracted))
    # however many were launched, an unused call is classified by what the program did with its
    # key (check(3)... are never called: retracted), not by which event won a race
    for launched, hits, wasted, retracted in counts:
        assert wasted == 0, counts
        assert retracted == launched - hits, counts


# -- argument size ---------------------------------------------------------------------------

def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@pytest.mark.parametrize("speculation", [False, True])
def test_huge_arguments_get_a_clear_error_and_memory_stays_flat(speculation):
    code = ("s = 'x' * 60_000_000\nerrors = []\nfor _ in range(40):\n    try:\n"
            "        measure(s)\n    except Exception as e:\n"
            "        errors.append(repr(e))\n"
            "big = 'y' * 1_000_000\ntry:\n    measure([big] * 1000)\nexcept Exception as e:\n"
            "    errors.append(repr(e))\n"
            "print(len(errors), errors[0][:200])\nprint(errors[-1][:200])\nFINAL(len(errors))")
    bank = Bank()
    agent = Agent(ReplayEngine([fence(code)], 200), tools=bank.tools(), speculation=speculation,
                  builtin_tools=False, max_turns=1)
    _reset_peak_rss()
    before = _peak_rss_mb()
    result = agent.run_sync("task")
    growth = _peak_rss_mb() - before
    assert result.answer == 41, result.turns[0].output
    output = result.turns[0].output
    assert "ToolError" in output and "bytes" in output
    assert bank.invocations.get("measure", 0) == 0
    assert growth <= 200, f"runtime RSS grew by {growth:.0f} MB"


# -- defence in depth: the REPL refuses real tool calls from shadow forks ----------------------

def test_repl_refuses_tool_calls_from_a_shadow_fork():
    from agentrt.interpreter.repl import Repl

    calls: list[str] = []

    async def handler(name, args, kwargs):
        calls.append(name)
        return 1

    async def main():
        async with Repl(handler, {"act": "act(x)"}) as repl:
            await repl.execute("keep = act")  # a tool proxy bound in the namespace
            messages = repl.messages()
            shadow = await repl.fork_shadow()
            result = await shadow.execute("keep(1)")  # in place, bypassing any shadow logic
            token, refused = messages.receive_nowait()  # the notice came before the reply
            plain = await repl.fork()
            ok = await plain.execute("r = keep(2)")  # waits for no message: none unread
            for handle in (shadow, plain):
                await handle.kill()
            assert token == shadow.token
            with pytest.raises(anyio.WouldBlock):
                messages.receive_nowait()
            messages.close()
            return result, ok, refused

    result, ok, refused = anyio.run(main)
    assert result.error_type == "PermissionError" and "shadow" in result.error
    assert ok.error is None
    assert calls == ["act"]  # only the ordinary fork's call ran
    assert refused == RefusedCall("act")


# -- argument limits, directly ---------------------------------------------------------------

def test_argument_limits_count_shared_references_and_depth():
    from agentrt.interpreter.arg_limits import check_arguments
    from agentrt.interpreter.sandbox import ToolError

    one_mb = "z" * 1_000_000
    assert check_arguments("t", (one_mb,), {}) >= 1_000_000
    with pytest.raises(ToolError, match="16,000,000 bytes"):
        check_arguments("t", ([one_mb] * 1000,), {})
    with pytest.raises(ToolError, match="limit of 3 levels"):
        check_arguments("t", ([[[["deep"]]]],), {}, max_depth=3)
    nested: list = []
    nested.append(nested)  # a cycle is refused by depth, not looped over
    with pytest.raises(ToolError, match="levels"):
        check_arguments("t", (nested,), {})
    assert check_arguments("t", (), {"k": [1, 2, 3]}) < 100


def test_argument_limits_never_force_a_lazy_argument():
    """The shadow checks arguments that may still be unresolved: measuring them must not wait
    for (force) them, or every call that takes an earlier call's result would be serialised."""
    from agentrt.interpreter.arg_limits import check_arguments
    from agentrt.interpreter.lazy_values import _defer

    computed: list[int] = []
    lazy = _defer(lambda: computed.append(1) or "x" * 100, ())
    assert check_arguments("t", (lazy, [lazy]), {"k": lazy}) < 100
    assert computed == []
