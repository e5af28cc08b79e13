"""The speculation ledger: the early tool calls of one run, keyed by (tool, canonical arguments).

Shadow runs *launch* early calls; the authoritative run *claims* them by key. A claim takes the
oldest live, unclaimed call with that key from the same turn (so N identical calls in the
program are N invocations, matched in order, never one shared result) and waits for it; a claim
that finds nothing is a miss and the caller invokes the tool itself. A call that an effect made
stale is cancelled (`cancel_unclaimed` with the tools that read what the effect writes), so
every live call may serve. The ledger owns every
budget on early calls (`SpeculationBudget`) and every question asked about them: which calls a
new shadow may adopt, which to cancel, which to retire once their block has executed. What a
retired call counts as (wasted or retracted) is decided by `agentrt.claims`. A key built from
large arguments is kept as a digest (`compact_key`).

Arguments are measured with `plain_size` (shared references counted each time), not
serialised; a call whose arguments pass ``max_arg_bytes_per_launch``, or would take the run's
total past ``max_arg_bytes_per_run``, is not launched. The ledger holds a call's payloads only as
long as they can be used: its arguments until its tool has run, its result until it can no
longer serve a claim or a shadow (its block executed, its turn ended, the run ended); then the
call is dropped (`retire`, `release`). A claim gets a private copy of the result.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from agentrt.interpreter.arg_limits import MAX_ARG_BYTES, MAX_ARG_DEPTH
from agentrt.interpreter.protocol import PlainDataTooLarge, plain_size


MAX_KEY_CHARS = 256
"""Call keys longer than this (large arguments) are kept as a digest (`compact_key`)."""


def compact_key(key: str) -> str:
    """``key`` when it is short, else ``"sha256:"`` and its digest: a call with large arguments
    does not keep a copy of them in its key."""
    if len(key) <= MAX_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class SpeculationBudget:
    """Limits on early (speculative) tool calls."""

    max_in_flight: int = 32
    """Early calls running at once; more wait in a queue."""
    max_per_turn: int = 256
    """Early calls launched in one turn; past it, launches are refused."""
    max_arg_bytes_in_flight: int = 4_000_000
    """Total size of the arguments of the early calls running at once (`plain_size`)."""
    max_per_shadow: int = 64
    """New early calls one shadow run may launch (a runaway loop in a half-written block)."""
    max_arg_bytes_per_launch: int = 4_000_000
    """Size of one early call's arguments (`plain_size`); a larger call is not launched early:
    it runs when its statement executes."""
    max_arg_bytes_per_run: int = 64_000_000
    """Total size of the arguments of all the early calls one run launches; past it, calls run
    when their statements execute."""


def argument_bytes(args: tuple, kwargs: dict) -> int | None:
    """The size of a call's arguments as `plain_size` counts it (None: past `MAX_ARG_BYTES` or
    `MAX_ARG_DEPTH`, which the sandbox and the REPL refuse before a launch gets here)."""
    try:
        return plain_size((args, kwargs), limit=MAX_ARG_BYTES + 24, max_depth=MAX_ARG_DEPTH + 1)
    except PlainDataTooLarge:
        return None


@dataclass(frozen=True)
class Origin:
    """Where an early call was launched from."""

    turn: int
    block: int
    line: int | None
    """Line within the block (None: unknown)."""
    epoch: int
    """Effectful calls the authoritative run had made when the shadow's code began."""
    in_tail: bool
    """Launched from the open tail (the statement still streaming)."""
    shadow: int
    """Which shadow run launched it (numbered from 1 in each run)."""

    @property
    def site(self) -> tuple[int, int, int | None]:
        """The call site: (turn, block, line)."""
        return self.turn, self.block, self.line


