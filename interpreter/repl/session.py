"""The REPL's public API: :class:`Repl` (one persistent namespace) and :class:`ReplSession`.

:class:`Repl` starts the worker (``python -m agentrt.interpreter.worker``) and runs cells with
fork-per-cell rollback: a cell that is killed (CPU or wall-clock limit, crash) leaves the
namespace as it was before the cell. :class:`ReplSession` is a handle on one namespace (the
REPL's own, or a copy-on-write fork of it) -- the primitive the shadow interpreter builds on.
"""

from __future__ import annotations

import contextlib
import keyword
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from .. import frames, jail
from ..cgroup import ReplCgroup
from ..protocol import TOKEN_ENV, to_plain
from .limits import ReplLimits
from .messages import ReplMessages
from .processes import Proc, ProcessTable, death_cause
from .results import CellResult, ReplError, ReplProcessDied, VariableSummary, cell_result, reply_value
from .service import MAX_CONNECTIONS, ReplService, ToolHandler

logger = logging.getLogger(__name__)

EXIT_REPORT_WAIT_S = 2.0
WORKER_MODULE = "agentrt.interpreter.worker"
RESERVED_CONNECTIONS = 3
"""Connections kept free of forks: for the next cell and a restarted holder."""


async def wait_any(events: Iterable[anyio.Event], timeout: float) -> None:
    """Wait until one of ``events`` is set, or ``timeout`` seconds pass."""
    fired = anyio.Event()

    async def watch(event: anyio.Event) -> None:
        await event.wait()
        fired.set()

    async with anyio.create_task_group() as group:
        for event in events:
            group.start_soon(watch, event)
        with anyio.move_on_after(max(timeout, 0)):
            await fired.wait()
        group.cancel_scope.cancel()


