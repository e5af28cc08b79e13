"""The sandbox worker process: ``python -m agentrt.interpreter.worker <socket path>``.

The runtime starts one *root* process: once loaded, it says so on stdout and waits for its
hello token on stdin (so that it can be started ahead of use, see repl/pool.py). Every process
connects to the runtime's Unix socket with its own connection and introduces itself with
``hello`` (see protocol.py).

* **root** never runs model code. It is a child subreaper (Linux), so processes orphaned
  by fork-per-cell are reparented to it and reaped; it reports every exit it reaps, and on
  ``spawn`` forks a fresh *holder* with an empty namespace.
* **holder** holds a namespace and never runs model code itself when asked to ``exec`` with
  ``fork``: it forks a **cell** child that runs the cell under ``RLIMIT_CPU``, replies, and
  then becomes the holder (the runtime tells the old one to exit). If the child dies, the
  old holder still has the namespace as it was: the cell is rolled back.
* **fork** children (``fork`` command) are copy-on-write snapshots that serve the same
  commands; they may run cells in place (``exec`` without ``fork``).

Tool calls: each tool is a proxy callable (:func:`blocking_proxy`) that blocks on
:meth:`ToolChannel.call`. ``extend`` runs a hook ``hook(sandbox, channel)`` in the process (to
add builtins, adapt guards or replace ``sandbox.compiler``), given as
``"package.module:function"`` and inherited by later forks. Processes must stay
single-threaded: they fork.

Every frame is a dataclass of frames.py; a frame from the runtime that does not parse is
answered with an error when it is a request, and otherwise stops the process loudly (its
traceback goes to the worker log): both sides must agree on every op.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import random
import resource
import select
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .arg_limits import check_arguments
from .frames import (
    EXIT_PROTOCOL,
    ChildExit,
    Exec,
    Exit,
    Extend,
    Fork,
    Forked,
    GetVar,
    Hello,
    HostFrame,
    Init,
    Reply,
    Request,
    SetVar,
    Shadow,
    Spawn,
    Summary,
    ToolCall,
    ToolFailed,
    ToolResult,
    WorkerFrame,
    parse_host_frame,
)
from .protocol import (
    MAX_VALUE_BYTES,
    MAX_VALUE_DEPTH,
    FramedSocket,
    FrameTooLargeError,
    NotPlainDataError,
    PlainDataTooLarge,
    ProtocolError,
    plain_size,
    safe_exception_class,
    to_plain,
)
from .rate import TokenBucket
from .sandbox import Sandbox, ToolError

EXIT_START_FAILED = 70
_PR_SET_CHILD_SUBREAPER = 36
EXIT_REPORTS_BURST = 256
EXIT_REPORTS_PER_S = 64
"""The rate at which a process reports the exits it reaps (beyond it, causes go unnamed):
processes a breached cell leaves behind cannot make the root flood the runtime."""

@dataclass(frozen=True)
class WorkerConfig:
    """Settings a worker receives in ``init`` and passes on to every process it forks."""

    socket_path: str
    memory_mb: int
    max_output_chars: int
    recursion_limit: int
    tools: tuple[tuple[str, str], ...]


class ToolChannel:
    """Tool calls from sandboxed code to the runtime, over this process's connection."""

    def __init__(self, process: _Process) -> None:
        self._process = process
        self._next_call = 0

    def start_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Send a tool call without waiting; returns its call id (see :meth:`wait`)."""
        check_arguments(name, args, kwargs)
        try:
            plain_args, plain_kwargs = to_plain(tuple(args)), to_plain(dict(kwargs))
        except NotPlainDataError as exc:
            raise TypeError(f"tool {name!r}: arguments must be plain data: {exc}") from None
        self._next_call += 1
        try:
            self._process.send(ToolCall(self._next_call, name, plain_args, plain_kwargs,
                                        _cell_line()))
        except FrameTooLargeError as exc:
            raise ValueError(f"tool {name!r}: arguments are too large ({exc})") from None
        return self._next_call

    def wait(self, call_id: int) -> Any:
        """Block until call ``call_id`` finishes; return its value or raise its error."""
        outcome = self._process.wait_tool_outcome(call_id)
        if isinstance(outcome, ToolResult):
            return outcome.value
        exception_class = safe_exception_class(outcome.type)
        if exception_class is not None:
            raise exception_class(outcome.message)
        raise ToolError(f"{outcome.original_type}: {outcome.message}")

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a tool call and wait for it."""
        return self.wait(self.start_call(name, args, kwargs))


