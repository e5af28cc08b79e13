"""The speculation ledger: early tool calls keyed by (tool, canonical arguments).

The shadow interpreter *launches* early calls; the authoritative run *claims* them by key. A
claim takes the oldest unclaimed call with that key (so N identical calls in the program are N
invocations, matched in order, never one shared result) and waits for it; a claim that finds
nothing is a miss and the caller invokes the tool itself. Early calls run under budgets; what is
never claimed is cancelled at block or turn end and counted as wasted.

Results cross to the sandbox by pickling, so the authoritative run never sees an object that a
shadow process touched.
"""

from __future__ import annotations

import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup


@dataclass(frozen=True)
class SpeculationBudget:
    """Limits on early (speculative) tool calls."""

    max_in_flight: int = 32
    """Early calls running at once; more wait in a queue."""
    max_per_turn: int = 256
    """Early calls launched in one turn; past it, launches are refused."""
    max_arg_bytes_in_flight: int = 4_000_000
    """Total pickled size of the arguments of the early calls running at once."""
    max_per_shadow: int = 64
    """New early calls one shadow run may launch (a runaway loop in a half-written block)."""


@dataclass
class EarlyCall:
    """One speculative invocation of a tool."""

    id: int
    tool: str
    key: str
    args: tuple
    kwargs: dict
    arg_bytes: int
    tag: Any = None
    """Where the launch came from (the runtime uses ``(turn, block)``)."""
    state: str = "queued"
    """queued -> running -> done; or cancelled at any point."""
    launched_s: float = 0.0
    started_s: float | None = None
    finished_s: float | None = None
    claimed_s: float | None = None
    retracted: bool = False
    result: Any = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    _scope: anyio.CancelScope | None = None

    @property
    def claimed(self) -> bool:
        return self.claimed_s is not None

    def outcome(self) -> Any:
        """The call's result (a private copy), or raise its exception."""
        if self.error is not None:
            raise self.error
        return pickle.loads(pickle.dumps(self.result))


Invoker = Callable[[EarlyCall], Awaitable[Any]]


class Ledger:
    """Early calls of one run. Use as ``async with Ledger(invoke, budget, clock) as ledger``."""

    def __init__(self, invoke: Invoker, budget: SpeculationBudget, clock: Callable[[], float]):
        self._invoke = invoke
        self.budget = budget
        self._clock = clock
        self._tg: TaskGroup | None = None
        self.calls: list[EarlyCall] = []
        self._queue: list[EarlyCall] = []
        self._running = 0
        self._running_bytes = 0
        self.launched_this_turn = 0
        self.refused = 0

    async def __aenter__(self) -> "Ledger":
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._tg is not None
        self.cancel_where(lambda c: True)
        self._tg.cancel_scope.cancel()  # claimed calls still running: the run is over
        await self._tg.__aexit__(None, None, None)
        return None  # an exception from the body propagates as it is

    # -- launching -----------------------------------------------------------------------

    def launch(self, tool: str, key: str, args: tuple, kwargs: dict, tag: Any = None) -> EarlyCall | None:
        """Start (or queue) an early call; ``None`` when the per-turn budget is spent."""
        if self.launched_this_turn >= self.budget.max_per_turn:
            self.refused += 1
            return None
        try:
            arg_bytes = len(pickle.dumps((args, kwargs)))
        except Exception:
            return None
        self.launched_this_turn += 1
        call = EarlyCall(
            id=len(self.calls) + 1, tool=tool, key=key, args=args, kwargs=kwargs,
            arg_bytes=arg_bytes, tag=tag, launched_s=self._clock(),
        )
        self.calls.append(call)
        self._queue.append(call)
        self._pump()
        return call

    def _fits(self, call: EarlyCall) -> bool:
        if self._running == 0:
            return True  # one call always runs, however large its arguments
        return (
            self._running < self.budget.max_in_flight
            and self._running_bytes + call.arg_bytes <= self.budget.max_arg_bytes_in_flight
        )

    def _pump(self) -> None:
        assert self._tg is not None, "Ledger used outside `async with`"
        while self._queue and self._fits(self._queue[0]):
            self._start_now(self._queue[0])

    async def _run(self, call: EarlyCall) -> None:
        call.started_s = self._clock()
        with anyio.CancelScope() as scope:
            call._scope = scope
            try:
                call.result = await self._invoke(call)
            except Exception as exc:  # the tool's own failure: kept for the claimer
                call.error = exc
        self._running -= 1
        self._running_bytes -= call.arg_bytes
        if call.state == "running":
            call.state = "done"
            call.finished_s = self._clock()
        call.done.set()
        self._pump()

    # -- claiming and ending -------------------------------------------------------------

    def claim(self, key: str, accept: Callable[[EarlyCall], bool] | None = None
              ) -> EarlyCall | None:
        """The oldest live, unclaimed early call with ``key`` (and for which ``accept`` is true),
        now claimed; ``None`` on a miss."""
        for call in self.calls:
            if call.key == key and not call.claimed and call.state != "cancelled" \
                    and (accept is None or accept(call)):
                call.claimed_s = self._clock()
                if call in self._queue:  # claimed before it could start: start it now
                    self._start_now(call)
                return call
        return None

    def _start_now(self, call: EarlyCall) -> None:
        """Take a queued call out of the queue and run it (budgets are the caller's concern)."""
        assert self._tg is not None
        self._queue.remove(call)
        call.state = "running"
        self._running += 1
        self._running_bytes += call.arg_bytes
        self._tg.start_soon(self._run, call)

    def cancel(self, call: EarlyCall, *, retract: bool = False) -> bool:
        """Cancel an unclaimed call; returns whether it was live."""
        if call.claimed or call.state in ("cancelled", "done"):
            if call.state == "done" and not call.claimed:
                call.state = "cancelled"
                call.retracted = retract
                return True
            return False
        if call in self._queue:
            self._queue.remove(call)
        elif call._scope is not None:
            call._scope.cancel()
        call.state = "cancelled"
        call.retracted = retract
        call.finished_s = self._clock()
        call.done.set()
        return True

    def cancel_where(self, predicate: Callable[[EarlyCall], bool]) -> int:
        """Cancel every unclaimed live call matching ``predicate``; return how many."""
        return sum(self.cancel(c) for c in list(self.calls) if predicate(c))

    def new_turn(self) -> None:
        self.launched_this_turn = 0

    @property
    def in_flight(self) -> int:
        return self._running
