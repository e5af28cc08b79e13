"""Runtime-side handle on the sandboxed REPL (anyio; runs under asyncio).

:class:`Repl` starts the worker (``python -m agentrt.interpreter.worker``), keeps one
reader task per worker connection, serves tool calls concurrently, and runs cells with
fork-per-cell rollback: a cell that is killed (CPU or wall-clock limit, crash) leaves the
namespace as it was before the cell. :class:`ReplSession` is a handle on one namespace
(the REPL's own, or a copy-on-write fork of it) -- the primitive the shadow interpreter
builds on.

Example::

    async def handler(name, args, kwargs):
        return {"search": search}[name](*args, **kwargs)

    async with Repl(handler, {"search": "search(query: str) -> list[str]"}) as repl:
        await repl.set_variable("context", text)
        result = await repl.execute("hits = search('x')\\nprint(len(hits))")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import keyword
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .. import jail
from ..protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    TOKEN_ENV,
    NotPlainDataError,
    ProtocolError,
    decode_untrusted,
    encode_frame,
    to_plain,
    wire_exception_type,
)

logger = logging.getLogger(__name__)

ToolHandler = Callable[[str, tuple[Any, ...], dict[str, Any]], Awaitable[Any]]
"""``async handler(tool_name, args, kwargs) -> result`` (result must be plain data)."""

SHADOW_MESSAGES = frozenset({"launch", "shadow_done"})
"""Unsolicited messages a forked process may send; they go to ``Repl.on_message``."""

HELLO_TIMEOUT_S = 10.0
EXIT_REPORT_WAIT_S = 2.0
WORKER_MODULE = "agentrt.interpreter.worker"


@dataclasses.dataclass(frozen=True)
class ReplLimits:
    """Resource limits of the sandbox.

    cpu_s: CPU time one cell may use (RLIMIT_CPU, whole seconds; exceeding it kills the
        cell and rolls it back).
    wall_s: wall-clock time one cell may take, tool calls included; also bounds the other
        commands (set/get variable, summary).
    memory_mb: address-space limit of each namespace process (RLIMIT_AS); allocations past
        it raise MemoryError inside the cell. 0 disables it.
    max_output_chars: printed output kept per cell; the rest is dropped with a note.
    recursion_limit: Python recursion limit inside the sandbox.
    start_timeout_s: how long starting or forking a worker process may take.
    jail: confine the worker processes in the OS jail (namespaces, seccomp, RLIMITs; see
        interpreter/jail.py): None jails when the machine allows it (else one warning),
        True requires it, False turns it off. ``AGENTRT_JAIL=0/1`` changes the default.
    disk_mb: size of the jail's private writable directory (a tmpfs, also the cwd) and the
        largest file a worker may write (RLIMIT_FSIZE, the worker's log included).
    """

    cpu_s: float = 10.0
    wall_s: float = 300.0
    memory_mb: int = 2048
    max_output_chars: int = 1_000_000
    recursion_limit: int = 1000
    start_timeout_s: float = 30.0
    jail: bool | None = None
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ReplLimits.{name} must be positive")
        if self.disk_mb < 1:
            raise ValueError("ReplLimits.disk_mb must be at least 1")
        if self.memory_mb < 0 or self.max_output_chars < 0:
            raise ValueError("ReplLimits.memory_mb and max_output_chars must be >= 0")
        if self.recursion_limit < 100:
            raise ValueError("ReplLimits.recursion_limit must be at least 100")


@dataclasses.dataclass(frozen=True)
class FinalAnswer:
    """An answer recorded by ``FINAL(answer)`` or ``FINAL_VAR("name")``.

    ``value`` is plain data, or the value's repr string when ``is_repr`` is true (it was
    not plain data). ``variable`` names the variable for FINAL_VAR.
    """

    value: Any
    is_repr: bool = False
    variable: str | None = None


@dataclasses.dataclass
class CellResult:
    """The outcome of one cell.

    ``error`` is ``"ExcType: message"`` followed by a short traceback of the cell's own
    lines; ``killed`` is true when a sandbox process died or was stopped (limits, crash).
    """

    stdout: str
    error: str | None
    error_type: str | None
    final: FinalAnswer | None
    duration_s: float
    killed: bool = False

    @property
    def ok(self) -> bool:
        """True when the cell ran without error."""
        return self.error is None


@dataclasses.dataclass(frozen=True)
class VariableSummary:
    """Type name and short repr (memory addresses removed) of one sandbox variable."""

    type_name: str
    repr: str


class ReplError(RuntimeError):
    """The REPL could not do what was asked (failed start, unresponsive worker...)."""


class ReplProcessDied(ReplError):
    """The sandbox process behind a handle is no longer running."""


class _Pending:
    """A request waiting for its reply."""

    def __init__(self, request_id: int, senders: frozenset[_Proc]) -> None:
        self.id = request_id
        self.senders = senders
        self.done = anyio.Event()
        self.reply: dict[str, Any] | None = None
        self.replied_by: _Proc | None = None

    def resolve(self, reply: dict[str, Any], sender: _Proc) -> None:
        if not self.done.is_set():
            self.reply, self.replied_by = reply, sender
            self.done.set()

    def fail(self) -> None:
        self.done.set()


class _Proc:
    """Runtime-side record of one worker process and its connection."""

    def __init__(self, token: str, role: str, parent: _Proc | None = None) -> None:
        self.token = token
        self.role = role
        self.parent = parent
        self.pid: int | None = None       # as the runtime sees it (signals go there)
        self.wire_pid: int | None = None  # as the process sees itself (its PID namespace)
        self.stream: anyio.abc.ByteStream | None = None
        self.send_lock = anyio.Lock()
        self.ready = anyio.Event()    # said hello, or died trying
        self.dead = anyio.Event()     # connection closed: the process is gone
        self.exited = anyio.Event()   # exit status known
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.stop_reason: str | None = None
        self.pending: set[_Pending] = set()
        self.tool_scopes: set[anyio.CancelScope] = set()
        self.tool_calls_allowed = True

    @property
    def alive(self) -> bool:
        return self.stream is not None and not self.dead.is_set()

    def mark_dead(self) -> None:
        if self.dead.is_set():
            return
        self.dead.set()
        self.ready.set()
        for pending in list(self.pending):
            pending.fail()
        for scope in list(self.tool_scopes):
            scope.cancel()

    def record_exit(self, code: int | None, signal_number: int | None) -> None:
        if not self.exited.is_set():
            self.exit_code, self.exit_signal = code, signal_number
            self.exited.set()

    async def send(self, message: dict[str, Any]) -> None:
        if not self.alive:
            raise ReplProcessDied(f"the sandbox {self.role} process is not running")
        frame = encode_frame(message, limit=None)
        try:
            async with self.send_lock:
                await self.stream.send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ReplProcessDied(f"the sandbox {self.role} process is gone") from exc


async def _read_frame(receiver: BufferedByteReceiveStream) -> dict[str, Any]:
    (length,) = HEADER.unpack(await receiver.receive_exactly(HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return decode_untrusted(await receiver.receive_exactly(length))


async def _wait_any(events: Iterable[anyio.Event], timeout: float) -> None:
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


def _plain_tool_value(name: str, value: Any) -> Any:
    """A tool's return value as plain data (pydantic models and dataclasses are dumped)."""
    try:
        return to_plain(value)
    except NotPlainDataError:
        pass
    if callable(getattr(value, "model_dump", None)):
        value = value.model_dump()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return to_plain(value)
    except NotPlainDataError as exc:
        raise TypeError(
            f"tool {name!r} returned a value the sandbox cannot receive: {exc}") from None


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

    def __init__(self, repl: Repl, proc: _Proc) -> None:
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
        """The identity of this handle's process in `Repl.on_message` callbacks."""
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
                                        {"op": "set_var", "name": name, "value": value})

    async def get_variable(self, name: str) -> Any:
        """The value of ``name`` as plain data (KeyError if unbound, TypeError if not plain)."""
        async with self._lock:
            return await self._repl._command(self._require_alive(),
                                               {"op": "get_var", "name": name})

    async def namespace_summary(self) -> dict[str, VariableSummary]:
        """``{name: VariableSummary}`` for every variable in the namespace."""
        async with self._lock:
            raw = await self._repl._command(self._require_alive(), {"op": "summary"})
        if not isinstance(raw, dict):
            raise ReplError("malformed namespace summary from the sandbox")
        return {str(k): VariableSummary(str(v[0]), str(v[1])) for k, v in raw.items()
                if isinstance(v, (list, tuple)) and len(v) == 2}

    async def set_proxy_factory(self, factory: str) -> None:
        """Rebuild the tool proxies with ``"package.module:function"``, called as
        ``factory(name, signature, channel)`` in the worker (see worker.py)."""
        async with self._lock:
            await self._repl._command(self._require_alive(),
                                        {"op": "set_proxy", "factory": factory})

    async def extend(self, hook: str) -> None:
        """Call ``hook(sandbox, channel)`` (``"package.module:function"``) in the worker,
        e.g. to install builtins or replace ``sandbox.compiler``; forks inherit the result."""
        async with self._lock:
            await self._repl._command(self._require_alive(), {"op": "extend", "hook": hook})

    async def kill(self, *, wait: bool = True) -> None:
        """Kill the process holding this namespace (SIGKILL); with ``wait``, until it is gone."""
        proc = self._proc
        self._repl._kill(proc, "killed by the runtime")
        if wait:
            with anyio.move_on_after(5):
                await proc.dead.wait()

    def _require_alive(self) -> _Proc:
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
        self._procs: dict[str, _Proc] = {}
        self._by_pid: dict[int, _Proc] = {}
        self._pending: dict[int, _Pending] = {}
        self._next_request = 0
        self._runtime_variables: dict[str, Any] = {}
        self._setup_steps: list[tuple[str, str]] = []
        self._unreported_restart: str | None = None
        self._tmpdir: Path | None = None
        self._listener: anyio.abc.Listener | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._service: asyncio.Task[None] | None = None
        self._root: _Proc | None = None
        self._root_process: anyio.abc.Process | None = None
        self._main: ReplSession | None = None
        self._jail = jail.OFF
        self.on_message: Callable[[str, dict[str, Any]], None] | None = None
        """Receives ``(process token, message)`` for the shadow messages of forked processes."""
        self.refused_tool_calls = 0
        """Real tool calls refused because they came from a shadow fork."""
        self._handler_takes_line = "line" in inspect.signature(tool_handler).parameters

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
        loop = asyncio.get_running_loop()
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
            self._listener = await anyio.create_unix_listener(self._socket_path, mode=0o600)
            service_ready = anyio.Event()
            self._service = loop.create_task(self._run_service(service_ready))
            await service_ready.wait()
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
            if self._group is not None:
                self._group.cancel_scope.cancel()
            if self._service is not None:
                await asyncio.wait([self._service])
                if not self._service.cancelled() and self._service.exception() is not None:
                    logger.error("repl service task failed", exc_info=self._service.exception())
            if self._listener is not None:
                with contextlib.suppress(Exception):
                    await self._listener.aclose()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        """Pid of the process holding the namespace now."""
        return self._main.pid if self._main is not None else None

    @property
    def root_pid(self) -> int | None:
        """Pid of the root worker process (also the process group of all workers)."""
        return self._root.pid if self._root is not None else None

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
        reported to ``on_message`` as ``refused_call``.

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

    # -- service: connections, frames, tool calls ------------------------------
    async def _run_service(self, ready: anyio.Event) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self._serve_listener)
            ready.set()
            await anyio.sleep_forever()

    async def _serve_listener(self) -> None:
        try:
            await self._listener.serve(self._on_connection)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def _on_connection(self, stream: anyio.abc.ByteStream) -> None:
        proc: _Proc | None = None
        try:
            receiver = BufferedByteReceiveStream(stream)
            with anyio.fail_after(HELLO_TIMEOUT_S):
                hello = await _read_frame(receiver)
            proc = self._accept_hello(hello, _peer_pid(stream))
            if proc is None:
                return
            proc.stream = stream
            proc.ready.set()
            while True:
                self._dispatch(proc, await _read_frame(receiver))
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                anyio.ClosedResourceError, ConnectionError, TimeoutError):
            pass
        except ProtocolError as exc:
            if proc is not None:
                logger.warning("sandbox process %s broke the protocol: %s", proc.pid, exc)
                self._kill(proc, f"it broke the protocol ({exc})")
        except Exception:
            logger.exception("unexpected error on a sandbox connection")
            if proc is not None:
                self._kill(proc, "unexpected error on its connection")
        finally:
            if proc is not None:
                proc.mark_dead()
                self._forget_if_finished(proc)
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()

    def _accept_hello(self, hello: dict[str, Any], peer_pid: int | None) -> _Proc | None:
        token, pid = hello.get("token"), hello.get("pid")
        if hello.get("op") != "hello" or type(token) is not str or type(pid) is not int or pid <= 0:
            return None
        proc = self._procs.get(token)
        if proc is None or proc.stream is not None or proc.dead.is_set():
            return None
        if proc.wire_pid is not None and proc.wire_pid != pid:
            return None
        proc.wire_pid, proc.pid = pid, peer_pid or pid
        self._by_pid[pid] = proc
        return proc

    def _dispatch(self, proc: _Proc, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "reply":
            pending = self._pending.get(message.get("id"))  # type: ignore[arg-type]
            if pending is not None and proc in pending.senders:
                pending.resolve(message, proc)
        elif op == "call":
            call_id, name = message.get("call"), message.get("name")
            args, kwargs = message.get("args"), message.get("kwargs")
            if type(call_id) is not int or type(name) is not str \
                    or type(args) not in (list, tuple) or type(kwargs) is not dict \
                    or not all(type(k) is str for k in kwargs):
                raise ProtocolError("malformed tool call")
            line = message.get("line")
            if not proc.tool_calls_allowed:
                self._refuse_tool_call(proc, call_id, name)
                return
            self._group.start_soon(self._run_tool_call, proc, call_id, name, tuple(args), kwargs,
                                   line if type(line) is int else None)
        elif op == "forked":
            child = self._procs.get(message.get("token"))  # type: ignore[arg-type]
            pid = message.get("pid")
            if child is not None and child.parent is proc and child.wire_pid is None \
                    and type(pid) is int and pid > 0:
                child.wire_pid = pid
                if not self._jail.namespaces:
                    child.pid = pid
                self._by_pid[pid] = child
        elif op == "child_exit":
            target = self._by_pid.get(message.get("pid"))  # type: ignore[arg-type]
            code, number = message.get("code"), message.get("signal")
            if target is not None:
                target.record_exit(code if type(code) is int else None,
                                   number if type(number) is int else None)
                if target.stream is None:
                    target.mark_dead()
                self._forget_if_finished(target)
        elif op in SHADOW_MESSAGES and proc.role == "fork" and self.on_message is not None:
            self.on_message(proc.token, message)
        elif op not in SHADOW_MESSAGES:
            raise ProtocolError(f"unknown message {op!r}")

    def _refuse_tool_call(self, proc: _Proc, call_id: int, name: str) -> None:
        self.refused_tool_calls += 1
        if self.on_message is not None:
            self.on_message(proc.token, {"op": "refused_call", "name": name})
        reply = {"op": "tool_error", "call": call_id, "type": "PermissionError",
                 "original_type": "PermissionError",
                 "message": f"{name}(): a shadow process may not call tools"}

        async def send() -> None:
            with contextlib.suppress(ReplProcessDied):
                await proc.send(reply)

        self._group.start_soon(send)

    async def _run_tool_call(self, proc: _Proc, call_id: int, name: str,
                             args: tuple[Any, ...], kwargs: dict[str, Any],
                             line: int | None = None) -> None:
        reply: dict[str, Any] | None = None
        with anyio.CancelScope() as scope:
            proc.tool_scopes.add(scope)
            try:
                if name not in self._tools:
                    raise LookupError(f"unknown tool {name!r}")
                if self._handler_takes_line:
                    value = await self._tool_handler(name, args, kwargs, line=line)
                else:
                    value = await self._tool_handler(name, args, kwargs)
                reply = {"op": "tool_result", "call": call_id,
                         "value": _plain_tool_value(name, value)}
            except Exception as exc:
                reply = {"op": "tool_error", "call": call_id, "type": wire_exception_type(exc),
                         "original_type": type(exc).__name__, "message": str(exc)}
            finally:
                proc.tool_scopes.discard(scope)
        if reply is not None:
            with contextlib.suppress(ReplProcessDied):
                await proc.send(reply)

    # -- processes ------------------------------------------------------------------
    def _new_proc(self, role: str, parent: _Proc | None = None) -> _Proc:
        proc = _Proc(secrets.token_hex(16), role, parent)
        self._procs[proc.token] = proc
        return proc

    def _forget_if_finished(self, proc: _Proc) -> None:
        if proc.dead.is_set() and proc.exited.is_set() and proc is not self._root:
            self._procs.pop(proc.token, None)
            if proc.wire_pid is not None and self._by_pid.get(proc.wire_pid) is proc:
                del self._by_pid[proc.wire_pid]

    def _kill(self, proc: _Proc, reason: str) -> None:
        """SIGKILL ``proc`` if it may still be running (never a pid known to be gone)."""
        if proc.stop_reason is None:
            proc.stop_reason = reason
        if proc.dead.is_set() or proc.exited.is_set():
            return
        pid = proc.pid
        if pid is None and proc.wire_pid is not None and self._root is not None \
                and self._root.pid is not None:  # forked in the jail, not connected yet
            pid = jail.host_pid(proc.wire_pid, self._root.pid)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

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
        root = self._new_proc("root")
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
            self._by_pid[process.pid] = root
        self._root, self._root_process = root, process
        self._group.start_soon(self._watch_root, process, root)
        await self._await_ready(root, "the sandbox worker")
        lockdown = None
        if self._jail.active:
            lockdown = {"seccomp": self._jail.seccomp, "disk_mb": self.limits.disk_mb,
                        "bound_pids": self._jail.namespaces and jail.caps_pid_space()}
        await root.send({"op": "init", "tools": list(self._tools.items()), "limits": {
            "memory_mb": self.limits.memory_mb,
            "max_output_chars": self.limits.max_output_chars,
            "recursion_limit": self.limits.recursion_limit,
        }, "jail": lockdown})

    async def _watch_root(self, process: anyio.abc.Process, root: _Proc) -> None:
        code = await process.wait()
        if self._jail.namespaces and code > 128:  # bubblewrap reports a signal as 128 + n
            code = -(code - 128)
        root.record_exit(code if code >= 0 else None, -code if code < 0 else None)
        if root.stream is None:
            root.mark_dead()

    async def _await_ready(self, proc: _Proc, what: str) -> None:
        with anyio.move_on_after(self.limits.start_timeout_s):
            await proc.ready.wait()
        if proc.alive:
            return
        self._kill(proc, "it did not start in time")
        with anyio.move_on_after(1):
            await proc.exited.wait()
        status = self._death_cause(proc)
        raise ReplError(f"{what} did not start ({status}){self._log_tail()}")

    async def _spawn_holder(self) -> _Proc:
        holder = self._new_proc("holder", parent=self._root)
        await self._command(self._root, {"op": "spawn", "token": holder.token},
                            timeout=self.limits.start_timeout_s)
        await self._await_ready(holder, "the sandbox namespace process")
        return holder

    async def _fork(self, holder: _Proc, *, tool_calls: bool = True) -> ReplSession:
        child = self._new_proc("fork", parent=holder)
        child.tool_calls_allowed = tool_calls
        try:
            await self._command(holder, {"op": "fork", "token": child.token},
                                timeout=self.limits.start_timeout_s)
            await self._await_ready(child, "the forked sandbox process")
        except BaseException:
            self._kill(child, "fork failed")
            raise
        return ReplSession(self, child)

    async def _command(self, proc: _Proc, message: dict[str, Any], *,
                       timeout: float | None = None) -> Any:
        """Send a request to ``proc`` and return its reply value (or raise its error)."""
        pending = self._new_pending(frozenset({proc}))
        proc.pending.add(pending)
        try:
            await proc.send({**message, "id": pending.id})
            with anyio.move_on_after(self.limits.wall_s if timeout is None else timeout):
                await pending.done.wait()
        finally:
            self._pending.pop(pending.id, None)
            proc.pending.discard(pending)
        if not pending.done.is_set():
            self._kill(proc, f"it did not answer {message['op']!r} in time")
            raise ReplError(f"the sandbox process did not answer {message['op']!r} in time")
        if pending.reply is None:
            raise ReplProcessDied(f"the sandbox process died ({self._death_cause(proc)})")
        return _reply_value(pending.reply)

    def _new_pending(self, senders: frozenset[_Proc]) -> _Pending:
        self._next_request += 1
        pending = _Pending(self._next_request, senders)
        self._pending[pending.id] = pending
        return pending

    async def _run_cell(self, handle: ReplSession, holder: _Proc, code: str, name: str,
                        commit: bool) -> CellResult:
        if not isinstance(code, str) or not isinstance(name, str):
            raise TypeError("code and name must be strings")
        limits = self.limits
        started = time.monotonic()
        deadline = started + limits.wall_s
        runner = self._new_proc("cell", parent=holder) if commit else holder
        pending = self._new_pending(frozenset({holder, runner}))
        runner.pending.add(pending)
        message = {"op": "exec", "id": pending.id, "code": code, "name": name,
                   "fork": commit, "cpu_s": limits.cpu_s}
        if commit:
            message["token"] = runner.token
        finished = False
        try:
            await holder.send(message)
            if commit:  # until the child connects, the holder's death also ends the wait
                await _wait_any([runner.ready, holder.dead, pending.done],
                                min(limits.start_timeout_s, deadline - time.monotonic()))
                if not runner.ready.is_set() and not pending.done.is_set():
                    self._kill(runner, "the cell process did not start")
                    pending.fail()
            with anyio.move_on_after(deadline - time.monotonic()):
                await pending.done.wait()
            if not pending.done.is_set():
                self._kill(runner, "wall")
                with anyio.move_on_after(5):
                    await runner.dead.wait()
                pending.fail()
            finished = True
        finally:
            self._pending.pop(pending.id, None)
            runner.pending.discard(pending)
            if not finished:
                self._kill(runner, "the call was cancelled")
        duration = time.monotonic() - started
        if pending.reply is None:
            with anyio.move_on_after(EXIT_REPORT_WAIT_S):
                await runner.exited.wait()
            error_type, text = self._describe_death(runner, rolled_back=commit)
            return CellResult("", f"{error_type}: {text}", error_type, None, duration, killed=True)
        if commit and pending.replied_by is runner:
            handle._proc = runner
            with contextlib.suppress(ReplProcessDied):
                await holder.send({"op": "exit"})
        return _cell_result(pending.reply, duration)

    def _death_cause(self, proc: _Proc) -> str:
        if proc.exit_signal is not None:
            try:
                name = signal.Signals(proc.exit_signal).name
            except ValueError:
                name = f"signal {proc.exit_signal}"
            return f"killed by {name}"
        if proc.exit_code is not None:
            return f"exit code {proc.exit_code}"
        return proc.stop_reason or "cause unknown"

    def _describe_death(self, proc: _Proc, *, rolled_back: bool) -> tuple[str, str]:
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
            text = f"the process running the cell died unexpectedly ({self._death_cause(proc)})"
        if rolled_back:
            text += "; variables it assigned were discarded"
        else:
            text += "; this forked namespace is gone"
        return error_type, text

    async def _ensure_main(self) -> None:
        """Restart the namespace if its process died; leave a notice for the next cell."""
        main = self._main
        if main is not None and main.alive:
            return
        cause = self._death_cause(main._proc) if main is not None else "not started"
        if self._root is None or not self._root.alive:
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
        process, root = self._root_process, self._root
        groups = {process.pid} if process is not None else set()
        if root is not None and root.pid is not None:
            groups.add(root.pid)  # in the jail, the workers have a session of their own
        if process is not None and process.returncode is None:
            for group in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGTERM)  # every process but the root
        others = [proc for proc in list(self._procs.values()) if proc is not root]
        for proc in others:
            self._kill(proc, "the REPL was closed")
        with anyio.move_on_after(3):
            for proc in others:
                if proc.stream is not None:
                    await proc.dead.wait()
        if root is not None and root.alive:
            with contextlib.suppress(ReplProcessDied):
                await root.send({"op": "exit"})
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
        self._procs.clear()
        self._by_pid.clear()
        self._root = self._root_process = None