def _cell_line() -> int | None:
    """The line of the running cell that made the current tool call."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<cell"):
            return frame.f_lineno
        frame = frame.f_back
    return None


def blocking_proxy(name: str, signature: str, channel: ToolChannel) -> Callable[..., Any]:
    """The default proxy factory: calling the proxy blocks until the tool returns."""

    def call_tool(*args: Any, **kwargs: Any) -> Any:
        return channel.call(name, args, kwargs)

    call_tool.__name__ = call_tool.__qualname__ = name
    call_tool.__doc__ = signature
    return call_tool


def load_callable(path: str) -> Callable[..., Any]:
    """Import a callable given as ``"package.module:function"``."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    value = getattr(importlib.import_module(module_name), attribute)
    if not callable(value):
        raise TypeError(f"{path} is not callable")
    return value


class CappedStream:
    """A text stream that passes at most ``max_chars`` characters on to ``stream`` over its
    lifetime (the worker's stderr log: nothing in the sandbox can fill the disk through it)."""

    def __init__(self, stream: Any, max_chars: int) -> None:
        self._stream = stream
        self._room = max_chars
        self._noted = False

    def write(self, text: str) -> int:
        """Write what still fits; note the truncation once."""
        if self._room <= 0:
            if not self._noted:
                self._noted = True
                self._stream.write("\n[worker stderr truncated]\n")
            return len(text)
        part = text[:self._room]
        self._room -= len(part)
        self._stream.write(part)
        return len(text)

    def flush(self) -> None:
        """Flush the underlying stream."""
        self._stream.flush()

    def isatty(self) -> bool:
        """Never a terminal."""
        return False

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", "utf-8")


def _ignore_signal(signum: int, frame: Any) -> None:
    """SIGCHLD handler: its only job is to wake ``select`` through the wakeup fd."""


