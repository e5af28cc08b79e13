"""The sandboxed REPL: real worker processes on a real Unix socket."""

from __future__ import annotations

import os
import pickle
import signal
import struct
import time

import anyio
import pytest

from agentrt.interpreter import Repl, ReplError, ReplLimits, ReplProcessDied
from agentrt.interpreter.protocol import ProtocolError, decode_untrusted, to_plain

pytestmark = pytest.mark.anyio

TOOLS = {
    "add": "add(a: int, b: int) -> int",
    "echo": "echo(*args, **kwargs) -> dict",
    "fail": "fail(message: str) -> None",
    "quota": "quota() -> None",
    "slow": "slow(seconds: float) -> str",
    "pair": "pair(label: str) -> str",
}


class QuotaExceeded(Exception):
    """Not a builtin exception type: reaches the sandbox as ToolError."""


class Tools:
    """A real async tool handler that records what it saw."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.cancelled: list[str] = []
        self.pair_waiting = 0
        self.pair_event: anyio.Event | None = None

    async def __call__(self, name: str, args: tuple, kwargs: dict):
        self.calls.append((name, args, kwargs))
        if name == "add":
            return args[0] + args[1]
        if name == "echo":
            return {"args": list(args), "kwargs": kwargs}
        if name == "fail":
            raise ValueError(args[0])
        if name == "quota":
            raise QuotaExceeded("daily quota used up")
        if name == "slow":
            try:
                await anyio.sleep(args[0])
            except anyio.get_cancelled_exc_class():
                self.cancelled.append(name)
                raise
            return "done"
        if name == "pair":  # returns only once two calls are in flight together
            if self.pair_event is None:
                self.pair_event = anyio.Event()
            self.pair_waiting += 1
            if self.pair_waiting == 2:
                self.pair_event.set()
            with anyio.fail_after(20):
                await self.pair_event.wait()
            return f"paired {args[0]}"
        raise LookupError(name)



def repl(tools: Tools | None = None, **limits) -> Repl:
    settings = {"cpu_s": 2, "wall_s": 30, **limits}
    return Repl(tools or Tools(), TOOLS, ReplLimits(**settings))


def process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (None when no such process exists)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry))
    return members


async def test_namespace_persists_across_cells():
    async with repl() as k:
        assert (await k.execute("x = 21\ndef double(v):\n    return v * 2")).ok
        result = await k.execute("y = double(x)\nprint(y)")
        assert result.ok, result.error
        assert result.stdout == "42\n"
        assert await k.get_variable("y") == 42


async def test_print_is_captured_per_cell():
    async with repl() as k:
        await k.execute("def shout(word):\n    print(word.upper(), end='!')")
        first = await k.execute("print('a', 'b', sep='-')\nshout('hi')")
        second = await k.execute("print(1, [2], {'k': 3})")
        assert first.stdout == "a-b\nHI!"
        assert second.stdout == "1 [2] {'k': 3}\n"


async def test_printed_output_is_capped_with_a_note():
    async with repl(max_output_chars=100) as k:
        result = await k.execute("for i in range(50):\n    print('line', i)")
        assert result.ok
        kept, note = result.stdout.split("\n[output truncated: ")
        assert len(kept) == 100
        assert int(note.split()[0]) == sum(len(f"line {i}\n") for i in range(50)) - 100


async def test_final_and_final_var():
    async with repl() as k:
        result = await k.execute("FINAL({'answer': [1, 2]})")
        assert result.final.value == {"answer": [1, 2]} and not result.final.is_repr
        result = await k.execute("total = sum(range(10))\nFINAL_VAR('total')")
        assert result.final.value == 45 and result.final.variable == "total"
        result = await k.execute("FINAL(len)")
        assert result.final.is_repr and "len" in result.final.value
        result = await k.execute("FINAL_VAR('missing')")
        assert result.error_type == "NameError" and result.final is None
        assert (await k.execute("x = 1")).final is None


async def test_tool_call_returns_value():
    tools = Tools()
    async with repl(tools) as k:
        result = await k.execute("s = add(2, 3)\ne = echo(1, 'two', flag=True)\nprint(s, e)")
        assert result.ok, result.error
        assert result.stdout == "5 {'args': [1, 'two'], 'kwargs': {'flag': True}}\n"
        assert tools.calls == [("add", (2, 3), {}), ("echo", (1, "two"), {"flag": True})]


async def test_tool_error_can_be_caught_by_model_code():
    async with repl() as k:
        code = ("try:\n    fail('bad query')\nexcept ValueError as err:\n    print('caught', err)\n"
                "try:\n    quota()\nexcept ToolError as err:\n    print('tool error', err)")
        result = await k.execute(code)
        assert result.ok, result.error
        assert result.stdout == "caught bad query\ntool error QuotaExceeded: daily quota used up\n"


async def test_uncaught_tool_error_is_the_cell_error():
    async with repl() as k:
        result = await k.execute("before = 1\nfail('no such page')\nafter = 2")
        assert result.error_type == "ValueError"
        assert result.error.startswith("ValueError: no such page")
        assert "fail('no such page')" in result.error
        result = await k.execute("quota()")
        assert result.error_type == "ToolError"
        assert await k.get_variable("before") == 1
        with pytest.raises(KeyError):
            await k.get_variable("after")


async def test_tool_arguments_must_be_plain_data():
    tools = Tools()
    async with repl(tools) as k:
        result = await k.execute("echo(lambda: 1)")
        assert result.error_type == "TypeError" and "plain data" in result.error
        assert tools.calls == []


async def test_concurrent_tool_calls_from_two_forks():
    tools = Tools()
    async with repl(tools) as k:
        left, right = await k.fork(), await k.fork()
        results = {}

        async def run(label, handle):
            results[label] = await handle.execute(f"r = pair('{label}')\nprint(r)")

        async with anyio.create_task_group() as group:
            group.start_soon(run, "left", left)
            group.start_soon(run, "right", right)
        assert results["left"].stdout == "paired left\n", results["left"].error
        assert results["right"].stdout == "paired right\n", results["right"].error


async def test_set_and_get_multi_megabyte_variables():
    context = "".join(f"record {i}: value {i * 7}\n" for i in range(200_000))
    assert len(context) > 4_000_000
    async with repl() as k:
        await k.set_variable("context", context)
        await k.set_variable("rows", [{"id": i, "tags": ["a", "b"]} for i in range(50_000)])
        result = await k.execute("n = len(context)\nlines = context.count('\\n')\nm = len(rows)")
        assert result.ok, result.error
        assert await k.get_variable("n") == len(context)
        assert await k.get_variable("lines") == 200_000
        assert await k.get_variable("m") == 50_000
        assert await k.get_variable("context") == context


async def test_get_variable_errors_and_plain_conversion():
    async with repl() as k:
        await k.execute("import collections\ncounts = collections.Counter('abca')\n"
                        "gen = (i for i in range(3))")
        assert await k.get_variable("counts") == {"a": 2, "b": 1, "c": 1}
        with pytest.raises(TypeError):
            await k.get_variable("gen")
        with pytest.raises(KeyError):
            await k.get_variable("nope")
        with pytest.raises(TypeError):
            await k.set_variable("bad", object())
        with pytest.raises(ValueError):
            await k.set_variable("_private", 1)


async def test_namespace_summary():
    async with repl() as k:
        await k.execute("import json\nclass Box:\n    pass\nb = Box()\nitems = list(range(100))\n"
                        "def a_function_with_quite_a_long_name_indeed(): pass\ntext = 'x' * 70")
        summary = await k.namespace_summary()
        assert summary["json"].type_name == "module"
        assert summary["Box"].type_name == "type"
        assert summary["b"].type_name == "Box" and "0x" not in summary["b"].repr
        assert summary["items"].type_name == "list" and summary["items"].repr.endswith(" 5, ...]")
        function = summary["a_function_with_quite_a_long_name_indeed"]
        assert function.repr == "<function a_function_with_quite_a_long_name_indeed>"
        assert summary["text"].repr == repr("x" * 70)  # 80 characters are kept


async def test_fork_is_an_independent_copy():
    async with repl() as k:
        await k.execute("shared = [1]\nconfig = {'mode': 'a'}")
        fork = await k.fork()
        assert fork.pid != k.pid
        result = await fork.execute("shared.append(2)\nconfig['mode'] = 'b'\nonly_in_fork = 1")
        assert result.ok, result.error
        await k.execute("shared.append(3)")
        assert await fork.get_variable("shared") == [1, 2]
        assert await fork.get_variable("config") == {"mode": "b"}
        assert await k.get_variable("shared") == [1, 3]
        assert await k.get_variable("config") == {"mode": "a"}
        with pytest.raises(KeyError):
            await k.get_variable("only_in_fork")
        nested = await fork.fork()
        await nested.execute("shared.append(4)")
        assert await fork.get_variable("shared") == [1, 2]
        await nested.kill()
        assert not nested.alive
        with pytest.raises(ReplProcessDied):
            await nested.execute("x = 1")


async def test_in_place_exec_on_a_fork_has_no_rollback():
    async with repl(cpu_s=1) as k:
        fork = await k.fork()
        pid = fork.pid
        assert (await fork.execute("a = 1")).ok
        assert fork.pid == pid  # ran in place
        result = await fork.execute("while True:\n    pass")
        assert result.killed and result.error_type == "TimeoutError"
        assert "forked namespace is gone" in result.error
        assert not fork.alive
        assert (await k.execute("still = 'fine'")).ok


async def test_commit_on_a_fork_rolls_back():
    async with repl(cpu_s=1) as k:
        fork = await k.fork()
        assert (await fork.execute("a = 1", commit=True)).ok
        result = await fork.execute("a = 2\nwhile True:\n    pass", commit=True)
        assert result.killed
        assert await fork.get_variable("a") == 1


async def test_rollback_after_cpu_limit_keeps_earlier_variables():
    async with repl(cpu_s=1) as k:
        await k.execute("kept = 'before'\ncounter = [1]")
        result = await k.execute("kept = 'during'\ncounter.append(2)\nwhile True:\n    pass")
        assert result.killed
        assert result.error_type == "TimeoutError"
        assert "CPU time limit of 1 s" in result.error
        assert "variables it assigned were discarded" in result.error
        assert await k.get_variable("kept") == "before"
        assert await k.get_variable("counter") == [1]
        assert (await k.execute("kept += '!'")).ok
        assert await k.get_variable("kept") == "before!"


async def test_wall_clock_limit_counts_tool_time_and_cancels_the_call():
    tools = Tools()
    async with repl(tools, wall_s=1.5) as k:
        await k.execute("x = 1")
        result = await k.execute("x = 2\nslow(30)")
        assert result.killed and result.error_type == "TimeoutError"
        assert "wall-clock limit of 1.5 s" in result.error
        with anyio.fail_after(5):
            while not tools.cancelled:
                await anyio.sleep(0.05)
        assert await k.get_variable("x") == 1


async def test_cancelled_execute_stops_the_cell_and_keeps_the_namespace():
    async with repl() as k:
        await k.execute("x = 1")
        with anyio.move_on_after(1):
            await k.execute("x = 2\nimport time\ntime.sleep(30)")
        result = await k.execute("print(x)")
        assert result.stdout == "1\n", result.error


async def test_random_state_carries_across_forked_cells():
    async with repl() as k:
        await k.execute("import random\nrandom.seed(7)")
        result = await k.execute("print(random.random())")
        import random

        assert float(result.stdout) == random.Random(7).random()


EXTENSION_MODULE = """
def install(sandbox, channel):
    sandbox.install_builtin("twice", lambda value: value * 2)

    def pair_both(a, b):  # two calls in flight from one process, then wait for both
        calls = [channel.start_call("pair", (a,), {}), channel.start_call("pair", (b,), {})]
        return [channel.wait(call) for call in reversed(calls)]

    sandbox.install_builtin("pair_both", pair_both)


