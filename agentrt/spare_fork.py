"""`SpareFork`: a shadow fork made ahead, so that a new shadow does not wait for its fork.

The fork is made for a *state* (for speculation: the turn, the blocks executed and the effects
run) and is valid only while that state holds: a new line of code then reaches its shadow
without a fork's round trip. It is made while the code streams, after the running shadow has run
its code (or `SPARE_DELAY_S`), so that it does not compete with that shadow for the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import anyio
import anyio.abc

from agentrt.interpreter.repl import Repl, ReplError, ReplSession

SPARE_DELAY_S = 0.05
"""How long the spare fork waits for the running shadow to finish its code before it is made."""


@dataclass
class _Spare:
    handle: ReplSession
    state: Hashable
    """The state it was forked in."""


class SpareFork:
    """Keeps one fork of ``repl``'s namespace holder ready for the current ``state()``. ``ready``
    (None: at once) is set once the REPL has started; `keep` runs the keeping."""

    def __init__(self, repl: Repl, state: Callable[[], Hashable],
                 ready: anyio.Event | None = None) -> None:
        self.repl = repl
        self._state = state
        self._ready = ready
        self._spare: _Spare | None = None
        self._wanted = anyio.Event()
        self._ran = anyio.Event()
        """The running shadow has run all its code (or there is none)."""
        self._ran.set()
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def handle(self) -> ReplSession | None:
        """The spare fork, if one is ready."""
        return None if self._spare is None else self._spare.handle

    def want(self) -> None:
        """The state may have changed: make a fork for it if the spare is not of it."""
        self._wanted.set()

    def shadow_started(self) -> None:
        self._ran = anyio.Event()

    def shadow_ran(self) -> None:
        self._ran.set()

    def take(self) -> ReplSession | None:
        """The spare fork, if it is alive and of the current state (another is made); a
        spare of another state is killed."""
        spare, self._spare = self._spare, None
        self._wanted.set()
        if spare is None:
            return None
        if spare.state == self._state() and spare.handle.alive:
            return spare.handle
        assert self._tg is not None
        self._tg.start_soon(functools.partial(spare.handle.kill, wait=False))
        return None

    async def keep(self, tg: anyio.abc.TaskGroup) -> None:
        """Keep a fork ready, forever (stale spares are killed in ``tg``)."""
        self._tg = tg
        if self._ready is not None:
            await self._ready.wait()
        while True:
            await self._wanted.wait()
            self._wanted = anyio.Event()
            if self._spare is not None and self._spare.state == self._state():
                continue
            await self.kill()
            with anyio.move_on_after(SPARE_DELAY_S):
                await self._ran.wait()
            state = self._state()
            try:
                handle = await self.repl.fork_shadow()
            except (ReplError, OSError):  # the holder is being replaced: try again
                await anyio.sleep(0.01)
                self._wanted.set()
                continue
            if state != self._state():
                await handle.kill(wait=False)
                self._wanted.set()
                continue
            self._spare = _Spare(handle, state)

    async def kill(self) -> None:
        """Kill the spare fork, if there is one."""
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(Exception):
                await spare.handle.kill(wait=False)

    def release(self) -> None:
        """Let go of the spare (the run is over; it was killed)."""
        self._spare = None