@dataclass
class EarlyCall:
    """One speculative invocation of a tool."""

    id: int
    tool: str
    key: str
    args: tuple
    kwargs: dict
    arg_bytes: int
    origin: Origin
    state: str = "queued"
    """queued -> running -> done; or cancelled at any point."""
    launched_s: float = 0.0
    started_s: float | None = None
    finished_s: float | None = None
    claimed_s: float | None = None
    retired: bool = False
    """Its block executed (or its turn ended) without a claim on it: cancelled, and counted
    once (`Ledger.retire`)."""
    result: Any = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    released: bool = False
    """Its payloads (arguments, result, error) were dropped: it serves nothing any more."""
    taken: bool = False
    """A claim took its outcome."""
    _scope: anyio.CancelScope | None = None

    @property
    def claimed(self) -> bool:
        return self.claimed_s is not None

    @property
    def live(self) -> bool:
        """Not cancelled: it may still serve a claim."""
        return self.state != "cancelled"

    def outcome(self) -> Any:
        """The call's result (a private copy; strings and bytes, immutable, are shared), or
        raise its exception."""
        if self.released:
            raise RuntimeError(f"early call #{self.id} of {self.tool!r} was released")
        self.taken = True
        if self.error is not None:
            raise self.error
        return copy.deepcopy(self.result)

    def release(self) -> None:
        """Drop the payloads: the arguments, the result and the error."""
        self.released = True
        self.args, self.kwargs, self.result, self.error = (), {}, None, None


Invoker = Callable[[EarlyCall], Awaitable[Any]]


