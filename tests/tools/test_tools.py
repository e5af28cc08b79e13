"""Tests of the tools package: @tool, Tool, ToolRegistry and the built-in LLM tools."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Annotated

import anyio
import pytest
from pydantic import BaseModel, Field

from agentrt.engine import EngineStreamError, ReplayEngine, SamplingParams
from agentrt.tools import (
    Tool,
    ToolArgumentError,
    ToolDefinitionError,
    ToolError,
    ToolRegistry,
    ToolTimeoutError,
    UnkeyableArgumentsError,
    UnknownToolError,
    tool,
)
from agentrt.llm_tools import make_llm_tools
from agentrt.tools.scopes import ALL_SCOPES, overlaps


@tool
def search(query: str, k: int = 5) -> list[str]:
    """Search the corpus.

    Returns up to ``k`` passages.
    """
    return [f"{query}#{i}" for i in range(k)]


@tool(name="fetch_async", speculate=True, timeout=5, max_concurrency=2, description="Fetch a page.")
async def fetch(url: str, *, retries: int = 0) -> dict[str, str]:
    await anyio.sleep(0)
    return {"url": url, "retries": str(retries)}


class Opaque:
    """A type with no JSON form."""


def invoke(t: Tool, *args, **kwargs):
    return anyio.run(t.invoke, args, kwargs)


# -- decoration ------------------------------------------------------------------------------


def test_decorator_keeps_the_function_callable_and_records_options():
    assert isinstance(search, Tool)
    assert search("q", 2) == ["q#0", "q#1"]  # direct call: the plain function
    assert (search.name, search.speculate, search.timeout, search.max_concurrency, search.is_async) == (
        "search", False, None, None, False)
    assert search.description == "Search the corpus."
    assert search.__name__ == "search" and "Returns up to" in search.__doc__
    assert (fetch.name, fetch.speculate, fetch.timeout, fetch.max_concurrency, fetch.is_async) == (
        "fetch_async", True, 5.0, 2, True)
    assert fetch.description == "Fetch a page."


def test_effect_scopes_default_to_every_scope_and_declared_ones_are_kept():
    def f(x: int) -> int:
        return x

    assert Tool(f, speculate=True).reads == ALL_SCOPES  # unannotated: waits for any effect
    assert Tool(f).writes == ALL_SCOPES  # an effectful tool writes everything unless declared
    pure = Tool(f, speculate=True, pure=True)
    assert pure.pure and pure.reads == frozenset() and pure.writes == frozenset()
    assert Tool(f, speculate=True, reads=["accounts", "fx"]).reads == {"accounts", "fx"}
    assert Tool(f, writes={"accounts"}).writes == {"accounts"}
    assert Tool(f, writes=set()).writes == frozenset()  # an effect no tool can observe
    assert all(t.pure for t in make_llm_tools(ReplayEngine(["x"])))
    assert overlaps(ALL_SCOPES, frozenset({"a"})) and overlaps(frozenset({"a", "b"}),
                                                                frozenset({"b"}))
    assert not overlaps(frozenset({"a"}), frozenset({"b"}))
    assert not overlaps(ALL_SCOPES, frozenset())  # a pure read overlaps nothing


@pytest.mark.parametrize("options, message", [
    ({"speculate": True, "pure": True, "reads": {"a"}}, "pure=True means it depends only"),
    ({"speculate": True, "pure": True, "writes": {"a"}}, "pure=True means it depends only"),
    ({"pure": True}, "pure=True needs speculate=True"),
    ({"speculate": True, "writes": {"a"}}, "a speculatable tool may run early, so it must not"),
    ({"reads": {"a"}}, "reads= applies to speculatable tools only"),
    ({"speculate": True, "reads": "accounts"}, "reads= takes a set of scope names"),
    ({"writes": 3}, "writes= takes a set of scope names"),
    ({"speculate": True, "reads": {"a", 1}}, "scope names must be non-empty strings, got 1"),
    ({"writes": {""}}, "scope names must be non-empty strings"),
    ({"writes": {"*"}}, "'\\*' is reserved"),
])
def test_bad_effect_scopes_fail_at_decoration_naming_the_tool(options, message):
    with pytest.raises(ToolDefinitionError, match=message) as info:
        tool(name="transfer", **options)(lambda: None)
    assert "'transfer'" in str(info.value)


def test_unsupported_definitions_fail_at_decoration_with_clear_errors():
    with pytest.raises(ToolDefinitionError, match=r"'\*args' is not supported"):
        Tool(lambda *args: None, name="anything")
    with pytest.raises(ToolDefinitionError, match=r"'\*\*options' is not supported"):
        @tool
        def f(a: int, **options): ...
    with pytest.raises(ToolDefinitionError, match="identifier"):
        tool(name="not a name")(lambda: None)
    with pytest.raises(ToolDefinitionError, match="identifier"):
        tool(lambda: None)  # a lambda has no usable name
    with pytest.raises(ToolDefinitionError, match="timeout must be a number > 0"):
        tool(name="t", timeout=0)(lambda: None)
    with pytest.raises(ToolDefinitionError, match="max_concurrency must be an int >= 1"):
        tool(name="t", max_concurrency=0)(lambda: None)
    with pytest.raises(ToolDefinitionError, match="can't resolve its type hints"):
        @tool
        def g(x: "UndefinedType"): ...  # noqa: F821, UP037
    with pytest.raises(TypeError, match="takes a function"):
        tool("search")


# -- validation ------------------------------------------------------------------------------


def test_bad_argument_error_names_tool_argument_and_problem():
    with pytest.raises(ToolArgumentError) as info:
        search.bind(("corpus",), {"k": "ten"})
    err = info.value
    assert str(err).startswith("search(): argument 'k': Input should be a valid integer")
    assert str(err).endswith("(got 'ten')")
    assert isinstance(err, TypeError) and isinstance(err, ToolError)
    assert err.tool == "search" and err.problems[0][0] == "k"
    assert pickle.loads(pickle.dumps(err)).problems == err.problems


def test_lax_coercion_like_pydantic():
    assert search.bind(("q", "3")) == {"query": "q", "k": 3}
    assert search.bind(("q",), {"k": 3.0}) == {"query": "q", "k": 3}
    with pytest.raises(ToolArgumentError, match="argument 'k'"):
        search.bind(("q", 3.5))
    with pytest.raises(ToolArgumentError, match="argument 'query': Input should be a valid string"):
        search.bind((42,))


def test_nested_errors_point_into_the_argument():
    @tool
    def total(values: list[int]) -> int:
        return sum(values)

    with pytest.raises(ToolArgumentError, match=r"total\(\): argument 'values\[1\]': .*integer.*\(got 'x'\)"):
        total.bind(([1, "x"],))


def test_missing_unexpected_and_duplicate_arguments():
    with pytest.raises(ToolArgumentError, match=r"^search\(\): argument 'query': missing required argument$"):
        search.bind(())
    with pytest.raises(ToolArgumentError, match=r"argument 'limit': unexpected keyword argument"):
        search.bind(("q",), {"limit": 3})
    with pytest.raises(ToolArgumentError, match=r"argument 'query': got multiple values"):
        search.bind(("q",), {"query": "again"})
    with pytest.raises(ToolArgumentError, match=r"search\(\): takes 2 positional arguments but 3 were given"):
        search.bind(("q", 1, 2))
    only_missing = r"^fetch_async\(\): argument 'url': missing required argument$"
    with pytest.raises(ToolArgumentError, match=only_missing):
        fetch.bind((), {"retries": "x"})  # arity problems are reported before values are checked
    too_many = r"fetch_async\(\): takes 1 positional argument but 2 were given"
    with pytest.raises(ToolArgumentError, match=too_many):
        fetch.bind(("u", 1))  # `retries` is keyword-only


def test_positional_only_keyword_only_and_reserved_parameter_names():
    @tool
    def weird(json: int, /, model_config: str = "a", *, _private: float = 1.0) -> tuple:
        return json, model_config, _private

    assert weird.bind(("1",), {"_private": "2"}) == {"json": 1, "model_config": "a", "_private": 2.0}
    with pytest.raises(ToolArgumentError, match="'json': positional-only argument passed by keyword"):
        weird.bind((), {"json": 1})
    assert invoke(weird, "4", _private=0) == (4, "a", 0.0)


# -- invoking --------------------------------------------------------------------------------


def test_invoke_validates_then_runs_sync_and_async_tools():
    assert invoke(search, "q", k="2") == ["q#0", "q#1"]
    assert invoke(fetch, "http://x", retries="3") == {"url": "http://x", "retries": "3"}
    with pytest.raises(ToolArgumentError):
        invoke(search, "q", k="two")


def test_sync_tools_run_in_a_worker_thread():
    @tool
    def where() -> int:
        return threading.get_ident()

    assert invoke(where) != threading.get_ident()


def test_wrappers_of_coroutine_functions_are_awaited():
    async def double(x: int) -> int:
        return 2 * x

    def sync_wrapper(x: int):
        return double(x)

    assert invoke(Tool(sync_wrapper), "2") == 4
    rewrapped = Tool(fetch, name="fetch_again")
    assert rewrapped.is_async and invoke(rewrapped, "u") == {"url": "u", "retries": "0"}


def test_exceptions_raised_by_the_tool_propagate_unchanged():
    boom = KeyError("boom")

    @tool(timeout=5)
    def fails() -> None:
        raise boom

    @tool(timeout=5)
    async def times_out_itself() -> None:
        raise TimeoutError("the tool's own timeout")

    with pytest.raises(KeyError) as info:
        invoke(fails)
    assert info.value is boom
    with pytest.raises(TimeoutError, match="own timeout") as info:
        invoke(times_out_itself)
    assert not isinstance(info.value, ToolTimeoutError)


def test_timeout_of_a_hanging_sync_tool_returns_promptly():
    release = threading.Event()
    finished = threading.Event()

    @tool(timeout=0.2)
    def hang() -> None:
        release.wait(30)
        finished.set()

    start = time.monotonic()
    try:
        with pytest.raises(ToolTimeoutError, match=r"hang\(\) timed out after 0.2 s") as info:
            invoke(hang)
        assert time.monotonic() - start < 10  # coarse: far below the thread's 30 s wait
        assert isinstance(info.value, TimeoutError) and info.value.timeout == 0.2
        assert not finished.is_set()  # the thread was abandoned, still running
    finally:
        release.set()
    assert finished.wait(10)


def test_timeout_of_a_hanging_async_tool():
    @tool(timeout=0.1)
    async def hang() -> None:
        await anyio.sleep(30)

    start = time.monotonic()
    with pytest.raises(ToolTimeoutError, match="hang"):
        invoke(hang)
    assert time.monotonic() - start < 10


def concurrency_peak(max_concurrency: int | None, is_async: bool, target: int, calls: int = 9) -> int:
    """Run ``calls`` concurrent invocations; each stays inside until ``target`` calls were inside
    at once (or 5 s passed), then a little longer. Return the most that were inside at once."""
    active = 0
    peak = 0
    lock = threading.Lock()

    def enter() -> None:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)

    def leave() -> None:
        nonlocal active
        with lock:
            active -= 1

    async def work_async(i: int) -> int:
        enter()
        deadline = time.monotonic() + 5
        while peak < target and time.monotonic() < deadline:
            await anyio.sleep(0.005)
        await anyio.sleep(0.02)
        leave()
        return i

    def work_sync(i: int) -> int:
        enter()
        deadline = time.monotonic() + 5
        while peak < target and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)
        leave()
        return i

    limited = Tool(work_async if is_async else work_sync, name="work", max_concurrency=max_concurrency)

    async def main() -> list[int]:
        results = [None] * calls

        async def one(i: int) -> None:
            results[i] = await limited.invoke((i,))

        async with anyio.create_task_group() as group:
            for i in range(calls):
                group.start_soon(one, i)
        return results

    assert anyio.run(main) == list(range(calls))
    return peak


@pytest.mark.parametrize("is_async", [True, False])
def test_max_concurrency_limits_calls_in_flight(is_async):
    assert concurrency_peak(3, is_async, target=3) == 3
    assert concurrency_peak(1, is_async, target=1) == 1
    assert concurrency_peak(None, is_async, target=9) == 9  # without a limit they overlap freely


def test_limiter_is_shared_by_all_calls_across_event_loops():
    @tool(max_concurrency=1)
    async def slow(i: int) -> int:
        await anyio.sleep(0.01)
        return i

    async def main() -> list[int]:
        out = []
        async with anyio.create_task_group() as group:
            for i in range(3):
                group.start_soon(lambda i=i: _append(out, slow, i))
        return sorted(out)

    assert anyio.run(main) == [0, 1, 2]
    assert anyio.run(main) == [0, 1, 2]  # the same tool in a second event loop


async def _append(out: list, t: Tool, i: int) -> None:
    out.append(await t.invoke((i,)))


# -- describing ------------------------------------------------------------------------------


def test_signature_line():
    assert search.signature_line() == "search(query: str, k: int = 5) -> list[str]  # Search the corpus."
    assert fetch.signature_line() == (
        "fetch_async(url: str, *, retries: int = 0) -> dict[str, str]  # Fetch a page.")

    def plain(a, /, b=2, *, c: "int | None" = None):  # noqa: UP037 - a quoted hint on purpose
        pass

    assert Tool(plain).signature_line() == "plain(a, /, b=2, *, c: int | None = None)"

    @tool
    def annotated(n: Annotated[int, Field(ge=0, description="How many.")] = 1) -> None:
        """Do it."""

    assert annotated.signature_line() == "annotated(n: int = 1) -> None  # Do it."


def test_json_schema_is_openai_function_style():
    schema = search.json_schema()
    assert schema == {
        "name": "search",
        "description": "Search the corpus.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"title": "Query", "type": "string"},
                "k": {"title": "K", "type": "integer", "default": 5},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    }

    @tool
    def annotated(n: Annotated[int, Field(ge=0, description="How many.")], thing: Opaque = None):
        pass

    properties = annotated.json_schema()["parameters"]["properties"]
    assert properties["n"]["minimum"] == 0 and properties["n"]["description"] == "How many."
    assert properties["thing"] == {"default": None, "title": "Thing"}  # no JSON form: anything
    with pytest.raises(ToolArgumentError, match="greater than or equal to 0"):
        annotated.bind((-1,))


def test_call_key_is_canonical():
    @tool
    def f(x: int, k: int = 2, tags: list[str] | None = None) -> None:
        pass

    key = f.call_key((1,), {"k": 2})
    assert key == f.call_key((), {"x": 1, "k": 2}) == f.call_key(("1", 2)) == f.call_key((1,))
    assert key == '{"args":{"k":2,"tags":null,"x":1},"tool":"f"}'
    assert f.call_key((1, 3)) != key
    assert f.call_key((1,), {"tags": ["a"]}) == f.call_key((1,), {"tags": ("a",)})  # validated to list
    assert search.call_key(("x",)) != f.call_key((1,))


def test_call_key_keeps_types_apart_for_untyped_arguments():
    @tool
    def g(value):
        pass

    keys = {g.call_key((v,)) for v in
            [1, 1.0, "1", True, None, [1, 2], (1, 2), {1, 2}, {"a": 1, "b": 2}, {"b": 2, "a": 1}, b"1"]}
    assert len(keys) == 11
    assert g.call_key(({2, 1},)) == g.call_key(({1, 2},))

    class Point(BaseModel):
        x: int

    assert g.call_key((Point(x=1),)) == g.call_key((Point(x=1),)) != g.call_key((Point(x=2),))
    with pytest.raises(UnkeyableArgumentsError, match=r"g\(\): argument 'value'"):
        g.call_key((object(),))


# -- registry --------------------------------------------------------------------------------


def test_registry_holds_tools_by_name():
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    registry = ToolRegistry([search, fetch])
    added = registry.register(add)
    assert isinstance(added, Tool) and added.speculate is False
    assert registry.names() == ["search", "fetch_async", "add"]
    assert [t.name for t in registry] == registry.names() and len(registry) == 3
    assert "add" in registry and search in registry and "nope" not in registry
    assert registry.get("search") is search
    assert registry.render_signatures().splitlines() == [
        "search(query: str, k: int = 5) -> list[str]  # Search the corpus.",
        "fetch_async(url: str, *, retries: int = 0) -> dict[str, str]  # Fetch a page.",
        "add(a: int, b: int) -> int  # Add two numbers.",
    ]
    assert [s["name"] for s in registry.json_schemas()] == registry.names()
    assert anyio.run(registry.call, "add", ("2",), {"b": 3}) == 5


def test_registry_errors():
    registry = ToolRegistry([search])
    with pytest.raises(ToolDefinitionError, match="'search' is already registered"):
        registry.register(Tool(lambda q: q, name="search"))
    with pytest.raises(UnknownToolError, match=r"no tool named 'serch'; known tools: search") as info:
        registry.get("serch")
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownToolError):
        anyio.run(registry.call, "serch", ())

    @registry.register
    def later(x: int) -> int:
        return x

    assert isinstance(later, Tool) and "later" in registry


# -- built-in LLM tools ------------------------------------------------------------------------


class CountingReplay(ReplayEngine):
    """A ReplayEngine that records how many of its streams run at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active = 0
        self.peak = 0

    async def stream(self, messages, params=None):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            async for delta in super().stream(messages, params):
                yield delta
        finally:
            self.active -= 1


