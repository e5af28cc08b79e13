"""The REPL's public API: :class:`Repl` (one persistent namespace) and :class:`ReplSession`.

:class:`Repl` starts the worker (``python -m agentrt.interpreter.worker``) and runs cells with
fork-per-cell rollback: a cell that is killed (CPU or wall-clock limit, crash) leaves the
namespace as it was before the cell. :class:`ReplSession` is a handle on one namespace (the
REPL's own, or a copy-on-write fork of it) -- the primitive the shadow interpreter builds on.
"""

from __future__ import annotations

import contextlib
import keyword
import os
import shutil
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from .. import jail
from ..cgroup import ReplCgroup
from ..frames import Exit, Extend, GetVar, HostFrame, Init, Request, SetVar, Spawn, Summary
from ..protocol import to_plain
from .limits import ReplLimits
from .messages import ReplMessages
from .pool import (
    StartedWorker,
    WorkerPool,
    WorkerSpec,
    socket_path,
    start_worker,
    worker_directory,
)
from .processes import Proc, ProcessTable, death_cause
from .results import CellResult, ReplError, ReplProcessDied, VariableSummary
from .service import ReplService, ToolHandler
from .transport import ReplTransport

RESTART_ATTEMPTS = 3
"""Fresh jails tried, one after another, when the namespace dies while being restored."""


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

    def __init__(self, transport: ReplTransport, proc: Proc) -> None:
        self._transport = transport
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

    @property
    def death_cause(self) -> str:
        """How the process holding this namespace ended (or was stopped), in words."""
        return death_cause(self._proc)

    async def post(self, frame: HostFrame) -> None:
        """Send a frame that expects no reply (e.g. `frames.Shadow`) to the process."""
        await self._transport.post(self._require_alive(), frame)

    async def execute(self, code: str, *, name: str = "cell", commit: bool = False) -> CellResult:
        """Run ``code`` in this namespace and return what it printed, raised and answered."""
        async with self._lock:
            result, self._proc = await self._transport.run_cell(
                self._require_alive(), code, name, commit=commit)
            return result

    async def fork(self, *, shadow: bool = False) -> ReplSession:
        """A new handle on a copy-on-write copy of this namespace.

        With ``shadow`` the copy may never make a real tool call (one that arrives anyway is
        refused: the code gets a PermissionError and the REPL's message stream a
        `frames.RefusedCall`), and it is made at once, without waiting for a cell running here:
        a committed cell runs in a child, so the copy has the namespace from before that cell.
        """
        if shadow:
            child = await self._transport.fork(self._require_alive(), tool_calls=False)
        else:
            async with self._lock:
                child = await self._transport.fork(self._require_alive())
        return ReplSession(self._transport, child)

    async def set_variable(self, name: str, value: Any) -> None:
        """Bind ``name`` to ``value`` (plain data) in this namespace."""
        _check_variable_name(name)
        await self._command(SetVar(name, to_plain(value)))

    async def get_variable(self, name: str) -> Any:
        """The value of ``name`` as plain data (KeyError if unbound, TypeError if not plain)."""
        return await self._command(GetVar(name))

    async def namespace_summary(self) -> dict[str, VariableSummary]:
        """``{name: VariableSummary}`` for every variable in the namespace."""
        raw = await self._command(Summary())
        if not isinstance(raw, dict):
            raise ReplError("malformed namespace summary from the sandbox")
        return {str(k): VariableSummary(str(v[0]), str(v[1])) for k, v in raw.items()
                if isinstance(v, (list, tuple)) and len(v) == 2}

    async def extend(self, hook: str) -> None:
        """Call ``hook(sandbox, channel)`` (``"package.module:function"``) in the worker,
        e.g. to install builtins or replace ``sandbox.compiler``; forks inherit the result."""
        await self._command(Extend(hook))

    async def kill(self, *, wait: bool = True) -> None:
        """Kill the process holding this namespace (SIGKILL); with ``wait``, until it is gone."""
        proc = self._proc
        self._transport.kill(proc, "killed by the runtime")
        if wait:
            with anyio.move_on_after(5):
                await proc.dead.wait()

    async def _command(self, request: Request) -> Any:
        async with self._lock:
            return await self._transport.command(self._require_alive(), request)

    def _require_alive(self) -> Proc:
        if not self._proc.alive:
            raise ReplProcessDied(
                f"the sandbox process {self._proc.pid} holding this namespace is not running")
        return self._proc


