"""Fault injection against whole runs: engines that raise anything in turn 2, an OpenAI-compatible
server (real HTTP on 127.0.0.1) sending malformed chunks, faulty tools (raise, hang, cancelled,
SystemExit, unpicklable results). Each run ends with a `RunResult` whose ``error`` says what
failed and where, its trace complete, and the runtime serves a second run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest

from agentrt import Agent, ReplayEngine, tool
from agentrt.engine import BaseEngine, Delta, EngineStreamError, Message, SamplingParams

from benchmarks.openai_stub import Raw, Stream, StubServer, chunk, engine_for

FAST = 2000.0


def block(code: str) -> str:
    return f"```repl\n{code.strip()}\n```"


@tool
def double(x: int) -> int:
    """Twice x."""
    return 2 * x


class FaultyEngine(BaseEngine):
    """Replays ``responses``; call number ``fail_call`` raises ``error`` after ``after`` deltas."""

    name = "faulty"

    def __init__(self, responses: list[str], error: BaseException, fail_call: int = 1,
                 after: int = 3) -> None:
        self.replay = ReplayEngine(responses, tokens_per_second=FAST)
        self.error, self.fail_call, self.after = error, fail_call, after

    async def stream(self, messages: Sequence[Message],
                     params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        failing = self.replay.calls == self.fail_call
        sent = 0
        async for delta in self.replay.stream(messages, params):
            if failing and sent == self.after:
                raise self.error
            sent += 1
            yield delta


def assert_clean_error(result, *fragments: str) -> None:
    """The run ended with an error naming every fragment, and its trace is whole."""
    assert result.status == "error", (result.status, result.error)
    for fragment in fragments:
        assert fragment in result.error, (fragment, result.error)
    kinds = [e.kind for e in result.trace.events]
    assert kinds[0] == "run_started" and kinds[-2:] == ["run_error", "run_finished"]
    assert result.trace.events[-1].data["status"] == "error"
    assert all(turn.finished_s >= turn.started_s for turn in result.turns)


SECOND_RUN = [block("FINAL(double(21))")]


@pytest.mark.parametrize("error", [
    RuntimeError("boom"), ConnectionResetError(104, "Connection reset by peer"),
    KeyError("missing"), ValueError("bad value"), AttributeError("'NoneType' has no 'get'"),
], ids=lambda e: type(e).__name__)
def test_an_engine_raising_anything_in_turn_2_ends_the_run_with_an_error(error):
    responses = [block("x = double(1)\nprint(x)"), block("y = x + 1\nFINAL(y)"), *SECOND_RUN]
    engine = FaultyEngine(responses, error, fail_call=1)
    agent = Agent(engine, tools=[double], speculation=False)
    result = agent.run_sync("t")
    assert_clean_error(result, "turn 1, engine 'faulty'", type(error).__name__, str(error))
    assert result.exception is error
    assert len(result.turns) == 2 and result.turns[0].output == "2\n"
    assert result.turns[1].response  # the text streamed before the failure is kept
    again = agent.run_sync("t")
    assert again.status == "final" and again.answer == 42


def test_an_engine_raising_at_once_with_speculation_on():
    responses = [block("a = double(2)\nprint(a)"), block("FINAL(a)"), *SECOND_RUN]
    engine = FaultyEngine(responses, RuntimeError("no stream"), fail_call=1, after=0)
    agent = Agent(engine, tools=[double], speculation=True)
    result = agent.run_sync("t")
    assert_clean_error(result, "turn 1, engine 'faulty'", "RuntimeError: no stream")
    assert agent.run_sync("t").answer == 42


def test_an_engine_yielding_something_else_than_deltas_is_an_engine_error():
    class Strings(BaseEngine):
        name = "strings"

        async def stream(self, messages, params=None):
            yield "not a delta"

    result = Agent(Strings(), speculation=False).run_sync("t")
    assert_clean_error(result, "turn 0, engine 'strings'", "TypeError", "not a Delta")


@pytest.fixture
def server():
    with StubServer() as fake:
        yield fake


@pytest.mark.parametrize("fields, problem", [
    ({"choices": [None]}, "choices[0] must be an object"),
    ({"choices": "oops"}, "'choices' must be a list"),
    ({"choices": [{"index": 0, "delta": {"content": 123}}]}, "delta.content must be a string"),
    ({"choices": [], "usage": {"prompt_tokens": "n/a", "completion_tokens": 1}},
     "usage.prompt_tokens"),
], ids=["null-choice", "choices-str", "content-int", "usage-str"])
def test_malformed_chunks_from_an_openai_server_end_the_run_with_an_error(server, fields, problem):
    first = "```repl\nx = double(3)\nprint(x)\n```"
    server.push(Stream([first]), Raw([chunk("```re"), chunk(**fields), "data: [DONE]\n\n"]),
                Stream([block("FINAL(double(21))")]))
    engine = engine_for(server)
    agent = Agent(engine, tools=[double], speculation=False)
    result = agent.run_sync("t")
    assert_clean_error(result, "turn 1, engine 'openai'", "EngineStreamError", server.url, problem)
    assert isinstance(result.exception, EngineStreamError)
    assert result.turns[0].output == "6\n"
    again = agent.run_sync("t")
    assert again.status == "final" and again.answer == 42


def test_llm_query_on_a_faulty_server_shows_the_model_a_clear_error(server):
    server.push(Raw([chunk(choices=[None]), "data: [DONE]\n\n"]))
    code = "try:\n    llm_query('hi')\nexcept Exception as e:\n    print(repr(e))\nFINAL('done')"
    engine = ReplayEngine([block(code)], tokens_per_second=FAST)
    sub = engine_for(server)
    result = Agent(engine, sub_engine=sub, speculation=False).run_sync("t")
    assert result.status == "final"
    printed = result.turns[0].output
    assert "choices[0] must be an object" in printed and server.url in printed
    assert "AttributeError" not in printed


# -------------------------------------------------------------------------- faulty tools

@tool
async def cancels_itself() -> int:
    """Raises CancelledError although nothing cancelled it."""
    raise asyncio.CancelledError()


@tool
async def awaits_a_cancelled_task() -> int:
    """Awaits a task that something else cancelled."""
    task = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    return await task


@tool
def sync_cancels() -> int:
    """A sync tool raising CancelledError."""
    raise asyncio.CancelledError("from a thread")


@tool
def exits() -> int:
    """Calls sys.exit."""
    raise SystemExit(3)


@tool
def raises() -> int:
    """An ordinary failure."""
    raise ValueError("tool failed")


@tool
def unpicklable() -> object:
    """Returns something that cannot cross to the sandbox."""
    return lambda: None


@pytest.mark.parametrize("faulty", [cancels_itself, awaits_a_cancelled_task, sync_cancels, exits],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("speculation", [False, True], ids=["plain", "speculation"])
def test_a_tool_raising_cancelled_or_exit_is_that_calls_error(faulty, speculation):
    name = faulty.name
    code = f"try:\n    {name}()\nexcept RuntimeError as e:\n    print('caught', e)\nprint(double(4))"
    responses = [block(code), block(f"{name}()"), block("FINAL(double(5))"), *SECOND_RUN]
    agent = Agent(ReplayEngine(responses, tokens_per_second=FAST), tools=[faulty, double],
                  speculation=speculation)
    result = agent.run_sync("t")
    assert result.status == "final" and result.answer == 10, result.error
    printed = result.turns[0].output
    assert printed.startswith("caught") and f"{name}() raised" in printed
    assert ("nothing cancelled the call" in printed or "may not end the process" in printed)
    assert printed.endswith("8\n")
    assert f"{name}() raised" in result.turns[1].error  # uncaught: the cell's error, run goes on
    again = agent.run_sync("t")
    assert again.status == "final" and again.answer == 42


def test_faulty_tools_one_after_another_leave_the_run_working():
    calls = [raises, unpicklable, cancels_itself, exits]
    responses = [block(f"{t.name}()") for t in calls] + [block("FINAL(double(21))")]
    agent = Agent(ReplayEngine(responses, tokens_per_second=FAST), tools=[*calls, double],
                  speculation=False, max_turns=len(responses))
    result = agent.run_sync("t")
    assert result.status == "final" and result.answer == 42
    errors = [turn.error for turn in result.turns[:4]]
    assert "tool failed" in errors[0]
    assert "cannot receive" in errors[1]
    assert "cancels_itself() raised CancelledError" in errors[2]
    assert "exits() raised SystemExit(3)" in errors[3]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_hanging_tool_times_out_by_the_agent_default(is_async):
    if is_async:
        @tool
        async def hangs() -> int:
            """Never returns."""
            await asyncio.sleep(3600)
    else:
        @tool
        def hangs() -> int:
            """Never returns (its thread is abandoned)."""
            time.sleep(3600)

    responses = [block("try:\n    hangs()\nexcept TimeoutError as e:\n    print('timeout:', e)\n"
                       "FINAL(double(1))")]
    agent = Agent(ReplayEngine(responses, tokens_per_second=FAST), tools=[hangs, double],
                  speculation=False, tool_timeout=0.5)
    result = agent.run_sync("t")
    assert result.status == "final" and result.answer == 2
    assert "timeout: hangs() timed out after 0.5 s" in result.turns[0].output


# ----------------------------------------------------- faults of the sandbox and the shadow

def test_a_sandbox_failure_ends_the_run_with_an_error(monkeypatch):
    from agentrt.interpreter.repl import Repl

    real = Repl.execute

    async def broken(self, code, **kw):
        if "boom" in code:
            raise OSError("the sandbox socket is gone")
        return await real(self, code, **kw)

    monkeypatch.setattr(Repl, "execute", broken)
    responses = [block("x = 1"), block("boom = 2"), *SECOND_RUN]
    agent = Agent(ReplayEngine(responses, tokens_per_second=FAST), tools=[double],
                  speculation=False)
    result = agent.run_sync("t")
    assert_clean_error(result, "turn 1, block 0, sandbox", "OSError: the sandbox socket is gone")
    assert result.turns[1].blocks[0].error == result.error
    assert agent.run_sync("t").answer == 42


def test_a_shadow_failure_ends_the_run_with_an_error(monkeypatch):
    from agentrt.speculation import Speculator

    def broken(self, *args):
        raise RuntimeError("the shadow broke")

    monkeypatch.setattr(Speculator, "statement_closed", broken)
    agent = Agent(ReplayEngine([block("y = double(2)\nFINAL(y)")], tokens_per_second=FAST),
                  tools=[double], speculation=True)
    result = agent.run_sync("t")
    assert_clean_error(result, "turn 0: RuntimeError: the shadow broke")
    assert isinstance(result.exception, RuntimeError)


@pytest.mark.anyio
async def test_the_callers_cancellation_propagates_and_closes_the_trace():
    seen = []
    slow = ReplayEngine([block("x = 1\n" * 200), *SECOND_RUN], tokens_per_second=40)
    agent = Agent(slow, tools=[double], speculation=True, on_event=lambda e: seen.append(e))
    with anyio.move_on_after(0.5) as scope:
        await agent.run("t")
    assert scope.cancelled_caught
    assert seen[-1].kind == "run_finished" and seen[-1].data["status"] == "cancelled"
    again = await agent.run("t")
    assert again.status == "final" and again.answer == 42


class Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text for this one")


@tool
def unprintable_error() -> int:
    """Raises an exception whose str() raises."""
    raise Unprintable()


def test_a_broken_listener_or_an_unprintable_tool_error_does_not_stop_the_run(caplog):
    def listener(event):
        if event.kind in ("delta", "run_finished"):
            raise RuntimeError("the display broke")

    responses = [block("try:\n    unprintable_error()\nexcept Exception as e:\n    print(e)\n"
                       "FINAL(double(3))")]
    agent = Agent(ReplayEngine(responses, tokens_per_second=FAST),
                  tools=[unprintable_error, double], speculation=False, on_event=listener)
    result = agent.run_sync("t")
    assert result.status == "final" and result.answer == 6
    assert "unprintable_error() raised Unprintable (its str() raised ValueError)" in \
        result.turns[0].output
    finished = [e for e in result.trace.events if e.kind == "tool_finished"]
    assert finished and "Unprintable" in finished[0].data["error"]
    assert "the on_event listener failed" in caplog.text
