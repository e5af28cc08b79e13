"""Assume breach, then attack the host: the runtime trusts nothing a worker process says.

Each test gives the worker unrestricted Python through a real ``extend`` hook (as if the first
wall had fallen), including its raw connection to the runtime, and then lies, floods or breaks
the protocol. Every frame is checked before use, liveness and limits come from the runtime's own
observation, and a worker can cost the runtime only bounded memory, descriptors and CPU; a bad
frame ends that worker's session, never the REPL or the run.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import textwrap

import anyio
import pytest

from agentrt import Agent, ReplayEngine, tool
from benchmarks.hostile_workers import HOOK as BREACH_MODULE
from agentrt.interpreter import Repl, ReplError, ReplLimits
from agentrt.interpreter.repl import service

pytestmark = pytest.mark.anyio

LIMITS = ReplLimits(cpu_s=10, wall_s=60, memory_mb=1024, disk_mb=16)



@pytest.fixture
def breach_hook(tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "breach_hook.py").write_text(BREACH_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))


async def echo_tool(name: str, args: tuple, kwargs: dict):
    return list(args)


@contextlib.asynccontextmanager
async def breached_repl(limits: ReplLimits = LIMITS):
    """A REPL whose worker has the ``unrestricted`` builtin (the breach hook)."""
    async with Repl(echo_tool, {"echo": "echo(*args)"}, limits) as repl:
        await repl.extend("breach_hook:install")
        yield repl


def source(body: str) -> str:
    return "unrestricted(" + repr(textwrap.dedent(body)) + ")"


def host_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def host_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def jail_processes(root_pid: int) -> set[int]:
    """Live processes in the PID namespace of the jail whose init is ``root_pid``."""
    namespace = os.readlink(f"/proc/{root_pid}/ns/pid")
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                with open(f"/proc/{entry}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.add(int(entry))
        except OSError:
            continue
    return found


def strays(repl: Repl) -> set[int]:
    """Processes of the jail that the runtime does not know as one of its workers."""
    known = {proc.pid for proc in repl._table.by_token.values() if proc.pid is not None}
    return jail_processes(repl.root_pid) - known - {repl.root_pid}


async def main_still_works(repl: Repl) -> None:
    result = await repl.execute("print(1 + 1)")
    assert result.stdout == "2\n", result.error


# -- liveness: the runtime's own word ------------------------------------------------------------

async def test_forged_exit_reports_cannot_defeat_the_wall_clock(breach_hook):
    """A cell that reports its own death to the runtime still dies at the wall-clock limit
    (it used to be left running and, 5 s later, to finish as if nothing had happened)."""
    async with breached_repl(limits=ReplLimits(cpu_s=10, wall_s=2)) as repl:
        result = await repl.execute(source("""
            import os, time
            send_raw({"op": "child_exit", "pid": os.getpid(), "code": 0, "signal": None})
            time.sleep(4)
            result = "slept"
        """))
        assert result.killed and result.error_type == "TimeoutError", result
        assert "wall-clock limit of 2 s" in result.error
        await main_still_works(repl)


async def test_a_wall_clock_kill_takes_everything_the_cell_started(breach_hook):
    """Children and orphaned grandchildren of a runaway cell die with it."""
    async with breached_repl(limits=ReplLimits(cpu_s=30, wall_s=3)) as repl:
        before = strays(repl)
        result = await repl.execute(source("""
            import os, time
            for _ in range(3):
                if os.fork() == 0:           # a child ...
                    if os.fork() == 0:       # ... whose child outlives it (adopted by the root)
                        time.sleep(60)
                    os._exit(0)
            os.fork()                        # and a sibling copy of the cell itself
            time.sleep(60)
        """))
        assert result.error_type == "TimeoutError", result.error
        assert strays(repl) == before == set()
        await main_still_works(repl)


async def test_a_worker_that_hangs_up_is_killed(breach_hook):
    """Closing its connection does not let a process live on, unseen, in the jail."""
    async with breached_repl() as repl:
        result = await repl.execute(source("""
            import os, time
            channel._process._link.close()
            if os.fork() == 0:
                time.sleep(60)
            time.sleep(60)
        """))
        assert result.killed, result
        with anyio.fail_after(10):
            while strays(repl):
                await anyio.sleep(0.05)
        await main_still_works(repl)


# -- frames: checked before use --------------------------------------------------------------------

BAD_FRAMES = {
    "garbage": 'send_raw(raw=b"\\x00\\x00\\x00\\x05garbage")',
    "unknown-op": 'send_raw({"op": "nonsense"})',
    "reply-never-asked": 'send_raw({"op": "reply", "id": 10**6, "ok": True, "value": 1})',
    "forked-unknown-child": 'send_raw({"op": "forked", "token": "x" * 32, "pid": 5})',
    "second-hello": 'send_raw({"op": "hello", "pid": 5, "role": "fork", "token": "x" * 32})',
    "unknown-tool": 'send_raw({"op": "call", "call": 1, "name": "rm_rf", "args": (), '
                    '"kwargs": {}})',
    "call-kwargs-not-a-dict": 'send_raw({"op": "call", "call": 1, "name": "echo", '
                              '"args": (), "kwargs": [1, 2]})',
    "launch-kwargs-not-a-dict": 'send_raw({"op": "launch", "call": 1, "name": "echo", '
                                '"args": (), "kwargs": [1, 2]})',
    "class-in-pickle": 'import os\nsend_raw({"op": "reply", "id": 1, "ok": True, '
                       '"value": os.system})',
    "oversized-header": 'send_raw(raw=struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)',
    "memo-index-bomb": 'send_raw(raw=struct.pack(">I", 9) + b"\\x80\\x05Nr\\x00\\x00\\x00\\x01.")',
    "empty-set-bomb": 'data = b"\\x80\\x05]" + b"(" + b"\\x8f" * 900_000 + b"e."\n'
                      'send_raw(raw=struct.pack(">I", len(data)) + data)',
    "shared-reference-explosion": 'x = ["a" * 64]\nfor _ in range(21):\n    x = [x, x]\n'
                                  'send_raw({"op": "call", "call": 1, "name": "echo", '
                                  '"args": (x,), "kwargs": {}})',
}


@pytest.mark.parametrize("frame", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
async def test_a_bad_frame_ends_that_session_only(breach_hook, frame):
    async with breached_repl() as repl:
        fork = await repl.fork()
        rss = host_rss_mb()
        body = "import struct\n" + frame + "\nimport time\ntime.sleep(30)"
        result = await fork.execute(source(body))
        assert result.killed and not fork.alive, result
        assert repl.protocol_errors == 1
        assert host_rss_mb() - rss < 50
        await main_still_works(repl)


async def test_a_decode_bomb_costs_the_host_no_memory(breach_hook, tmp_path):
    """A 9-byte frame asked the unpickler for a 2**24-entry memo (256 MB): measured in a fresh
    process, whose peak RSS says what the frame cost."""
    script = tmp_path / "bomb.py"
    script.write_text(textwrap.dedent('''
        import anyio, resource, struct
        from agentrt.interpreter import Repl, ReplLimits

        async def main():
            async def tools(name, args, kwargs):
                return None
            async with Repl(tools, (), ReplLimits(cpu_s=10, wall_s=60)) as repl:
                await repl.extend("breach_hook:install")
                fork = await repl.fork()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                frame = b"\\x80\\x05Nr" + struct.pack("<I", 1 << 24) + b"."
                code = "send_raw(raw=%r)" % (struct.pack(">I", len(frame)) + frame)
                sent = await fork.execute("unrestricted(%r)" % code)
                assert sent.error is None or "SyntaxError" not in sent.error, sent.error
                await repl.execute("x = 1")
                after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                print((after - before) // 1024)
        anyio.run(main)
    '''))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) < 50, done.stdout


async def test_a_slow_large_frame_is_cut_off(breach_hook, monkeypatch):
    monkeypatch.setattr(service, "FRAME_BODY_TIMEOUT_S", 1.0)
    async with breached_repl() as repl:
        fork = await repl.fork()
        result = await fork.execute(source("""
            import struct, time
            send_raw(raw=struct.pack(">I", 8 * 1024 * 1024) + b"\\x80\\x05")
            time.sleep(30)
        """))
        assert result.killed and repl.protocol_errors == 1
        await main_still_works(repl)


async def test_refused_tool_calls_from_a_shadow_are_capped(breach_hook):
    async with breached_repl() as repl:
        messages = repl.messages()
        shadow = await repl.fork_shadow()
        result = await shadow.execute(source("""
            for call in range(1, 200):
                try:
                    channel.call("echo", (call,), {})
                except PermissionError:
                    pass
        """))
        assert result.killed and repl.protocol_errors == 1
        refused = []
        with contextlib.suppress(anyio.WouldBlock):
            while True:
                refused.append(messages.receive_nowait())
        assert len(refused) == service.MAX_REFUSED_CALLS  # the next one ended the session
        assert {message.name for _, message in refused} == {"echo"}
        messages.close()
        await main_still_works(repl)


# -- connections: capped before and after the hello ----------------------------------------------

async def test_connection_floods_cost_the_host_bounded_descriptors_and_memory(breach_hook):
    """Hundreds of connections that never say hello (from the worker itself and from a
    process it forked), and hellos that announce 60 MiB and stream without end: the host
    keeps few descriptors and little memory, and ends the flooding sessions."""
    async with breached_repl() as repl:
        fds, rss = host_fds(), host_rss_mb()
        most = [0, 0.0]
        done = anyio.Event()

        async def attack() -> None:
            most.append(await repl.execute(source("""
                import os, socket, struct, time
                def flood():
                    held = []
                    for _ in range(120):
                        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        try:
                            connection.connect(socket_path)
                            connection.sendall(struct.pack(">I", 60 * 2**20) + b"x" * 2**20)
                        except OSError:
                            pass
                        held.append(connection)
                    time.sleep(3)
                if os.fork() == 0:   # a stray of the jail ...
                    flood()
                    os._exit(0)
                flood()              # ... and the worker itself
            """)))
            done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(attack)
            while not done.is_set():
                most[0] = max(most[0], host_fds() - fds)
                most[1] = max(most[1], host_rss_mb() - rss)
                await anyio.sleep(0.02)
        result = most[2]
        assert most[0] <= 64, most
        assert most[1] < 50, most
        assert result.killed and repl.protocol_errors == 1, (result, repl.protocol_errors)
        assert repl.refused_connections > service.MAX_REFUSED_CONNECTIONS
        with anyio.fail_after(10):
            while strays(repl):
                await anyio.sleep(0.05)
        await main_still_works(repl)


# -- through the SDK: nothing a shadow says ends the run -----------------------------------------

@tool(speculate=True)
async def lookup(x: int) -> int:
    """Pure."""
    await anyio.sleep(0.02)
    return x + 1


def run_agent(code: str, monkeypatch):
    import agentrt.agent as agent_module

    class BreachedRepl(Repl):
        async def start(self) -> None:
            await super().start()
            await self.extend("breach_hook:install")

    monkeypatch.setattr(agent_module, "Repl", BreachedRepl)
    responses = [f"```repl\n{code}\n```", "```repl\nFINAL(lookup(1))\n```"]
    agent = Agent(ReplayEngine(responses, 40.0), tools=[lookup], speculation=True,
                  builtin_tools=False, max_turns=2)
    return agent.run_sync("task")


def test_a_malformed_launch_from_a_shadow_ends_only_that_shadow(breach_hook, monkeypatch):
    """It used to raise out of ``Agent.run_sync`` as an ExceptionGroup."""
    attack = ('send_raw({"op": "launch", "call": 1, "name": "lookup", "args": (), '
              '"kwargs": [1, 2], "lineno": 1, "deps": []})')
    result = run_agent(source(attack) + "\nn = lookup(1)", monkeypatch)
    assert result.answer == 2, (result.status, result.error, [t.error for t in result.turns])


KILL_EVERY_JAIL_PROCESS = ("import os, signal\nif os.fork() == 0:\n"
                           "    os.kill(-1, signal.SIGKILL)\n    os._exit(0)")
"""A grandchild that kills every process of the jail it can reach."""


def test_killing_every_jail_process_from_a_shadow_does_not_end_the_run(breach_hook, monkeypatch):
    """A grandchild of a shadow kills every process of the jail it can: the cells see the
    namespace restarted (as often as the code does it again), and the run goes on."""
    result = run_agent(source(KILL_EVERY_JAIL_PROCESS) + "\nn = lookup(1)", monkeypatch)
    assert result.status in ("final", "max_turns") and result.error is None, result
    assert all(turn.error is None or "ReplRestarted" in turn.error for turn in result.turns)


def test_a_shared_reference_launch_costs_the_host_no_cpu(breach_hook, monkeypatch):
    """A tiny launch frame whose arguments share references 2**21 ways: refused before
    anything expands it (it used to cost seconds of host CPU and hundreds of MB)."""
    attack = ('x = ["a" * 64]\nfor _ in range(21):\n    x = [x, x]\n'
              'send_raw({"op": "launch", "call": 1, "name": "lookup", "args": (x,), '
              '"kwargs": {}, "lineno": 1, "deps": []})')
    before = resource.getrusage(resource.RUSAGE_SELF)
    result = run_agent(source(attack) + "\nn = lookup(1)", monkeypatch)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert result.answer == 2
    assert cpu < 1.5, cpu


async def test_a_shadow_cannot_reach_a_namespace_still_being_restored(breach_hook):
    """Shadows forked without waiting, over and over, each killing every jail process: a
    restart in progress is never handed to a shadow (one used to kill the new holder while
    its variables were being restored, and ``execute`` raised instead of reporting it)."""
    attack = source(KILL_EVERY_JAIL_PROCESS)
    async with breached_repl() as repl:
        for index in range(4):  # restoring these takes a while
            await repl.set_variable(f"context_{index}", "x" * 2_000_000)
        done = anyio.Event()

        async def attack_forever() -> None:
            while not done.is_set():
                try:
                    shadow = await repl.fork_shadow()
                    await shadow.execute(attack)
                except ReplError:
                    await anyio.sleep(0.001)

        async with anyio.create_task_group() as group:
            group.start_soon(attack_forever)
            for _ in range(6):
                result = await repl.execute("y = 1")
                assert result.error is None or "ReplRestarted" in result.error, result
            done.set()
        assert repl.restarts >= 1
