"""The runtime's requests to its worker processes, shared by `Repl` and `ReplSession`.

:class:`ReplTransport` sends frames and waits for their replies: commands (set or read a
variable, fork, extend...), cells with fork-per-cell rollback and the wall-clock limit, and
kills. It knows processes (the process table's records), never sessions: a session holds the
process now holding its namespace and replaces it with the one :meth:`ReplTransport.run_cell`
returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio

from ..frames import Exec, Exit, Fork, HostFrame, Request
from .limits import ReplLimits
from .processes import Proc, ProcessTable, death_cause
from .results import CellResult, ReplError, ReplProcessDied, cell_result, reply_value
from .service import MAX_CONNECTIONS

logger = logging.getLogger(__name__)

EXIT_REPORT_WAIT_S = 2.0
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


class ReplTransport:
    """Requests to the worker processes of one REPL (see the module docstring).

    ``log`` is the workers' stderr log, quoted when a process does not start."""

    def __init__(self, table: ProcessTable, limits: ReplLimits, log: Path) -> None:
        self.table = table
        self.limits = limits
        self.log = log

    async def post(self, proc: Proc, frame: HostFrame) -> None:
        """Send a frame that expects no reply (`ReplProcessDied` if the process is gone)."""
        await proc.send(frame)

    async def command(self, proc: Proc, request: Request, *,
                      timeout: float | None = None) -> Any:
        """Send ``request`` to ``proc`` and return its reply value (or raise its error)."""
        pending = self.table.new_pending(frozenset({proc}))
        proc.pending.add(pending)
        try:
            await proc.send(_numbered(request, pending.id))
            with anyio.move_on_after(self.limits.wall_s if timeout is None else timeout):
                await pending.done.wait()
        finally:
            self.table.pending.pop(pending.id, None)
            proc.pending.discard(pending)
        if not pending.done.is_set():
            self.table.kill(proc, f"it did not answer {request.op!r} in time")
            raise ReplError(f"the sandbox process did not answer {request.op!r} in time")
        if pending.reply is None:
            raise ReplProcessDied(f"the sandbox process died ({death_cause(proc)})")
        return reply_value(pending.reply)

    async def await_ready(self, proc: Proc, what: str) -> None:
        """Wait until ``proc`` said hello; kill it and raise `ReplError` if it does not in
        time."""
        with anyio.move_on_after(self.limits.start_timeout_s):
            await proc.ready.wait()
        if proc.alive:
            return
        self.table.kill(proc, "it did not start in time")
        with anyio.move_on_after(1):
            await proc.exited.wait()
        raise ReplError(f"{what} did not start ({death_cause(proc)}){self.log_tail()}")

    def log_tail(self) -> str:
        """The end of the workers' log, as a suffix for an error message ("" if empty)."""
        try:
            text = self.log.read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"\nworker log:\n{text[-2000:]}" if text else ""

    async def fork(self, holder: Proc, *, tool_calls: bool = True) -> Proc:
        """A connected copy-on-write fork of ``holder``'s namespace (``tool_calls``: whether
        its tool calls are served, else refused)."""
        if self.table.starting_or_running() >= MAX_CONNECTIONS - RESERVED_CONNECTIONS:
            raise ReplError(f"too many sandbox processes are open (at most "
                            f"{MAX_CONNECTIONS - RESERVED_CONNECTIONS}); kill forks you no "
                            "longer need")
        child = self.table.new_proc("fork", parent=holder)
        child.tool_calls_allowed = tool_calls
        try:
            await self.command(holder, Fork(child.token), timeout=self.limits.start_timeout_s)
            await self.await_ready(child, "the forked sandbox process")
        except BaseException:
            self.table.kill(child, "fork failed")
            raise
        return child

    def kill(self, proc: Proc, reason: str) -> None:
        """SIGKILL ``proc`` (``reason`` names the cause of its death)."""
        self.table.kill(proc, reason)

    async def run_cell(self, holder: Proc, code: str, name: str, *,
                       commit: bool) -> tuple[CellResult, Proc]:
        """Run a cell in ``holder``'s namespace: (its result, the process holding the namespace
        afterwards). With ``commit`` a forked child runs it and becomes the holder if it
        replies (the old holder is told to exit); if the child dies, ``holder`` still has the
        namespace as it was. Without it the cell runs in ``holder`` itself."""
        if not isinstance(code, str) or not isinstance(name, str):
            raise TypeError("code and name must be strings")
        limits, table = self.limits, self.table
        started = time.monotonic()
        deadline = started + limits.wall_s
        runner = table.new_proc("cell", parent=holder) if commit else holder
        pending = table.new_pending(frozenset({holder, runner}))
        runner.pending.add(pending)
        request = Exec(code, name, commit, limits.cpu_s, runner.token if commit else None,
                       pending.id)
        finished = False
        try:
            await holder.send(request)
            if commit:  # until the child connects, the holder's death also ends the wait
                await wait_any([runner.ready, holder.dead, pending.done],
                               min(limits.start_timeout_s, deadline - time.monotonic()))
                if not runner.ready.is_set() and not pending.done.is_set():
                    table.kill(runner, "the cell process did not start")
                    pending.fail()
            with anyio.move_on_after(deadline - time.monotonic()):
                await pending.done.wait()
            if not pending.done.is_set():
                survivors = await table.kill_tree(runner, "wall")
                if survivors:
                    logger.error("sandbox processes %s survived a wall-clock kill", survivors)
                pending.fail()
            finished = True
        finally:
            table.pending.pop(pending.id, None)
            runner.pending.discard(pending)
            if not finished:
                table.kill(runner, "the call was cancelled")
        duration = time.monotonic() - started
        if pending.reply is None:
            with anyio.move_on_after(EXIT_REPORT_WAIT_S):
                await runner.exited.wait()  # the runtime's own view, then the parent's account
                await runner.exit_reported.wait()
            error_type, text = self._describe_death(runner, rolled_back=commit)
            result = CellResult("", f"{error_type}: {text}", error_type, None, duration,
                                killed=True)
            return result, holder
        if commit and pending.replied_by is runner:
            with contextlib.suppress(ReplProcessDied):
                await holder.send(Exit())
            return cell_result(pending.reply, duration), runner
        return cell_result(pending.reply, duration), holder

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


def _numbered(request: Request, request_id: int) -> Request:
    """``request`` carrying the id its reply will answer."""
    return dataclasses.replace(request, id=request_id)  # type: ignore[type-var]