def _check_variable_name(name: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
            or name.startswith("_"):
        raise ValueError(f"invalid variable name: {name!r}")


class ReplSession:
    """A sandbox namespace held by a worker process.

    ``execute(code, commit=True)`` runs the cell in a forked child that replaces the
    holder when it succeeds (rollback if it is killed); ``commit=False`` runs it in place
    (faster, no rollback: a killed cell ends this handle). ``fork()`` returns an
    independent copy-on-write copy.
    """

    def __init__(self, repl: Repl, proc: Proc) -> None:
        self._repl = repl
        self._proc = proc
        self._lock = anyio.Lock()

    @property
    def pid(self) -> int | None:
        """Pid of the process now holding this namespace."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        """Whether the process holding this namespace is running."""
        return self._proc.alive

    @property
    def token(self) -> str:
        """The identity of this handle's process in the REPL's message stream."""
        return self._proc.token

    async def post(self, message: dict[str, Any]) -> None:
        """Send a one-way message (no reply expected) to the process."""
        await self._require_alive().send(message)

    async def execute(self, code: str, *, name: str = "cell", commit: bool = False) -> CellResult:
        """Run ``code`` in this namespace and return what it printed, raised and answered."""
        async with self._lock:
            holder = self._require_alive()
            return await self._repl._run_cell(self, holder, code, name, commit)

    async def fork(self) -> ReplSession:
        """A new handle on a copy-on-write copy of this namespace."""
        async with self._lock:
            holder = self._require_alive()
            return await self._repl._fork(holder)

    async def set_variable(self, name: str, value: Any) -> None:
        """Bind ``name`` to ``value`` (plain data) in this namespace."""
        _check_variable_name(name)
        value = to_plain(value)
        async with self._lock:
            await self._repl._command(self._require_alive(),
                                      {"op": frames.SET_VAR, "name": name, "value": value})

    async def get_variable(self, name: str) -> Any:
        """The value of ``name`` as plain data (KeyError if unbound, TypeError if not plain)."""
        async with self._lock:
            return await self._repl._command(self._require_alive(),
                                             {"op": frames.GET_VAR, "name": name})

    async def namespace_summary(self) -> dict[str, VariableSummary]:
        """``{name: VariableSummary}`` for every variable in the namespace."""
        async with self._lock:
            raw = await self._repl._command(self._require_alive(), {"op": frames.SUMMARY})
        if not isinstance(raw, dict):
            raise ReplError("malformed namespace summary from the sandbox")
        return {str(k): VariableSummary(str(v[0]), str(v[1])) for k, v in raw.items()
                if isinstance(v, (list, tuple)) and len(v) == 2}

    async def set_proxy_factory(self, factory: str) -> None:
        """Rebuild the tool proxies with ``"package.module:function"``, called as
        ``factory(name, signature, channel)`` in the worker (see worker.py)."""
        async with self._lock:
            await self._repl._command(self._require_alive(),
                                      {"op": frames.SET_PROXY, "factory": factory})

    async def extend(self, hook: str) -> None:
        """Call ``hook(sandbox, channel)`` (``"package.module:function"``) in the worker,
        e.g. to install builtins or replace ``sandbox.compiler``; forks inherit the result."""
        async with self._lock:
            await self._repl._command(self._require_alive(), {"op": frames.EXTEND, "hook": hook})

    async def kill(self, *, wait: bool = True) -> None:
        """Kill the process holding this namespace (SIGKILL); with ``wait``, until it is gone."""
        proc = self._proc
        self._repl._table.kill(proc, "killed by the runtime")
        if wait:
            with anyio.move_on_after(5):
                await proc.dead.wait()

    def _require_alive(self) -> Proc:
        if not self._proc.alive:
            raise ReplProcessDied(
                f"the sandbox process {self._proc.pid} holding this namespace is not running")
        return self._proc


class Repl:
    """The sandboxed REPL: one persistent namespace, run cell by cell, in worker processes.

    ``tool_handler`` serves the tool calls made by sandboxed code; ``tool_names`` lists the
    tools (a mapping gives each a one-line signature for ``help()``). Use as an async
    context manager, or call :meth:`start` and :meth:`aclose`. Requires asyncio.
    """

    def __init__(self, tool_handler: ToolHandler,
                 tool_names: Iterable[str] | Mapping[str, str] = (),
                 limits: ReplLimits = ReplLimits()) -> None:
        self._tool_handler = tool_handler
        if isinstance(tool_names, Mapping):
            self._tools = {str(k): str(v) for k, v in tool_names.items()}
        else:
            self._tools = {str(name): f"{name}(...)" for name in tool_names}
        for name in self._tools:
            _check_variable_name(name)
        self.limits = limits
        self.restarts = 0
        self._started = self._closed = False
        self._table = ProcessTable()
        self._runtime_variables: dict[str, Any] = {}
        self._setup_steps: list[tuple[str, str]] = []
        self._unreported_restart: str | None = None
        self._tmpdir: Path | None = None
        self._service: ReplService | None = None
        self._root_process: anyio.abc.Process | None = None
        self._main: ReplSession | None = None
        self._jail = jail.OFF
        self._cgroup: ReplCgroup | None = None
        self._messages: ReplMessages | None = None

    # -- lifecycle --------------------------------------------------------------
    async def __aenter__(self) -> Repl:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the worker and create the namespace."""
        if self._closed:
            raise ReplError("this repl was closed")
        if self._started:
            return
        self._started = True
        self._lock = anyio.Lock()
        self._tmpdir = Path(tempfile.mkdtemp(prefix="agentrt-repl-"))
        (self._tmpdir / "work").mkdir()
        self._socket_path = str(self._tmpdir / "repl.sock")
        try:
            try:
                self._jail = await anyio.to_thread.run_sync(jail.plan_jail, self.limits.jail)
            except jail.JailUnavailable as exc:
                raise ReplError(str(exc)) from None
            self._table.namespaced = self._jail.namespaces
            if self._jail.namespaces:  # a few small writes under /sys/fs/cgroup, if any
                memory = self.limits.memory_mb
                self._cgroup = ReplCgroup.create(
                    (2 * memory + self.limits.disk_mb) * 2**20 if memory else None,
                    jail.MAX_PROCESSES)
            self._service = ReplService(self._table, self._tools, self._tool_handler,
                                        messages=self._messages)
            await self._service.start(self._socket_path)
            await self._start_root()
            self._main = ReplSession(self, await self._spawn_holder())
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    async def aclose(self) -> None:
        """Kill every worker process and remove the temporary directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        with anyio.CancelScope(shield=True):
            await self._stop_processes()
            if self._cgroup is not None:
                await anyio.to_thread.run_sync(self._cgroup.remove)
            if self._service is not None:
                await self._service.aclose()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def refused_tool_calls(self) -> int:
        """Real tool calls refused because they came from a shadow fork."""
        return self._service.refused_tool_calls if self._service is not None else 0

    @property
    def protocol_errors(self) -> int:
        """Worker sessions ended because a frame from the worker broke the protocol."""
        return self._service.protocol_errors if self._service is not None else 0

    @property
    def refused_connections(self) -> int:
        """Connections to the REPL's socket closed unread (over the cap, or no hello)."""
        return self._service.refused_connections if self._service is not None else 0

    def messages(self) -> ReplMessages:
        """Open the stream of unsolicited messages from forked sessions, for one consumer.

        It yields ``(session token, message)`` in arrival order, messages unread by the
        REPL (typed: ``frames.Launch``, ``frames.ShadowDone``), plus a ``frames.RefusedCall``
        for each refused shadow tool call (see :meth:`fork_holder`). May be opened before :meth:`start`; close it to stop
        (later messages are then dropped) before opening another.
        """
        if self._messages is not None and not self._messages.closed:
            raise ReplError("the REPL's message stream is already open")
        self._messages = ReplMessages()
        if self._service is not None:
            self._service.messages = self._messages
        return self._messages

    @property
    def pid(self) -> int | None:
        """Pid of the process holding the namespace now."""
        return self._main.pid if self._main is not None else None

    @property
    def root_pid(self) -> int | None:
        """Pid of the root worker process (also the process group of all workers)."""
        return self._table.root.pid if self._table.root is not None else None

    # -- public API on the main namespace -------------------------------------
    async def execute(self, code: str, *, name: str = "cell") -> CellResult:
        """Run a cell in the persistent namespace (fork-per-cell: killed cells roll back).

        If the process holding the namespace died, the REPL restarts with an empty
        namespace (restoring the variables given with :meth:`set_variable`) and returns an
        error of type ``ReplRestarted`` saying so, without running the cell.
        """
        self._check_running()
        async with self._lock:
            await self._ensure_main()
            if self._unreported_restart is None:
                try:
                    result = await self._main.execute(code, name=name, commit=True)
                except ReplProcessDied:  # the holder died just before the cell started
                    await self._ensure_main()
            if self._unreported_restart is not None:
                notice, self._unreported_restart = self._unreported_restart, None
                message = f"ReplRestarted: {notice}. This cell was not run."
                return CellResult("", message, "ReplRestarted", None, 0.0, killed=True)
            if result.killed and not self._main.alive:
                await self._ensure_main()
                notice, self._unreported_restart = self._unreported_restart, None
                result.error = f"{result.error}\nReplRestarted: {notice}."
            return result

    async def set_variable(self, name: str, value: Any) -> None:
        """Bind ``name`` to plain-data ``value`` in the namespace (e.g. the ``context``).

        The REPL remembers these values and restores them if it has to restart.
        """
        self._check_running()
        _check_variable_name(name)
        value = to_plain(value)
        async with self._lock:
            await self._ensure_main()
            await self._main.set_variable(name, value)
            self._runtime_variables[name] = value

    async def get_variable(self, name: str) -> Any:
        """The value of ``name`` as plain data (KeyError if unbound, TypeError if not plain)."""
        self._check_running()
        async with self._lock:
            await self._ensure_main()
            return await self._main.get_variable(name)

    async def namespace_summary(self) -> dict[str, VariableSummary]:
        """``{name: VariableSummary(type_name, repr)}`` for every variable."""
        self._check_running()
        async with self._lock:
            await self._ensure_main()
            return await self._main.namespace_summary()

    async def fork(self) -> ReplSession:
        """A copy-on-write copy of the namespace as a new handle (for speculative runs)."""
        self._check_running()
        async with self._lock:
            await self._ensure_main()
            return await self._main.fork()

    async def fork_holder(self, *, shadow: bool = False) -> ReplSession:
        """Fork the process holding the namespace *now*, without waiting for a running cell.

        With ``shadow`` the fork may never make a real tool call: one that arrives anyway is
        refused (the code gets a PermissionError), counted in ``refused_tool_calls`` and
        reported on the message stream (:meth:`messages`) as ``refused_call``.

        While a cell runs, the holder still has the namespace as it was before the cell, so
        the fork sees that state. Raises `ReplProcessDied` if the holder is being replaced.
        """
        self._check_running()
        if self._main is None:
            raise ReplProcessDied("the REPL has no namespace holder")
        return await self._fork(self._main._require_alive(), tool_calls=not shadow)

    async def set_proxy_factory(self, factory: str) -> None:
        """Rebuild the namespace's tool proxies with another factory (kept across restarts)."""
        await self._setup("set_proxy_factory", factory)

    async def extend(self, hook: str) -> None:
        """Run ``hook(sandbox, channel)`` in the namespace process (kept across restarts)."""
        await self._setup("extend", hook)

    async def _setup(self, method: str, path: str) -> None:
        self._check_running()
        async with self._lock:
            await self._ensure_main()
            await getattr(self._main, method)(path)
            self._setup_steps.append((method, path))

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise ReplError("the REPL is not running (call start() or use 'async with')")

    def _worker_env(self, token: str) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONSAFEPATH": "1",
               TOKEN_ENV: token}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return env

    def _log_tail(self) -> str:
        try:
            text = (self._tmpdir / "worker.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"\nworker log:\n{text[-2000:]}" if text else ""

    async def _start_root(self) -> None:
        root = self._table.new_proc("root")
        command = [sys.executable, "-m", WORKER_MODULE, self._socket_path]
        env = self._worker_env(root.token)
        if self._jail.namespaces:  # the worker gets an empty environment plus these
            del env["PATH"]
            command = jail.bwrap_command(self._socket_path, env, self.limits.disk_mb) + command
            env = {}
        with open(self._tmpdir / "worker.log", "ab") as log:
            process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                cwd=self._tmpdir / "work", env=env, start_new_session=True)
        if not self._jail.namespaces:  # otherwise known from its connection
            root.pid = root.wire_pid = process.pid
            self._table.by_pid[process.pid] = root
        self._table.root, self._root_process = root, process
        self._service.start_soon(self._watch_root, process, root)
        await self._await_ready(root, "the sandbox worker")
        lockdown = None
        if self._jail.active:
            lockdown = {"seccomp": self._jail.seccomp, "disk_mb": self.limits.disk_mb,
                        "bound_pids": self._jail.namespaces and jail.caps_pid_space()}
        if self._cgroup is not None:
            self._cgroup.add(root.pid)
        await root.send({"op": frames.INIT, "tools": list(self._tools.items()), "limits": {
            "memory_mb": self.limits.memory_mb,
            "max_output_chars": self.limits.max_output_chars,
            "recursion_limit": self.limits.recursion_limit,
        }, "jail": lockdown})

    async def _watch_root(self, process: anyio.abc.Process, root: Proc) -> None:
        code = await process.wait()
        if self._jail.namespaces and code > 128:  # bubblewrap reports a signal as 128 + n
            code = -(code - 128)
        root.report_exit(code if code >= 0 else None, -code if code < 0 else None)
        root.observe_exit()  # with the jail, every process in it is gone now
        if root.stream is None:
            root.mark_dead()

    async def _await_ready(self, proc: Proc, what: str) -> None:
        with anyio.move_on_after(self.limits.start_timeout_s):
            await proc.ready.wait()
        if proc.alive:
            return
        self._table.kill(proc, "it did not start in time")
        with anyio.move_on_after(1):
            await proc.exited.wait()
        status = death_cause(proc)
        raise ReplError(f"{what} did not start ({status}){self._log_tail()}")

    async def _spawn_holder(self) -> Proc:
        holder = self._table.new_proc("holder", parent=self._table.root)
        await self._command(self._table.root, {"op": frames.SPAWN, "token": holder.token},
                            timeout=self.limits.start_timeout_s)
        await self._await_ready(holder, "the sandbox namespace process")
        return holder

    async def _fork(self, holder: Proc, *, tool_calls: bool = True) -> ReplSession:
        if self._table.starting_or_running() >= MAX_CONNECTIONS - RESERVED_CONNECTIONS:
            raise ReplError(f"too many sandbox processes are open (at most "
                            f"{MAX_CONNECTIONS - RESERVED_CONNECTIONS}); kill forks you no "
                            "longer need")
        child = self._table.new_proc("fork", parent=holder)
        child.tool_calls_allowed = tool_calls
        try:
            await self._command(holder, {"op": frames.FORK, "token": child.token},
                                timeout=self.limits.start_timeout_s)
            await self._await_ready(child, "the forked sandbox process")
        except BaseException:
            self._table.kill(child, "fork failed")
            raise
        return ReplSession(self, child)

    async def _command(self, proc: Proc, message: dict[str, Any], *,
                       timeout: float | None = None) -> Any:
        """Send a request to ``proc`` and return its reply value (or raise its error)."""
        pending = self._table.new_pending(frozenset({proc}))
        proc.pending.add(pending)
        try:
            await proc.send({**message, "id": pending.id})
            with anyio.move_on_after(self.limits.wall_s if timeout is None else timeout):
                await pending.done.wait()
        finally:
            self._table.pending.pop(pending.id, None)
            proc.pending.discard(pending)
        if not pending.done.is_set():
            self._table.kill(proc, f"it did not answer {message['op']!r} in time")
            raise ReplError(f"the sandbox process did not answer {message['op']!r} in time")
        if pending.reply is None:
            raise ReplProcessDied(f"the sandbox process died ({death_cause(proc)})")
        return reply_value(pending.reply)

    async def _run_cell(self, handle: ReplSession, holder: Proc, code: str, name: str,
                        commit: bool) -> CellResult:
        if not isinstance(code, str) or not isinstance(name, str):
            raise TypeError("code and name must be strings")
        limits = self.limits
        started = time.monotonic()
        deadline = started + limits.wall_s
        runner = self._table.new_proc("cell", parent=holder) if commit else holder
        pending = self._table.new_pending(frozenset({holder, runner}))
        runner.pending.add(pending)
        message = {"op": frames.EXEC, "id": pending.id, "code": code, "name": name,
                   "fork": commit, "cpu_s": limits.cpu_s}
        if commit:
            message["token"] = runner.token
        finished = False
        try:
            await holder.send(message)
            if commit:  # until the child connects, the holder's death also ends the wait
                await wait_any([runner.ready, holder.dead, pending.done],
                                min(limits.start_timeout_s, deadline - time.monotonic()))
                if not runner.ready.is_set() and not pending.done.is_set():
                    self._table.kill(runner, "the cell process did not start")
                    pending.fail()
            with anyio.move_on_after(deadline - time.monotonic()):
                await pending.done.wait()
            if not pending.done.is_set():
                survivors = await self._table.kill_tree(runner, "wall")
                if survivors:
                    logger.error("sandbox processes %s survived a wall-clock kill", survivors)
                pending.fail()
            finished = True
        finally:
            self._table.pending.pop(pending.id, None)
            runner.pending.discard(pending)
            if not finished:
                self._table.kill(runner, "the call was cancelled")
        duration = time.monotonic() - started
        if pending.reply is None:
            with anyio.move_on_after(EXIT_REPORT_WAIT_S):
                await runner.exited.wait()  # the runtime's own view, then the parent's account
                await runner.exit_reported.wait()
            error_type, text = self._describe_death(runner, rolled_back=commit)
            return CellResult("", f"{error_type}: {text}", error_type, None, duration, killed=True)
        if commit and pending.replied_by is runner:
            handle._proc = runner
            with contextlib.suppress(ReplProcessDied):
                await holder.send({"op": frames.EXIT})
        return cell_result(pending.reply, duration)

    def _describe_death(self, proc: Proc, *, rolled_back: bool) -> tuple[str, str]:
        limits = self.limits
        if proc.stop_reason == "wall":
            error_type = "TimeoutError"
            text = (f"cell exceeded its wall-clock limit of {limits.wall_s:g} s "
                    "(tool calls included) and was stopped")
        elif proc.exit_signal == signal.SIGXCPU:
            error_type = "TimeoutError"
            text = f"cell exceeded its CPU time limit of {limits.cpu_s:g} s and was stopped"
        elif proc.stop_reason is not None:
            error_type, text = "RuntimeError", f"the cell was stopped: {proc.stop_reason}"
        elif proc.exit_signal == signal.SIGKILL:
            error_type = "RuntimeError"
            text = ("the process running the cell was killed (SIGKILL), possibly for using "
                    "too much memory")
        else:
            error_type = "RuntimeError"
            text = f"the process running the cell died unexpectedly ({death_cause(proc)})"
        if rolled_back:
            text += "; variables it assigned were discarded"
        else:
            text += "; this forked namespace is gone"
        return error_type, text

    async def _ensure_main(self) -> None:
        """Restart the namespace if its process died; leave a notice for the next cell.

        The whole jail starts afresh (every worker process, forks included, is stopped): what
        killed the namespace, e.g. a process a breached cell left behind, goes with it."""
        main = self._main
        if main is not None and main.alive:
            return
        cause = death_cause(main._proc) if main is not None else "not started"
        await self._stop_processes()
        await self._start_root()
        self._main = ReplSession(self, await self._spawn_holder())
        for method, path in self._setup_steps:
            await getattr(self._main, method)(path)
        for name, value in self._runtime_variables.items():
            await self._main.set_variable(name, value)
        self.restarts += 1
        notice = (f"the sandbox process holding the namespace died ({cause}) and was "
                  "restarted with an empty namespace: variables from earlier cells are gone")
        if self._runtime_variables:
            notice += ("; the runtime-provided variables were restored ("
                       + ", ".join(sorted(self._runtime_variables)) + ")")
        self._unreported_restart = notice

    async def _stop_processes(self) -> None:
        """Kill every worker process and reap the root."""
        process, root = self._root_process, self._table.root
        groups = {process.pid} if process is not None else set()
        if root is not None and root.pid is not None:
            groups.add(root.pid)  # in the jail, the workers have a session of their own
        if process is not None and process.returncode is None:
            for group in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGTERM)  # every process but the root
        others = [proc for proc in list(self._table.by_token.values()) if proc is not root]
        for proc in others:
            self._table.kill(proc, "the REPL was closed")
        with anyio.move_on_after(3):
            for proc in others:
                if proc.stream is not None:
                    await proc.dead.wait()
        if root is not None and root.alive:
            with contextlib.suppress(ReplProcessDied):
                await root.send({"op": frames.EXIT})
        if process is not None:
            with anyio.move_on_after(3):
                await process.wait()
            if process.returncode is None:
                for group in groups:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(group, signal.SIGKILL)
                await process.wait()
        # In the jail the processes die with their namespace, after its outer process exits:
        # let their connections end before the service is cancelled (a read cancelled while
        # its socket turns readable trips asyncio).
        with anyio.move_on_after(2):
            for proc in [root, *others]:
                if proc is not None and proc.stream is not None:
                    await proc.dead.wait()
        self._table.clear()
        self._root_process = None
