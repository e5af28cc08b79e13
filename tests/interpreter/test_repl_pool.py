"""The warm worker pool: real worker processes (in the jail) started ahead of use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from agentrt.interpreter import Repl, ReplLimits
from agentrt.interpreter.repl.pool import WorkerPool, WorkerSpec

LIMITS = ReplLimits(cpu_s=2, wall_s=30)
ROOT = Path(__file__).resolve().parents[2]


async def no_tools(name: str, args: tuple, kwargs: dict) -> None:
    raise LookupError(name)


def processes_mentioning(text: str) -> list[int]:
    """Pids of the running processes (zombies aside) whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if text in argv and state != "Z":
            found.append(int(entry))
    return found


def wait_gone(text: str, timeout: float = 10.0) -> list[int]:
    """Wait until no process mentions ``text``; the pids still there at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def spec() -> WorkerSpec:
    return WorkerSpec.for_limits(LIMITS)


@pytest.fixture
def pool():
    pool = WorkerPool(max_workers=2)
    yield pool
    pool.close()


@pytest.mark.anyio
async def test_the_repl_takes_a_loaded_worker_and_the_pool_refills(pool, spec):
    pool.reserve(spec, 1)
    assert pool.wait_loaded(spec)
    (warm,) = pool.idle(spec)
    async with Repl(no_tools, (), LIMITS, pool=pool) as repl:
        assert repl.warm_start
        assert warm not in pool.idle(spec)
        assert warm.socket_path.startswith(str(warm.directory))
        result = await repl.execute("x = 6 * 7\nprint(x)")
        assert result.ok and result.stdout == "42\n", result.error
        assert await anyio.to_thread.run_sync(pool.wait_loaded, spec)
        (fresh,) = pool.idle(spec)
        assert fresh is not warm and fresh.pid != warm.pid
    # The worker served this REPL only: it is gone with it, directory included.
    assert not warm.alive() and not warm.directory.exists()
    assert wait_gone(str(warm.directory)) == []
    assert pool.started == 2


@pytest.mark.anyio
async def test_without_a_pool_or_a_reservation_the_repl_starts_its_own(pool, spec):
    async with Repl(no_tools, (), LIMITS) as repl:
        assert not repl.warm_start
        assert (await repl.execute("print('cold')")).stdout == "cold\n"
    async with Repl(no_tools, (), LIMITS, pool=pool) as repl:  # nothing reserved
        assert not repl.warm_start
        assert (await repl.execute("print('cold')")).stdout == "cold\n"
    assert pool.started == 0 and pool.idle() == []


@pytest.mark.anyio
async def test_a_worker_started_under_another_pythonpath_is_not_taken(pool, spec, tmp_path,
                                                                      monkeypatch):
    """The worker imports a REPL's extensions from its PYTHONPATH as it was at its start."""
    pool.reserve(spec, 1)
    assert pool.wait_loaded(spec)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "pool_hook.py").write_text(
        "def install(sandbox, channel):\n    sandbox.install_builtin('marker', lambda: 7)\n")
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    async with Repl(no_tools, (), LIMITS, pool=pool) as repl:
        assert not repl.warm_start
        await repl.extend("pool_hook:install")
        assert (await repl.execute("print(marker())")).stdout == "7\n"
    assert len(pool.idle(spec)) == 1  # still there for REPLs of its own spec


def test_leases_share_workers_and_the_pool_is_bounded(pool, spec):
    first, second = pool.reserve(spec, 1), pool.reserve(spec, 1)
    assert pool.wait_loaded(spec)
    assert len(pool.idle(spec)) == 1 and pool.started == 1  # shared, not one per lease
    big = pool.reserve(spec, 5)
    assert pool.wait_loaded(spec, 2)
    assert len(pool.idle(spec)) == 2 and pool.started == 2  # max_workers
    taken = [pool.take(spec) for _ in range(3)]
    assert len({w.pid for w in taken if w is not None}) == sum(w is not None for w in taken)
    assert pool.wait_loaded(spec, 2)
    assert len(pool.idle(spec)) <= 2
    for worker in filter(None, taken):
        worker.discard()
    for lease in (first, second, big):
        lease.release()
    for worker in pool.idle(spec):  # nothing wanted any more: stopped by the pool
        assert wait_gone(str(worker.directory)) == []
    deadline = time.monotonic() + 10
    while pool.idle(spec) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.idle(spec) == []


def test_a_worker_that_died_in_the_pool_is_replaced_not_handed_out(pool, spec):
    pool.reserve(spec, 1)
    assert pool.wait_loaded(spec)
    (victim,) = pool.idle(spec)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while victim.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    taken = pool.take(spec)
    assert taken is not victim
    if taken is not None:
        taken.discard()
    assert pool.wait_loaded(spec)
    (replacement,) = pool.idle(spec)
    assert replacement is not victim and replacement.alive()
    assert not victim.directory.exists()


def test_close_stops_every_idle_worker(spec):
    pool = WorkerPool(max_workers=2)
    pool.reserve(spec, 2)
    assert pool.wait_loaded(spec, 2)
    directories = [str(w.directory) for w in pool.idle(spec)]
    assert all(processes_mentioning(d) for d in directories)
    pool.close()
    assert [d for d in directories if processes_mentioning(d)] == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.reserve(spec, 1)


CHILD = textwrap.dedent("""
    import sys, time
    from agentrt.interpreter import ReplLimits
    from agentrt.interpreter.repl.pool import WorkerSpec, shared_pool
    spec = WorkerSpec.for_limits(ReplLimits())
    pool = shared_pool()
    pool.reserve(spec, 2)
    assert pool.wait_loaded(spec, 2)
    for worker in pool.idle(spec):
        print(worker.directory, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
    print("waiting", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["exit", "sigint", "sigkill"])
def test_no_worker_outlives_the_interpreter(how):
    """At interpreter exit, on Ctrl-C, even when the interpreter is killed: the idle workers
    go (atexit; their input ends; the jail's workers die with their parent)."""
    from child_signals import default_sigint

    child = subprocess.Popen([sys.executable, "-c", CHILD, how], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, preexec_fn=default_sigint)
    directories = [child.stdout.readline().strip() for _ in range(2)]
    assert all(directories), "the child did not report its workers"
    if how != "exit":
        assert child.stdout.readline() == "waiting\n"
        assert all(processes_mentioning(d) for d in directories)
    if how == "sigint":
        child.send_signal(signal.SIGINT)
    elif how == "sigkill":
        child.kill()
    child.wait(30)
    assert [d for d in directories if wait_gone(d)] == []
