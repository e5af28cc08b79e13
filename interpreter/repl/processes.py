"""The process table: the runtime-side record of every worker process and pending request.

Liveness is the runtime's own observation, never a worker's word: a process has *exited* when
its pidfd turned readable (or, for the root without the jail, when the runtime reaped it), and
its connection is *dead* when the socket closed. A parent's ``child_exit`` report only names the
cause of an exit the runtime has seen (or confirms one of a child that never connected, after
the runtime checked ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from typing import Any

import anyio
import anyio.abc

from ..frames import HostFrame
from ..protocol import encode_trusted
from . import process_tree
from .results import ReplProcessDied

TREE_KILL_CONFIRM_S = 5.0


class Pending:
    """A request waiting for its reply from one of ``senders``."""

    def __init__(self, request_id: int, senders: frozenset[Proc]) -> None:
        self.id = request_id
        self.senders = senders
        self.done = anyio.Event()
        self.reply: Any = None
        self.replied_by: Proc | None = None

    def resolve(self, reply: Any, sender: Proc) -> None:
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
        self.pid: int | None = None       # as the runtime sees it (from the kernel)
        self.wire_pid: int | None = None  # as the process sees itself (its PID namespace)
        self.pidfd: int | None = None     # held while the process may be running
        self.stream: anyio.abc.ByteStream | None = None
        self.send_lock = anyio.Lock()
        self.ready = anyio.Event()    # said hello, or died trying
        self.dead = anyio.Event()     # connection closed (the process may still run)
        self.exited = anyio.Event()   # the runtime saw the process end
        self.exit_reported = anyio.Event()
        self.exit_code: int | None = None
        self.exit_signal: int | None = None
        self.stop_reason: str | None = None
        self.pending: set[Pending] = set()
        self.tool_scopes: set[anyio.CancelScope] = set()
        self.tool_calls_allowed = True
        self.refused_calls = 0
        self.ignored_frames = 0
        self.refused_connections = 0
        self.session_ended = False

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

    def report_exit(self, code: int | None, signal_number: int | None) -> None:
        """How the process ended, as its parent (or the runtime, for the root) reports it."""
        if not self.exit_reported.is_set():
            self.exit_code, self.exit_signal = code, signal_number
            self.exit_reported.set()

    def observe_exit(self) -> None:
        """The runtime saw the process end (its pidfd turned readable, or it was reaped)."""
        self.exited.set()

    def close_pidfd(self) -> None:
        """Release the pidfd (only its watcher does, after unregistering it)."""
        pidfd, self.pidfd = self.pidfd, None
        if pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(pidfd)

    async def send(self, frame: HostFrame) -> None:
        """Send ``frame`` on this process's connection (ReplProcessDied if it is gone).

        A large frame goes out in pieces, made as they are sent (`encode_trusted`: no copy of
        its large values); if a later piece cannot be sent (cancelled, or the connection
        failed), the process has a partial frame and is killed."""
        if not self.alive:
            raise ReplProcessDied(f"the sandbox {self.role} process is not running")
        try:
            async with self.send_lock:
                started = False
                try:
                    for piece in encode_trusted(frame.to_message()):
                        await self.stream.send(piece)
                        started = True
                except BaseException:
                    if started:
                        self._cut_short()
                    raise
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ReplProcessDied(f"the sandbox {self.role} process is gone") from exc

    def _cut_short(self) -> None:
        """A frame to this process was sent only in part: its connection is unusable."""
        if self.stop_reason is None:
            self.stop_reason = "a frame sent to it was cut short"
        if self.pidfd is not None and not self.exited.is_set():
            process_tree.signal_pidfd(self.pidfd, signal.SIGKILL)
        self.mark_dead()


class ProcessTable:
    """Every worker process by token and by pid, and every request awaiting a reply.

    ``namespaced``: the workers live in the jail's PID namespace.
    """

    def __init__(self) -> None:
        self.by_token: dict[str, Proc] = {}
        self.by_pid: dict[int, Proc] = {}
        self.pending: dict[int, Pending] = {}
        self.root: Proc | None = None
        self.namespaced = False
        self.requests_made = 0

    def new_proc(self, role: str, parent: Proc | None = None) -> Proc:
        """Register a process that is about to start (it connects with the returned token)."""
        proc = Proc(secrets.token_hex(16), role, parent)
        self.by_token[proc.token] = proc
        return proc

    def new_pending(self, senders: frozenset[Proc]) -> Pending:
        """Register a request whose reply may come from any of ``senders``."""
        self.requests_made += 1
        pending = Pending(self.requests_made, senders)
        self.pending[pending.id] = pending
        return pending

    def starting_or_running(self) -> int:
        """How many worker processes are starting or connected."""
        return sum(1 for proc in self.by_token.values() if not proc.dead.is_set())

    def forget_if_finished(self, proc: Proc) -> None:
        """Drop ``proc`` once its connection ended, its exit was seen and its parent (or the
        root) reported how it ended. (A record whose report never comes is replaced when its
        pid is reused.)"""
        if proc.dead.is_set() and proc.exited.is_set() and proc.exit_reported.is_set() \
                and proc is not self.root:
            self.by_token.pop(proc.token, None)
            if proc.wire_pid is not None and self.by_pid.get(proc.wire_pid) is proc:
                del self.by_pid[proc.wire_pid]

    def host_pid_of(self, proc: Proc) -> int | None:
        """``proc``'s pid as the runtime sees it: from its connection, or (a fork that has not
        connected) looked up from the pid its parent reported."""
        if proc.pid is not None:
            return proc.pid
        root = self.root
        if proc.wire_pid is None or root is None or root.pid is None:
            return None
        if self.namespaced:
            return process_tree.host_pid(proc.wire_pid, root.pid)
        members = process_tree.jail_members(root.pid, namespaced=False)
        return proc.wire_pid if proc.wire_pid in members else None

    def is_stray(self, pid: int | None) -> bool:
        """Whether host pid ``pid`` is a live process of the jail (not the root) that is none
        of the workers the runtime knows."""
        root = self.root
        if pid is None or root is None or root.pid is None or pid == root.pid \
                or any(proc.pid == pid for proc in self.by_token.values()):
            return False
        return process_tree.in_jail(pid, root.pid, namespaced=self.namespaced)

    def kill(self, proc: Proc, reason: str | None) -> None:
        """SIGKILL ``proc`` (through its pidfd when it has connected), if it may still run;
        ``reason`` (if given and the first) becomes the cause its death is reported with."""
        if proc.stop_reason is None:
            proc.stop_reason = reason
        if proc.exited.is_set():
            return
        if proc.pidfd is not None:
            process_tree.signal_pidfd(proc.pidfd, signal.SIGKILL)
            return
        pid = self.host_pid_of(proc)
        pidfd = process_tree.open_pidfd(pid) if pid is not None else None
        if pidfd is not None:
            process_tree.signal_pidfd(pidfd, signal.SIGKILL)
            os.close(pidfd)

    async def kill_tree(self, proc: Proc, reason: str) -> list[int]:
        """Kill ``proc``, every process it started, and the jail's strays (adopted by the root,
        unknown to the runtime); wait until they are gone. Returns the pids still running after
        :data:`TREE_KILL_CONFIRM_S` (normally none)."""
        self.kill(proc, reason)
        root = self.root
        pid = self.host_pid_of(proc)
        if root is None or root.pid is None or pid is None or proc is root:
            return []
        keep = {p.pid for p in self.by_token.values()
                if p.pid is not None and p is not proc and not p.exited.is_set()}
        held = process_tree.kill_tree({pid}, root.pid, namespaced=self.namespaced, keep=keep)
        return await anyio.to_thread.run_sync(process_tree.wait_gone, held,
                                              TREE_KILL_CONFIRM_S)

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