class Repl:
    """The sandboxed REPL: one persistent namespace, run cell by cell, in worker processes.

    ``tool_handler`` serves the tool calls made by sandboxed code; ``tool_names`` lists the
    tools (a mapping gives each a one-line signature for ``help()``). ``pool``: take the
    root worker from this pool of warm workers when it has one ready (see pool.py; the
    REPL then does not wait for the worker to start), else start one. Use as an async
    context manager, or call :meth:`start` and :meth:`aclose` from one task (the REPL's
    service runs in a task group of that task). Requires asyncio.
    """

    def __init__(self, tool_handler: ToolHandler,
                 tool_names: Iterable[str] | Mapping[str, str] = (),
                 limits: ReplLimits = ReplLimits(), *, pool: WorkerPool | None = None) -> None:
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
        self._extensions: list[str] = []
        self._unreported_restart: str | None = None
        self._tmpdir: Path | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._service: ReplService | None = None
        self._transport: ReplTransport | None = None
        self._pool = pool
        self.warm_start = False
        """Whether the root worker came warm from the pool."""
        self._root_process: StartedWorker | None = None
        self._main: ReplSession | None = None
        self._jail = jail.OFF
        self._spec = WorkerSpec(False, 0)
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
        self._stack = contextlib.AsyncExitStack()
        try:
            try:
                self._jail = await anyio.to_thread.run_sync(jail.plan_jail, self.limits.jail)
            except jail.JailUnavailable as exc:
                raise ReplError(str(exc)) from None
            self._spec = WorkerSpec.of(self._jail, self.limits)
            warm = self._pool.take(self._spec) if self._pool is not None else None
            self.warm_start = warm is not None
            self._tmpdir = warm.directory if warm is not None else worker_directory()
            self._socket_path = socket_path(self._tmpdir)
            if warm is not None:
                self._root_process = warm  # stopped by aclose() from here on
            self._table.namespaced = self._jail.namespaces
            if self._jail.namespaces:  # a few small writes under /sys/fs/cgroup, if any
                memory = self.limits.memory_mb
                self._cgroup = ReplCgroup.create(
                    (2 * memory + self.limits.disk_mb) * 2**20 if memory else None,
                    jail.MAX_PROCESSES)
            self._service = await self._stack.enter_async_context(ReplService(
                self._socket_path, self._table, self._tools, self._tool_handler,
                messages=self._messages))
            self._transport = ReplTransport(self._table, self.limits,
                                            self._tmpdir / "worker.log")
            self._main = await self._restored_holder(warm)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Kill every worker process and remove the temporary directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self._stop_processes()
                if self._cgroup is not None:
                    await anyio.to_thread.run_sync(self._cgroup.remove)
        finally:
            if self._stack is not None:  # the service's task group: exited where it was entered
                await self._stack.aclose()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

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
        for each refused shadow tool call (see :meth:`fork_shadow`). May be opened before
        :meth:`start`; close it to stop (later messages are then dropped) before opening
        another.
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
        await self._started_main()
        async with self._lock:
            await self._ensure_main()
            if self._unreported_restart is None:
                try:
                    result = await self._main.execute(code, name=name, commit=True)
                except ReplProcessDied:  # the holder died just before the cell started
                    await self._main.kill()  # (its connection may fail before it is seen dead)
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
        _check_variable_name(name)
        value = to_plain(value)
        await self._on_main(lambda main: main.set_variable(name, value))
        self._runtime_variables[name] = value

    async def get_variable(self, name: str) -> Any:
        """The value of ``name`` as plain data (KeyError if unbound, TypeError if not plain)."""
        return await self._on_main(lambda main: main.get_variable(name))

    async def namespace_summary(self) -> dict[str, VariableSummary]:
        """``{name: VariableSummary(type_name, repr)}`` for every variable."""
        return await self._on_main(lambda main: main.namespace_summary())

    async def fork(self) -> ReplSession:
        """A copy-on-write copy of the namespace as a new handle (for speculative runs)."""
        return await self._on_main(lambda main: main.fork())

    async def fork_shadow(self) -> ReplSession:
        """Fork the process holding the namespace *now*, without waiting for a running cell,
        for a shadow run: the fork may never make a real tool call (one that arrives anyway is
        refused: the code gets a PermissionError and the message stream, :meth:`messages`, a
        ``frames.RefusedCall``).

        While a cell runs, the holder still has the namespace as it was before the cell, so
        the fork sees that state. Raises `ReplProcessDied` if the holder is being replaced.
        """
        return await (await self._started_main()).fork(shadow=True)

    async def extend(self, hook: str) -> None:
        """Run ``hook(sandbox, channel)`` (``"package.module:function"``) in the namespace
        process: it may install builtins, adapt guards or replace the compiler. Forks inherit
        it and the REPL runs it again after a restart."""
        await self._on_main(lambda main: main.extend(hook))
        self._extensions.append(hook)

    async def _started_main(self) -> ReplSession:
        if not self._started or self._closed:
            raise ReplError("the REPL is not running (call start() or use 'async with')")
        if self._main is None:
            raise ReplProcessDied("the REPL has no namespace holder")
        return self._main

    async def _on_main(self, call: Callable[[ReplSession], Awaitable[Any]]) -> Any:
        """``await call(main session)``, restarting the namespace first if its process died."""
        await self._started_main()
        async with self._lock:
            await self._ensure_main()
            return await call(self._main)

    async def _start_root(self, warm: StartedWorker | None = None) -> None:
        """Start the root worker (or take ``warm``, from the pool), connect and configure it."""
        root = self._table.new_proc("root")
        # From the event loop's thread, which lives as long as the REPL (the jail's worker
        # dies with the thread that started it).
        process = warm or start_worker(self._spec, self._tmpdir)
        if not self._jail.namespaces:  # otherwise known from its connection
            root.pid = root.wire_pid = process.pid
            self._table.by_pid[process.pid] = root
        self._table.root, self._root_process = root, process
        self._service.start_soon(self._watch_root, process, root)
        process.hand_token(root.token)
        await self._transport.await_ready(root, "the sandbox worker")
        lockdown = None
        if self._jail.active:
            lockdown = {"seccomp": self._jail.seccomp, "disk_mb": self.limits.disk_mb,
                        "bound_pids": self._jail.namespaces and jail.caps_pid_space()}
        if self._cgroup is not None:
            self._cgroup.add(root.pid)
        await root.send(Init({"memory_mb": self.limits.memory_mb,
                              "max_output_chars": self.limits.max_output_chars,
                              "recursion_limit": self.limits.recursion_limit},
                             tuple(self._tools.items()), lockdown))

    async def _watch_root(self, process: StartedWorker, root: Proc) -> None:
        code = await process.wait()
        if self._jail.namespaces and code > 128:  # bubblewrap reports a signal as 128 + n
            code = -(code - 128)
        root.report_exit(code if code >= 0 else None, -code if code < 0 else None)
        root.observe_exit()  # with the jail, every process in it is gone now
        if root.stream is None:
            root.mark_dead()

    async def _spawn_holder(self) -> Proc:
        holder = self._table.new_proc("holder", parent=self._table.root)
        await self._transport.command(self._table.root, Spawn(holder.token),
                                      timeout=self.limits.start_timeout_s)
        await self._transport.await_ready(holder, "the sandbox namespace process")
        return holder

    async def _ensure_main(self) -> None:
        """Restart the namespace if its process died; leave a notice for the next cell.

        The whole jail starts afresh (every worker process, forks included, is stopped): what
        killed the namespace, e.g. a process a breached cell left behind, goes with it."""
        main = self._main
        if main is not None and main.alive:
            return
        cause = main.death_cause if main is not None else "not started"
        for attempt in range(RESTART_ATTEMPTS):
            await self._stop_processes()
            try:
                self._main = await self._restored_holder()
                break
            except ReplProcessDied as exc:  # killed again while being restored
                if attempt == RESTART_ATTEMPTS - 1:
                    raise ReplError(f"the sandbox namespace could not be restarted: it died "
                                    f"{RESTART_ATTEMPTS} times while being restored ({exc})"
                                    ) from exc
        self.restarts += 1
        notice = (f"the sandbox process holding the namespace died ({cause}) and was "
                  "restarted with an empty namespace: variables from earlier cells are gone")
        if self._runtime_variables:
            notice += ("; the runtime-provided variables were restored ("
                       + ", ".join(sorted(self._runtime_variables)) + ")")
        self._unreported_restart = notice

    async def _restored_holder(self, warm: StartedWorker | None = None) -> ReplSession:
        """A fresh jail's namespace (root ``warm`` from the pool, if given) with the extensions
        and runtime variables restored (none at start).

        It is published (``self._main``) only once restored, so no shadow can fork it before:
        a fork taken meanwhile fails on the dead holder instead."""
        await self._start_root(warm)
        holder = ReplSession(self._transport, await self._spawn_holder())
        for hook in self._extensions:
            await holder.extend(hook)
        for name, value in self._runtime_variables.items():
            await holder.set_variable(name, value)
        return holder

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
                await root.send(Exit())
        if process is not None:
            process.let_go()  # a worker still waiting for its token exits
            with anyio.move_on_after(3):
                await process.wait()
            if process.returncode is None:
                for group in groups:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(group, signal.SIGKILL)
                await process.wait()
            process.release()
        # In the jail the processes die with their namespace, after its outer process exits:
        # let their connections end before the service is cancelled (a read cancelled while
        # its socket turns readable trips asyncio).
        with anyio.move_on_after(2):
            for proc in [root, *others]:
                if proc is not None and proc.stream is not None:
                    await proc.dead.wait()
        self._table.clear()
        self._root_process = None