def reply(messages) -> str:
    """Answer ``"q<n>"`` with a reply whose length shrinks as n grows (later prompts finish first)."""
    (message,) = messages
    assert message["role"] == "user"
    n = int(message["content"][1:])
    return f"answer to {message['content']}:" + " x" * (12 - n)


def test_llm_query_asks_the_engine():
    engine = ReplayEngine(reply, tokens_per_second=5000)
    llm_query, llm_query_batched = make_llm_tools(engine)
    assert (llm_query.name, llm_query_batched.name) == ("llm_query", "llm_query_batched")
    assert llm_query.speculate and llm_query_batched.speculate and llm_query.is_async
    assert llm_query.signature_line().startswith("llm_query(prompt: str) -> str  # ")
    assert anyio.run(llm_query.invoke, ("q3",)) == reply([{"role": "user", "content": "q3"}])
    with pytest.raises(ToolArgumentError, match="llm_query_batched"):
        anyio.run(llm_query_batched.invoke, ("not a list of prompts", ))


def test_llm_query_batched_runs_concurrently_and_keeps_input_order():
    engine = CountingReplay(reply, tokens_per_second=400)
    _, batched = make_llm_tools(engine)
    prompts = [f"q{i}" for i in range(8)]
    replies = anyio.run(batched.invoke, (prompts,))
    assert replies == [reply([{"role": "user", "content": p}]) for p in prompts]
    assert engine.peak == 8
    assert anyio.run(batched.invoke, ([],)) == []


def test_max_concurrency_bounds_generations_across_both_tools():
    engine = CountingReplay(reply, tokens_per_second=400)
    llm_query, batched = make_llm_tools(engine, max_concurrency=2)
    assert llm_query.max_concurrency == 2

    async def main():
        async with anyio.create_task_group() as group:
            group.start_soon(batched.invoke, ([f"q{i}" for i in range(5)],))
            for i in range(3):
                group.start_soon(llm_query.invoke, (f"q{i}",))

    anyio.run(main)
    assert engine.peak == 2 and engine.calls == 8


def test_sampling_params_reach_the_engine():
    engine = ReplayEngine(lambda messages: "one two three four five", tokens_per_second=5000)
    llm_query, _ = make_llm_tools(engine, params=SamplingParams(max_tokens=2))
    assert anyio.run(llm_query.invoke, ("q",)) == "one two"


def test_a_failing_prompt_raises_the_engine_error_itself():
    engine = ReplayEngine(reply, tokens_per_second=2000, fail_at={1: 3})
    _, batched = make_llm_tools(engine)
    with pytest.raises(EngineStreamError, match="scripted failure"):
        anyio.run(batched.invoke, (["q0", "q1", "q2"],))
