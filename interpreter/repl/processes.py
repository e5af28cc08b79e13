"""The process table: the runtime-side record of every worker process and pending request."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from typing import Any

import anyio
import anyio.abc

from .. import jail
from ..protocol import encode_frame
from .results import ReplProcessDied


class Pending:
    """A request waiting for its reply from one of ``senders``."""

    def __init__(self, request_id: int, senders: frozenset[Proc]) -> None:
        self.id = request_id
        self.senders = senders
        self.done = anyio.Event()
        self.reply: dict[str, Any] | None = None
        self.replied_by: Proc | None = None

    def resolve(self, reply: dict[str, Any], sender: Proc) -> None:
        if not self.done.is_set():
            self.reply, self.replied_by = reply, sender
            self.done.set()

    def fail(self) -> None:
        self.done.set()


class Proc:
    """Runtime-side record of one worker process and its connection."""

    def __init__(self, token: str, role: str, parent: Proc | None = None) -> None:
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
        self.pending: set[Pending] = set()
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


class ProcessTable:
    """Every worker process by token and by pid, and every request awaiting a reply."""

    def __init__(self) -> None:
        self.by_token: dict[str, Proc] = {}
        self.by_pid: dict[int, Proc] = {}
        self.pending: dict[int, Pending] = {}
        self.root: Proc | None = None
        self._next_request = 0

    def new_proc(self, role: str, parent: Proc | None = None) -> Proc:
        """Register a process that is about to start (it connects with the returned token)."""
        proc = Proc(secrets.token_hex(16), role, parent)
        self.by_token[proc.token] = proc
        return proc

    def new_pending(self, senders: frozenset[Proc]) -> Pending:
        """Register a request whose reply may come from any of ``senders``."""
        self._next_request += 1
        pending = Pending(self._next_request, senders)
        self.pending[pending.id] = pending
        return pending

    def forget_if_finished(self, proc: Proc) -> None:
        """Drop ``proc`` once its connection ended and its exit status is known."""
        if proc.dead.is_set() and proc.exited.is_set() and proc is not self.root:
            self.by_token.pop(proc.token, None)
            if proc.wire_pid is not None and self.by_pid.get(proc.wire_pid) is proc:
                del self.by_pid[proc.wire_pid]

    def kill(self, proc: Proc, reason: str) -> None:
        """SIGKILL ``proc`` if it may still be running (never a pid known to be gone)."""
        if proc.stop_reason is None:
            proc.stop_reason = reason
        if proc.dead.is_set() or proc.exited.is_set():
            return
        pid = proc.pid
        if pid is None and proc.wire_pid is not None and self.root is not None \
                and self.root.pid is not None:  # forked in the jail, not connected yet
            pid = jail.host_pid(proc.wire_pid, self.root.pid)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def clear(self) -> None:
        """Forget every process (after they were all stopped)."""
        self.by_token.clear()
        self.by_pid.clear()
        self.root = None


def death_cause(proc: Proc) -> str:
    """How ``proc`` ended, in words (signal, exit code or the reason it was stopped)."""
    if proc.exit_signal is not None:
        try:
            name = signal.Signals(proc.exit_signal).name
        except ValueError:
            name = f"signal {proc.exit_signal}"
        return f"killed by {name}"
    if proc.exit_code is not None:
        return f"exit code {proc.exit_code}"
    return proc.stop_reason or "cause unknown"
