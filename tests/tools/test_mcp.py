"""MCP tools against a real MCP server (tests/tools/mcp_server.py) in a subprocess, over stdio
and streamable HTTP, through the tool layer and through real `Agent` runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp", reason="the mcp package is not installed (pip install 'agentrt[mcp]')")

from mcp.types import Tool as MCPToolSpec  # noqa: E402

from agentrt import Agent, ReplayEngine  # noqa: E402
from agentrt.tools import ToolArgumentError, ToolError  # noqa: E402
from agentrt.tools.mcp import (  # noqa: E402
    MCPConnectionError,
    MCPToolError,
    mcp_tools,
    python_name,
    tool_from_mcp,
)

SERVER = Path(__file__).with_name("mcp_server.py")


def stdio_command(log: Path) -> list[str]:
    return [sys.executable, str(SERVER), "stdio", str(log)]


def calls(log: Path) -> list[tuple[str, dict]]:
    if not log.exists():
        return []
    return [(c["tool"], c["args"]) for c in map(json.loads, log.read_text().splitlines())]


@pytest.fixture
def http_server(tmp_path):
    """The same server over streamable HTTP on a loopback port; yields (url, log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "http.log"
    proc = subprocess.Popen([sys.executable, str(SERVER), "http", str(port), str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"MCP test server did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}/mcp", log
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run(async_fn):
    return anyio.run(async_fn)


# -- the tool layer ------------------------------------------------------------------------


def test_tools_schemas_and_speculation_policy(tmp_path):
    async def main():
        async with mcp_tools(stdio_command(tmp_path / "log")) as tools:
            return {t.name: (t.speculate, t.signature_line()) for t in tools}

    tools = run(main)
    assert set(tools) == {"population", "delete_city", "note", "search", "square", "shout",
                          "get_weather", "broken"}
    assert tools["population"] == (True, "population(city: str) -> int  # Population of a "
                                         "city, in thousands.")
    assert tools["delete_city"][0] is False  # readOnlyHint false, destructive
    assert tools["note"][0] is False  # no annotations: never early
    assert tools["search"][1].startswith(
        "search(query: str, k: int = 3, mode: Literal['fast', 'exact'] = 'fast') -> list[str]")


def test_speculate_override_and_unknown_names(tmp_path):
    async def main():
        async with mcp_tools(stdio_command(tmp_path / "log"),
                             speculate={"population": False, "note": True}) as tools:
            return {t.name: t.speculate for t in tools}

    policy = run(main)
    assert policy["population"] is False and policy["note"] is True

    async def unknown():
        async with mcp_tools(stdio_command(tmp_path / "log"), speculate={"nope": True}):
            pass

    with pytest.raises(ToolError, match="'nope'.*population"):
        run(unknown)


def test_arguments_validated_before_sending_and_results_converted(tmp_path):
    log = tmp_path / "log"

    async def main():
        async with mcp_tools(stdio_command(log)) as tools:
            by = {t.name: t for t in tools}
            out = {
                "text": await by["shout"].invoke(("hi",)),
                "int": await by["population"].invoke((), {"city": "Oslo"}),
                "structured": await by["square"].invoke(("7",)),  # lax: "7" -> 7
                "list": await by["search"].invoke(("abc",), {"k": 2}),
                "optional": await by["get_weather"].invoke(("Rome",)),
            }
            for args, kwargs in ((("a",), {}), (("abc",), {"mode": "slow"}), ((), {"k": 1})):
                with pytest.raises(ToolArgumentError) as info:
                    await by["search"].invoke(args, kwargs)
                out.setdefault("errors", []).append(str(info.value))
            return out

    out = run(main)
    assert out["text"] == "HI!"
    assert out["int"] == 700  # the SDK's {"result": 700} wrapper is unwrapped
    assert out["structured"] == {"n": 7, "square": 49}
    assert out["list"] == ["fast:abc:0", "fast:abc:1"]
    assert out["optional"] == "sunny in Rome for 1 day(s)"
    assert "argument 'query': String should have at least 2 characters" in out["errors"][0]
    assert "argument 'mode'" in out["errors"][1]
    assert "argument 'query': missing required argument" in out["errors"][2]
    sent = calls(log)
    assert ("square", {"n": 7}) in sent
    assert [c for c in sent if c[0] == "search"] == [("search", {"query": "abc", "k": 2,
                                                                 "mode": "fast"})]


def test_is_error_becomes_tool_error(tmp_path):
    async def main():
        async with mcp_tools(stdio_command(tmp_path / "log")) as tools:
            broken = next(t for t in tools if t.name == "broken")
            await broken.invoke(("disk full",))

    with pytest.raises(MCPToolError, match="broken on purpose: disk full") as info:
        run(main)
    assert isinstance(info.value, ToolError)


def test_connection_errors_are_clear(tmp_path):
    async def missing_command():
        async with mcp_tools("definitely-not-an-mcp-server-binary --flag"):
            pass

    with pytest.raises(MCPConnectionError, match="definitely-not-an-mcp-server-binary"):
        run(missing_command)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed

    async def nobody_listening():
        async with mcp_tools(url=f"http://127.0.0.1:{port}/mcp"):
            pass

    with pytest.raises(MCPConnectionError, match=f"127.0.0.1:{port}"):
        run(nobody_listening)
    with pytest.raises(ValueError, match="exactly one"):
        run(lambda: mcp_tools().__aenter__())


def test_names_and_schemas_without_a_server():
    assert python_name("get-weather") == "get_weather"
    assert python_name("class") == "class_"
    assert python_name("2d.plot") == "_2d_plot"
    sent = []

    async def call(name, arguments):
        sent.append((name, arguments))
        from mcp.types import CallToolResult, TextContent

        return CallToolResult(content=[TextContent(type="text", text="ok")])

    spec = MCPToolSpec(name="make-item", description="Create an item.", input_schema={
        "type": "object",
        "properties": {
            "item": {"$ref": "#/$defs/Item"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "from": {"type": ["integer", "null"], "minimum": 0},
        },
        "required": ["item"],
        "$defs": {"Item": {"type": "object", "title": "Item",
                           "properties": {"name": {"type": "string"}, "size": {"type": "number"}},
                           "required": ["name"]}},
    })
    t = tool_from_mcp(spec, call)
    assert t.name == "make_item" and t.speculate is False
    assert run(lambda: t.invoke(({"name": "box", "size": "2"},), {"from_": 3})) == "ok"
    # nested objects stay dicts (validated, coerced); Python names map back to the wire names
    assert sent == [("make-item", {"item": {"name": "box", "size": 2.0}, "from": 3})]
    for args, kwargs, problem in (
        (({"size": 1},), {}, "item.name"),
        (({"name": "b"},), {"tags": ["a", "b", "c"]}, "tags"),
        (({"name": "b"},), {"from_": -1}, "from_"),
    ):
        with pytest.raises(ToolArgumentError, match=problem):
            t.bind(args, kwargs)


# -- through the agent ---------------------------------------------------------------------

PROGRAM = '''```repl
a = population("Paris")
b = population("Oslo")
gone = delete_city("Rome")
c = population("Lima")
# the model keeps writing while the early calls run
# one more comment line
FINAL(a + b + c)
```'''


def run_agent(connect, speculation: bool):
    async def main():
        async with connect() as tools:
            agent = Agent(ReplayEngine([PROGRAM], tokens_per_second=25), tools=tools,
                          speculation=speculation, builtin_tools=False)
            return await agent.run("t")

    return run(main)


def check_agent_run(result, log: Path, speculation: bool):
    assert result.status == "final" and result.answer == 2100 + 700 + 9700
    order = [(tool, args["city"]) for tool, args in calls(log)]
    # the server saw the reads written before the destructive call first, and nothing after it
    assert sorted(order[:2]) == [("population", "Oslo"), ("population", "Paris")]
    assert order[2:] == [("delete_city", "Rome"), ("population", "Lima")]
    events = result.trace.events
    early = [e for e in events if e.kind == "tool_started" and e.data["mode"] == "early"]
    assert all(e.data["tool"] == "population" for e in early)  # destructive: never early
    if speculation:
        closed = next(e.t for e in events if e.kind == "block_closed")
        assert sorted(c.data.get("tool") for c in early if c.t < closed) == ["population"] * 2
        assert result.stats.hits == 2
    else:
        assert not early and result.stats.launched == 0


@pytest.mark.parametrize("speculation", [True, False])
def test_agent_stdio_read_only_tools_early_destructive_never(tmp_path, speculation):
    log = tmp_path / "log"
    result = run_agent(lambda: mcp_tools(stdio_command(log)), speculation)
    check_agent_run(result, log, speculation)


def test_agent_http_read_only_tools_early_destructive_never(http_server):
    url, log = http_server
    result = run_agent(lambda: mcp_tools(url=url), True)
    check_agent_run(result, log, True)


def test_agent_sees_tool_errors_in_its_code(tmp_path):
    code = ('```repl\ntry:\n    broken("quota")\nexcept Exception as exc:\n'
            '    print("caught", exc)\nFINAL(shout("done"))\n```')

    async def main():
        async with mcp_tools(stdio_command(tmp_path / "log")) as tools:
            agent = Agent(ReplayEngine([code], tokens_per_second=500), tools=tools,
                          builtin_tools=False)
            return await agent.run("t")

    result = run(main)
    assert result.answer == "DONE!"
    assert "caught" in result.turns[0].output and "broken on purpose: quota" in result.turns[0].output