class Ledger:
    """Early calls of one run. Use as ``async with Ledger(invoke, budget, clock) as ledger``:
    ``invoke(call)`` runs a call's tool, in a task group of the ledger's."""

    def __init__(self, invoke: Invoker, budget: SpeculationBudget, clock: Callable[[], float]):
        self._invoke = invoke
        self.budget = budget
        self._clock = clock
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._calls: list[EarlyCall] = []
        self._queue: list[EarlyCall] = []
        self._running = 0
        self._running_bytes = 0
        self._launched = 0
        self.run_arg_bytes = 0
        """Size of the arguments of every early call launched so far in the run."""
        self._launched_this_turn = 0
        self._launched_by_shadow: Counter[int] = Counter()

    async def __aenter__(self) -> Ledger:
        async with contextlib.AsyncExitStack() as stack:
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._tg is not None and self._stack is not None
        self.cancel_unclaimed()
        self._tg.cancel_scope.cancel()  # claimed calls still running: the run is over
        try:
            await self._stack.aclose()
        finally:
            self.release()
        return None  # an exception from the body propagates as it is

    def release(self) -> None:
        """Drop every call and its payloads (the run is over)."""
        for call in self._calls:
            call.release()
        self._calls, self._queue = [], []

    # -- launching -----------------------------------------------------------------------

    def new_turn(self) -> None:
        """Reset the per-turn and per-shadow budgets."""
        self._launched_this_turn = 0
        self._launched_by_shadow.clear()

    def arguments_refused(self, arg_bytes: int | None) -> str | None:
        """Why a new early call with arguments of ``arg_bytes`` may not launch: ``"launch"``
        (past ``max_arg_bytes_per_launch``), ``"run"`` (the run's total would pass
        ``max_arg_bytes_per_run``), or None."""
        if arg_bytes is None or arg_bytes > self.budget.max_arg_bytes_per_launch:
            return "launch"
        if self.run_arg_bytes + arg_bytes > self.budget.max_arg_bytes_per_run:
            return "run"
        return None

    def launch(self, tool: str, key: str, args: tuple, kwargs: dict, origin: Origin,
               arg_bytes: int | None = None) -> EarlyCall | None:
        """Start (or queue, past the in-flight budgets) an early call; ``None`` when the turn's
        or the shadow's budget is spent, or its arguments (``arg_bytes``, measured here when
        not given) are refused (`arguments_refused`)."""
        if self._launched_this_turn >= self.budget.max_per_turn \
                or self._launched_by_shadow[origin.shadow] >= self.budget.max_per_shadow:
            return None
        if arg_bytes is None:
            arg_bytes = argument_bytes(args, kwargs)
        if self.arguments_refused(arg_bytes) is not None:
            return None
        assert arg_bytes is not None
        self._launched_this_turn += 1
        self._launched_by_shadow[origin.shadow] += 1
        self._launched += 1
        self.run_arg_bytes += arg_bytes
        call = EarlyCall(
            id=self._launched, tool=tool, key=key, args=args, kwargs=kwargs,
            arg_bytes=arg_bytes, origin=origin, launched_s=self._clock(),
        )
        self._calls.append(call)
        self._queue.append(call)
        self._pump()
        return call

    def adoptable(self, key: str, *, turn: int, from_block: int) -> list[EarlyCall]:
        """The live calls with ``key`` launched in ``turn`` from block ``from_block`` on,
        oldest first: what a new shadow of that code may adopt."""
        return [call for call in self._calls
                if call.key == key and call.live and call.origin.turn == turn
                and call.origin.block >= from_block]

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

    def _start_now(self, call: EarlyCall) -> None:
        """Take a queued call out of the queue and run it (budgets are the caller's concern)."""
        assert self._tg is not None
        self._queue.remove(call)
        call.state = "running"
        self._running += 1
        self._running_bytes += call.arg_bytes
        self._tg.start_soon(self._run, call)

    async def _run(self, call: EarlyCall) -> None:
        if call.live:  # not cancelled before this task started
            call.started_s = self._clock()
            with anyio.CancelScope() as scope:
                call._scope = scope
                try:
                    call.result = await self._invoke(call)
                except Exception as exc:  # the tool's own failure: kept for the claimer
                    call.error = exc
        call.args, call.kwargs = (), {}  # the tool has run: its arguments are not needed
        self._running -= 1
        self._running_bytes -= call.arg_bytes
        if call.state == "running":
            call.state = "done"
            call.finished_s = self._clock()
        call.done.set()
        self._pump()

    # -- claiming and ending -------------------------------------------------------------

    def claim(self, key: str, *, turn: int) -> EarlyCall | None:
        """The oldest live, unclaimed early call with ``key`` launched in ``turn``, now
        claimed (started at once if it was queued); ``None`` on a miss."""
        for call in self._calls:
            if call.key == key and not call.claimed and call.live \
                    and call.origin.turn == turn:
                call.claimed_s = self._clock()
                if call in self._queue:  # claimed before it could start: start it now
                    self._start_now(call)
                return call
        return None

    def cancel(self, call: EarlyCall) -> bool:
        """Cancel an unclaimed call (stop it if it runs); returns whether it was live."""
        if call.claimed or not call.live:
            return False
        if call in self._queue:
            self._queue.remove(call)
            call.args, call.kwargs = (), {}  # it never runs
        elif call.state == "running" and call._scope is not None:
            call._scope.cancel()
        if call.state != "done":
            call.finished_s = self._clock()
        call.state = "cancelled"
        call.done.set()
        return True

    def cancel_unclaimed(self, *, turn: int | None = None, from_block: int = 0,
                         keep: Collection[EarlyCall] = (),
                         tools: Collection[str] | None = None) -> int:
        """Cancel every live unclaimed call (of ``turn``, from block ``from_block`` on, if
        ``turn`` is given; of ``tools``, if given) except those in ``keep``; returns how
        many."""
        kept = {id(call) for call in keep}
        return sum(self.cancel(call) for call in list(self._calls)
                   if (turn is None or call.origin.turn == turn
                       and call.origin.block >= from_block) and id(call) not in kept
                   and (tools is None or call.tool in tools))

    def retire(self, *, turn: int | None = None, block: int | None = None) -> list[EarlyCall]:
        """Cancel and return, once each, the unclaimed calls (of ``turn`` and ``block`` when
        given) that have not been retired yet: what the authoritative run did not use.

        Their block has executed (or their turn ended), so no shadow adopts them any more: they
        and the claimed calls whose outcome was taken are released and dropped."""
        retired, kept = [], []
        for call in self._calls:
            if turn is not None and call.origin.turn != turn \
                    or block is not None and call.origin.block != block:
                kept.append(call)
                continue
            if not call.claimed and not call.retired:
                self.cancel(call)
                call.retired = True
                retired.append(call)
            if call.retired or call.taken:
                call.release()
            else:
                kept.append(call)  # claimed, its claim still waiting: dropped with the run
        self._calls = kept
        return retired