def tag_tools(sandbox, channel):  # replaces the tool proxies
    for name in sandbox.tool_names():
        def call(*args, name=name, **kwargs):
            return ("tagged", channel.call(name, args, kwargs))
        sandbox.install_tool(name, f"{name}(...)", call)
"""


async def wait_until_gone(pid: int) -> None:
    with anyio.fail_after(10):
        while process_state(pid) not in (None, "Z"):
            await anyio.sleep(0.02)


async def test_extension_hooks_run_in_the_worker_and_survive_restarts(tmp_path, monkeypatch):
    (tmp_path / "repl_extension_demo.py").write_text(EXTENSION_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    async with repl() as k:
        await k.extend("repl_extension_demo:install")
        result = await k.execute("print(twice(21), pair_both('a', 'b'))")
        assert result.stdout == "42 ['paired b', 'paired a']\n", result.error
        await k.extend("repl_extension_demo:tag_tools")
        fork = await k.fork()
        assert (await fork.execute("print(add(1, 2))")).stdout == "('tagged', 3)\n"
        with pytest.raises(ReplError):
            await k.extend("repl_extension_demo:missing")
        old_pid = k.pid
        os.kill(old_pid, signal.SIGKILL)
        await wait_until_gone(old_pid)
        assert (await k.execute("x = 1")).error_type == "ReplRestarted"
        result = await k.execute("print(twice(5), add(2, 2))")
        assert result.stdout == "10 ('tagged', 4)\n", result.error


async def test_repl_restarts_after_its_process_is_killed_externally():
    async with repl() as k:
        await k.set_variable("context", "the context")
        await k.execute("x = 1")
        old_pid = k.pid
        os.kill(old_pid, signal.SIGKILL)
        await wait_until_gone(old_pid)
        result = await k.execute("print(x)")
        assert result.error_type == "ReplRestarted"
        assert "empty namespace" in result.error and "context" in result.error
        assert "not run" in result.error
        assert k.pid != old_pid and k.restarts == 1
        result = await k.execute("print(len(context))\nprint(x)")
        assert result.stdout == "11\n"
        assert result.error_type == "NameError"


async def test_aclose_leaves_no_processes_behind():
    k = repl(cpu_s=1)
    await k.start()
    try:
        await k.execute("a = 1")
        fork = await k.fork()
        await fork.fork()
        await fork.execute("b = 2", commit=True)
        await k.execute("c = 3")
        group = process_group_members(k.root_pid)
        assert k.root_pid in group and k.pid in group and fork.pid in group
    finally:
        await k.aclose()
    await k.aclose()  # idempotent
    with anyio.fail_after(5):
        while any(process_state(pid) is not None for pid in group):
            await anyio.sleep(0.05)
    assert process_group_members(group[0]) == []


async def test_start_failure_is_a_clear_error():
    k = repl(start_timeout_s=0.001)
    try:
        with pytest.raises(ReplError, match="did not start"):
            await k.start()
    finally:
        await k.aclose()
    with pytest.raises(ValueError):
        ReplLimits(recursion_limit=1)


async def test_runtime_survives_garbage_on_its_socket():
    async with repl() as k:
        await k.execute("x = 1")
        with open(f"/proc/{k.root_pid}/cmdline", "rb") as cmdline:
            path = cmdline.read().split(b"\0")[-2].decode()  # the worker's socket argument
        forged = pickle.dumps({"op": "hello", "pid": os.getpid(), "role": "root", "token": "x"})
        evil = pickle.dumps({"op": "hello", "token": os.system})
        for payload in (b"\x00\x00\x00\x05garbage",
                        struct.pack(">I", 0xFFFFFFF0) + b"x" * 100,
                        struct.pack(">I", len(forged)) + forged,
                        struct.pack(">I", len(evil)) + evil):
            async with await anyio.connect_unix(path) as client:
                await client.send(payload)
                with anyio.fail_after(10), pytest.raises(
                        (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError)):
                    await client.receive()  # the runtime hangs up
        result = await k.execute("print(x + 1)")
        assert result.stdout == "2\n"


async def test_oversized_result_is_refused_with_a_clear_error():
    async with repl(memory_mb=2048) as k:
        await k.execute("keep = 1")
        result = await k.execute("FINAL('x' * (70 * 1024 * 1024))")
        assert result.error_type == "OverflowError" and "too large" in result.error
        assert (await k.execute("print(keep)")).stdout == "1\n"


def test_untrusted_frames_carry_plain_data_only():
    plain = {"op": "reply", "value": [1, 2.5, "s", b"b", (1,), {3}, frozenset({4}), None, True]}
    assert decode_untrusted(pickle.dumps(plain)) == plain
    for hostile in ({"op": "x", "v": os.system}, {"op": "x", "v": ValueError("x")},
                    {"op": "x", "v": complex(1, 2)}):
        with pytest.raises(ProtocolError):
            decode_untrusted(pickle.dumps(hostile))
    with pytest.raises(ProtocolError):
        decode_untrusted(pickle.dumps(["not", "a", "dict"]))
    with pytest.raises(ProtocolError):
        decode_untrusted(b"\x80\x05garbage")


def test_to_plain_converts_subclasses_and_refuses_the_rest():
    import collections

    point = collections.namedtuple("Point", "x y")(1, 2)
    converted = to_plain({"d": collections.OrderedDict(a=1), "p": point})
    assert converted == {"d": {"a": 1}, "p": (1, 2)}
    assert type(converted["d"]) is dict and type(converted["p"]) is tuple
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError):
        to_plain(loop)
    with pytest.raises(TypeError):
        to_plain({"f": time.time})


async def test_a_tool_call_waits_until_earlier_messages_are_received():
    events: list[str] = []

    async def handler(name, args, kwargs):
        events.append("call")
        return 1

    async with Repl(handler, {"act": "act(x)"}) as r:
        await r.execute("keep = act")
        messages = r.messages()
        with pytest.raises(ReplError, match="already open"):
            r.messages()
        shadow = await r.fork_shadow()
        assert (await shadow.execute("keep(1)")).error_type == "PermissionError"
        plain = await r.fork()

        async def receive_late() -> None:
            await anyio.sleep(0.5)
            token, message = await messages.receive()
            assert token == shadow.token
            events.append(f"received {message.op}")

        async with anyio.create_task_group() as group:
            group.start_soon(receive_late)
            assert (await plain.execute("r = keep(2)")).ok
        assert events == ["received refused_call", "call"]
        messages.close()
        assert (await plain.execute("r = keep(3)")).ok  # a closed stream holds nothing back
        r.messages().close()  # another may be opened once the first is closed