class _Process:
    """Shared loop of the root and holder processes: serve commands, reap children."""

    role = "process"

    def __init__(self, config: WorkerConfig, link: FramedSocket) -> None:
        self._config = config
        self._link = link
        self._backlog: deque[HostFrame] = deque()
        self._tool_outcomes: dict[int, ToolResult | ToolFailed] = {}
        self._wakeup: tuple[int, int] | None = None
        self._handlers = self.handlers()
        self._report_budget = TokenBucket(EXIT_REPORTS_BURST, EXIT_REPORTS_PER_S)
        self._open_child_watch()

    def handlers(self) -> dict[type[HostFrame], Callable[[Any], None]]:
        """The frames this kind of process serves, by class (see frames.py)."""
        return {Exit: self._on_exit}

    # -- connection ------------------------------------------------------------
    def send(self, frame: WorkerFrame) -> None:
        """Send a frame; exit quietly if the runtime has gone away."""
        try:
            self._link.send(frame.to_message())
        except FrameTooLargeError:
            raise
        except OSError:
            os._exit(0)

    def receive(self) -> HostFrame:
        """The next frame from the runtime; exit quietly if the runtime has gone away.

        A request that does not parse is answered with an error and skipped; any other frame
        that does not parse stops the process (exit status :data:`EXIT_PROTOCOL`), saying why
        in the worker log."""
        while True:
            try:
                message = self._link.recv()
            except (EOFError, OSError):
                os._exit(0)
            try:
                return parse_host_frame(message)
            except ProtocolError as exc:
                request_id = message.get("id") if isinstance(message, dict) else None
                if type(request_id) is not int:
                    print(f"sandbox {self.role} process: {exc}", file=sys.stderr, flush=True)
                    os._exit(EXIT_PROTOCOL)
                self.reply_error(request_id, "ProtocolError", str(exc))

    def wait_tool_outcome(self, call_id: int) -> ToolResult | ToolFailed:
        """Read frames until call ``call_id`` has an outcome; keep other frames for later."""
        while call_id not in self._tool_outcomes:
            frame = self.receive()
            if isinstance(frame, (ToolResult, ToolFailed)):
                self._tool_outcomes[frame.call] = frame
            else:
                self._backlog.append(frame)
        return self._tool_outcomes.pop(call_id)

    def reply(self, request_id: Any, value: Any = None) -> None:
        """Answer request ``request_id`` with ``value`` (an error reply if it is too large)."""
        try:
            plain_size(value, limit=MAX_VALUE_BYTES, max_depth=MAX_VALUE_DEPTH)
            self.send(Reply(request_id, True, value))
        except (FrameTooLargeError, PlainDataTooLarge) as exc:
            self.reply_error(request_id, "OverflowError",
                             f"the result is too large to return: {exc}")

    def reply_error(self, request_id: Any, error_type: str, message: str) -> None:
        """Answer request ``request_id`` with an error."""
        self.send(Reply(request_id, False, None, error_type, message[:10_000]))

    # -- loop ----------------------------------------------------------------------
    def serve(self) -> NoReturn:
        """Serve commands until told to exit or the runtime disconnects. Nothing escapes: an
        unexpected error stops the process (its traceback goes to the worker log)."""
        try:
            self._serve()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(EXIT_PROTOCOL)

    def _serve(self) -> None:
        while True:
            if self._backlog:
                self._dispatch(self._backlog.popleft())
                continue
            readable, _, _ = select.select([self._link.fileno(), self._wakeup[0]], [], [])
            if self._wakeup[0] in readable:
                self._drain_wakeup()
                self._reap_children()
            if self._link.fileno() in readable:
                self._dispatch(self.receive())

    def _dispatch(self, frame: HostFrame) -> None:
        handler = self._handlers.get(type(frame))
        request_id = frame.id if isinstance(frame, Request) else None
        if handler is None:  # a frame meant for another kind of process (or a stale outcome)
            if request_id is not None:
                self.reply_error(request_id, "ValueError",
                                 f"{self.role} cannot handle {frame.op!r}")
            return
        try:
            handler(frame)
        except Exception as exc:
            if request_id is not None:
                self.reply_error(request_id, type(exc).__name__, str(exc))

    def _on_exit(self, frame: Exit) -> None:
        os._exit(0)

    # -- children --------------------------------------------------------------
    def _open_child_watch(self) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        self._wakeup = (read_end, write_end)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _ignore_signal)

    def _close_child_watch(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if self._wakeup is not None:
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self._wakeup[0], 512):
                pass
        except BlockingIOError:
            pass

    def _reap_children(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if self._report_budget.take():
                self.send(ChildExit(pid, code if code >= 0 else None, -code if code < 0 else None))

    def _fork(self, token: str, role: str,
              prepare: Callable[[], None] | None = None) -> int | None:
        """Fork a child that connects with ``token``; returns the pid in the parent, None in
        the child (which then has its own connection and no child watch). ``prepare`` runs
        in the child before it says hello."""
        random_state = random.getstate()  # os.fork reseeds the global Random in the child
        pid = os.fork()
        if pid:
            self.send(Forked(token, pid))
            return pid
        try:
            random.setstate(random_state)
            self._close_child_watch()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._link.close()
            self._backlog.clear()
            self._tool_outcomes.clear()
            if prepare is not None:
                prepare()
            self._link = FramedSocket.connect(self._config.socket_path)
            self._link.send(Hello(os.getpid(), role, token).to_message())
        except BaseException:
            traceback.print_exc()
            os._exit(EXIT_START_FAILED)
        return None


class _Root(_Process):
    """The process the runtime starts: reaps orphans and spawns namespace holders."""

    role = "root"

    def handlers(self) -> dict[type[HostFrame], Callable[[Any], None]]:
        return {**super().handlers(), Spawn: self._on_spawn}

    def _on_spawn(self, frame: Spawn) -> None:
        prepared: list[Sandbox] = []
        pid = self._fork(frame.token, "holder",
                         lambda: prepared.append(_new_sandbox(self._config)))
        if pid is not None:
            self.reply(frame.id, pid)
            return
        try:
            holder = _Holder(self._config, self._link, prepared[0])
        except BaseException:
            traceback.print_exc()
            os._exit(EXIT_START_FAILED)
        holder.serve()

    def _on_exit(self, frame: Exit) -> None:
        """Reap whatever children are left (the runtime killed them), then exit."""
        deadline = time.monotonic() + 2.0
        confirmed_empty = False
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                if confirmed_empty:
                    break
                confirmed_empty = True  # look once more: orphans may still be on their way
                time.sleep(0.05)
                continue
            confirmed_empty = False
            if pid == 0:
                time.sleep(0.01)
        os._exit(0)


class _Holder(_Process):
    """A process holding a sandbox namespace."""

    role = "holder"

    def __init__(self, config: WorkerConfig, link: FramedSocket, sandbox: Sandbox) -> None:
        super().__init__(config, link)
        self._sandbox = sandbox
        self._channel = ToolChannel(self)
        for name, signature in config.tools:
            sandbox.install_tool(name, signature, blocking_proxy(name, signature, self._channel))

    def handlers(self) -> dict[type[HostFrame], Callable[[Any], None]]:
        return {**super().handlers(), Exec: self._on_exec, Fork: self._on_fork,
                SetVar: self._on_set_var, GetVar: self._on_get_var, Summary: self._on_summary,
                Shadow: self._on_shadow, Extend: self._on_extend}

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox holding this process's namespace."""
        return self._sandbox

    @property
    def channel(self) -> ToolChannel:
        """The tool channel this process's tool proxies call."""
        return self._channel

    # -- commands ----------------------------------------------------------------
    def _on_exec(self, frame: Exec) -> None:
        if frame.fork:
            if self._fork(str(frame.token), "cell") is not None:
                return
            try:
                self._run_cell(frame)
            finally:
                self._open_child_watch()  # this process now holds the namespace
            return
        self._run_cell(frame)

    def _run_cell(self, frame: Exec) -> None:
        if not isinstance(frame.code, str) or not isinstance(frame.name, str):
            self.reply_error(frame.id, "TypeError", "exec needs str code and name")
            return
        _limit_cpu(frame.cpu_s)
        try:
            outcome = self._sandbox.execute(frame.code, frame.name)
        finally:
            _unlimit_cpu()
        self.reply(frame.id, outcome.to_message())

    def _on_fork(self, frame: Fork) -> None:
        pid = self._fork(frame.token, "fork")
        if pid is not None:
            self.reply(frame.id, pid)
            return
        self._open_child_watch()

    def _on_set_var(self, frame: SetVar) -> None:
        self._sandbox.set_variable(frame.name, frame.value)
        self.reply(frame.id)

    def _on_get_var(self, frame: GetVar) -> None:
        self.reply(frame.id, self._sandbox.get_variable(frame.name))

    def _on_summary(self, frame: Summary) -> None:
        self.reply(frame.id, self._sandbox.summary())

    def _on_shadow(self, frame: Shadow) -> None:
        """Become a shadow run (see shadow_worker.py); never returns."""
        from .shadow_worker import run_shadow

        _limit_cpu(frame.cpu_s)
        run_shadow(self, frame)

    def _on_extend(self, frame: Extend) -> None:
        load_callable(frame.hook)(self._sandbox, self._channel)
        self.reply(frame.id)


def _new_sandbox(config: WorkerConfig) -> Sandbox:
    """Apply the namespace process's limits and create its empty sandbox."""
    _limit_memory(config.memory_mb)
    sys.setrecursionlimit(config.recursion_limit)
    from . import shadow_worker  # noqa: F401  (loaded here once, so shadow forks start at once)

    return Sandbox(max_output_chars=config.max_output_chars)


def _limit_memory(memory_mb: int | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not memory_mb:
        return
    limit = int(memory_mb) * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _limit_cpu(seconds: Any) -> None:
    """Let this process use ``seconds`` more CPU time (whole seconds), then SIGXCPU."""
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _unlimit_cpu() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


def _become_subreaper() -> None:
    """Make orphaned descendants ours to reap (Linux only; elsewhere init reaps them)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


MAX_TOKEN_LINE = 256


def _await_token() -> str:
    """Say the worker is loaded (a line on stdout), then read the token of the REPL it is to
    serve (a line on stdin; a warm worker of the pool, repl/pool.py, waits here until a REPL
    takes it). At the end of input, exit: the runtime let it go. Both pipes are then replaced
    by /dev/null."""
    from . import shadow_worker  # noqa: F401  (what the namespace process loads later)

    with contextlib.suppress(OSError):
        os.write(1, b"ready\n")
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, MAX_TOKEN_LINE)
        if not chunk or len(line) > MAX_TOKEN_LINE:
            os._exit(0)
        line += chunk
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    return line.decode("ascii", "replace").strip()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the root worker process."""
    argv = sys.argv if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python -m agentrt.interpreter.worker <socket path>")
    socket_path = argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the runtime SIGTERMs the whole group
    token = _await_token()
    _become_subreaper()
    link = FramedSocket.connect(socket_path)
    link.send(Hello(os.getpid(), "root", token).to_message())
    init = parse_host_frame(link.recv())
    if not isinstance(init, Init):
        sys.exit(f"expected init, got {init.op!r}")
    limits = init.limits
    sys.stderr = CappedStream(sys.stderr, int(limits["max_output_chars"]))
    lockdown = init.jail
    if lockdown:  # before anything else runs here: every later process is a fork of this one
        from .jail import lock_down

        lock_down(lockdown.get("seccomp"), int(lockdown["disk_mb"]),
                  bool(lockdown.get("bound_pids")))
    config = WorkerConfig(
        socket_path=socket_path,
        memory_mb=int(limits["memory_mb"]),
        max_output_chars=int(limits["max_output_chars"]),
        recursion_limit=int(limits["recursion_limit"]),
        tools=tuple((str(name), str(signature)) for name, signature in init.tools),
    )
    _Root(config, link).serve()


if __name__ == "__main__":
    # Run the canonical module's main, so that imported factories see the same classes.
    from agentrt.interpreter.worker import main as _main

    _main()