def _peer_pid(stream: anyio.abc.ByteStream) -> int | None:
    """The pid of the process at the other end of a Unix socket, as this process sees it
    (workers in the jail's PID namespace know themselves by other numbers)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    except OSError:
        return None
    return pid if pid > 0 else None


def _reply_value(reply: dict[str, Any]) -> Any:
    if reply.get("ok") is True:
        return reply.get("value")
    error_type, message = str(reply.get("error_type")), str(reply.get("message", ""))
    if error_type == "KeyError":
        raise KeyError(message)
    if error_type in ("TypeError", "NotPlainDataError"):
        raise TypeError(message)
    if error_type == "ValueError":
        raise ValueError(message)
    raise ReplError(f"{error_type}: {message}")


def _cell_result(reply: dict[str, Any], duration: float) -> CellResult:
    if reply.get("ok") is not True:
        error_type = str(reply.get("error_type") or "RuntimeError")
        message = f"{error_type}: {reply.get('message', '')}"
        return CellResult("", message, error_type, None, duration)
    value = reply.get("value")
    if not isinstance(value, dict):
        return CellResult("", "RuntimeError: malformed cell result", "RuntimeError", None, duration)
    error, error_type = value.get("error"), value.get("error_type")
    final, raw_final = None, value.get("final")
    if isinstance(raw_final, dict):
        variable = raw_final.get("variable")
        final = FinalAnswer(raw_final.get("value"), bool(raw_final.get("is_repr")),
                            variable if isinstance(variable, str) else None)
    return CellResult(
        stdout=value.get("stdout") if isinstance(value.get("stdout"), str) else "",
        error=error if isinstance(error, str) else None,
        error_type=error_type if isinstance(error_type, str) else None,
        final=final,
        duration_s=duration,
    )
