"""Tool speculation: drive shadow runs while code streams, serve the authoritative run's claims.

`Speculator` is the one owner of speculation's rules: it launches early calls, adopts them across
shadow runs, serves claims, retracts and keeps the counters (``launched == hits + wasted +
retracted``); the `Ledger` holds the early calls, answers its questions about them and applies
the budgets. `NoSpeculation` stands in for it in a sequential run (every claim misses). Here
*speculation* always means tool calls; the engine *drafts* tokens.

While a response streams it keeps one *shadow* process running the code the model has written so
far and not yet executed for real: the closed blocks of this turn whose authoritative execution
has not committed, plus the open block's closed statements and its open tail repaired to its
longest runnable prefix (``repair_tail``). Each time that code grows by a line the shadow is
replaced by a fresh fork of the namespace holder that runs the new code from the top (the
fork is made ahead, while the code streams: a *spare*, valid while no block executes and no
effect runs, so that a new line reaches its shadow without waiting for a fork). Shadows
launch speculatable calls; the ledger keys them by (tool, canonical arguments) and a later shadow
that makes the same call (the n-th occurrence of a key in a shadow maps to the n-th launch of
that key) *adopts* the call already in flight instead of starting another. When a shadow has run
all its code and a call it covers was not adopted, that call is cancelled.

Rules that keep the promise "same answers and effects, sooner":

* **No early effects.** A shadow fork may not make real tool calls (the REPL refuses and
  counts them); the shadow routes every tool object it reaches through its launch logic, and a
  tool that is not speculatable is never run there.
* **Effect barrier.** Tools declare effect scopes (`agentrt.tools.scopes`): a speculatable
  tool reads scopes (every one unless declared; none if pure), an effectful tool writes scopes
  (every one unless declared). A shadow never runs an effectful call; after one, it launches no
  call that reads a scope the effect writes. Every shadow has an *epoch*: the number of
  effectful calls the authoritative run had made when its code began. When the authoritative
  run reaches an effectful call, the epoch advances and every unclaimed early call that reads a
  scope it writes is cancelled; a shadow of an older epoch may no longer launch such calls. A
  read never overtakes a write to a scope it reads; pure calls and reads of other scopes cross.
* **Ghost bound.** In the open tail (the statement still streaming) a call site inside a
  ``while`` that repeats a key within one shadow run stops the tail's launches (an unfinished
  ``while`` makes no progress; a ``for`` loop advances by itself, so identical calls there go
  out). Launches whose loop exit may depend on results that has not streamed yet go out
  in a window (``window``, default `LAUNCH_WINDOW`) per call site beyond the first call the
  loop may still wait on: launches that waited for an earlier result of their own site count
  every unclaimed call of the site (the window slides as the authoritative run claims them);
  launches whose result the code so far never reads (``d = fetch(i)`` before its ``if``
  arrives) count the unclaimed calls still running (it slides as results arrive). Maps and
  reductions are not throttled. A closed statement is followed exactly: its control flow waits
  for the results it tests, so it launches nothing beyond the first unresolved one.

The authoritative run (the REPL executing the complete block) claims calls by key: a hit waits
for the early call's result, a miss calls the tool itself. Counting is decided once the block
has executed (or the turn ended), from what the program did, not from which event came first: an
early call never claimed is **wasted** if the authoritative run called that key in that block
(a duplicate, or one cancelled by an effect), and **retracted** if it never did (a call the
finished code does not make). Trace events: ``spec_peek`` [turn, lines, spare: whether the
shadow was the spare fork], ``spec_launch``
[early_id, tool, turn, block, lineno, deps, code_s: when the code that made the call was
complete, posted_s: when its shadow got that code], ``spec_claim`` [seq, tool, early_id or None],
``spec_cancel`` [early_id, reason: wasted | retracted], ``spec_effect`` [turn, epoch],
``spec_refused`` [tool], ``spec_too_large`` [tool, turn, block, lineno, arg_bytes, limit, cap:
launch | run] (a launch whose arguments pass the budget's ``max_arg_bytes_per_launch``, or would
take the run's total past ``max_arg_bytes_per_run``: that call runs when its statement executes;
once per call site and cap), ``spec_shadow_error`` [error] (a shadow message that could not be
handled, or too many of them: that shadow is killed), and ``tool_started`` / ``tool_finished``
with ``mode="early"``.

Memory: keys of calls with long arguments are kept as digests, a call's arguments are dropped
once its tool has run, its result once its block has executed, and everything speculation held
when the run ends (the trace keeps ids, names and sizes, never arguments or results).

Shadow messages arrive typed and checked by the REPL (``agentrt.interpreter.frames``); a shadow
is still untrusted, so nothing it says can end the run.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from agentrt.interpreter.frames import (
    EarlyFailed,
    EarlyPoisoned,
    EarlyResult,
    HostFrame,
    Launch,
    RefusedCall,
    Shadow,
    ShadowDone,
    ShadowMessage,
)
from agentrt.interpreter.repair import TailRepair
from agentrt.interpreter.repl import Repl, ReplError, ReplMessages, ReplSession
from agentrt.interpreter.unread_results import unread_result_lines, while_loop_lines
from agentrt.tools import Tool, ToolRegistry
from agentrt.tools.scopes import ALL_SCOPES, overlaps

from .ledger import EarlyCall, Ledger, Origin, SpeculationBudget, argument_bytes
from .results import RunStats
from .tool_calls import traced_call
from .trace import Trace

SHADOW_CPU_S = 2
"""CPU seconds one shadow may burn (a runaway ``while`` is stopped there)."""
LAUNCH_WINDOW = 4
"""Default of ``Agent(speculation_window=...)``: early calls one call site of the open tail may
launch beyond the first call its loop may still wait on (see the module docstring)."""
SPARE_DELAY_S = 0.05
"""How long the spare fork waits for the running shadow to finish its code before it is made
(it would otherwise compete with that shadow for the CPU)."""
MAX_SHADOW_MESSAGES = 1024
"""Messages one shadow may send; past it, it is killed (its speculation is best effort)."""
MAX_KEY_CHARS = 256
"""Call keys longer than this (large arguments) are kept as a digest (`compact_key`)."""


def compact_key(key: str) -> str:
    """``key`` when it is short, else ``"sha256:"`` and its digest: a call with large arguments
    does not keep a copy of them in its key."""
    if len(key) <= MAX_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

logger = logging.getLogger(__name__)


@dataclass
class _BlockCode:
    """One block of the turn as the segmenter reported it."""

    statements: list[tuple[int, int, str]] = field(default_factory=list)
    """(first line, last line, source) of each closed top-level statement."""
    closed: bool = False
    broken: bool = False
    """Closed with code the segmenter could not split (the real cell is a syntax error)."""
    lines: int = 0


@dataclass
class _Shadow:
    """One shadow process and what it has launched or adopted."""

    handle: ReplSession
    number: int
    """Which shadow run of the run this is (from 1)."""
    turn: int
    epoch: int
    layout: list[tuple[int, int]]
    """(block index, first line) of each block in the shadow's code, in order."""
    tail_line: int | None
    """First line of the repaired open tail in the shadow's code (None: no tail)."""
    code_s: float = 0.0
    """When the code it runs was complete (the delta or block that completed it), run time."""
    posted_s: float = 0.0
    """When it was forked and sent its code."""
    local: dict[Any, EarlyCall] = field(default_factory=dict)
    occurrences: Counter = field(default_factory=Counter)
    block_occurrences: Counter = field(default_factory=Counter)
    tail_keys: set = field(default_factory=set)
    tail_stalled: bool = False
    while_lines: frozenset[int] | None = frozenset()
    """Lines of the open tail inside a ``while`` (None: all of them): there, a repeated key
    means the loop made no progress."""
    unread_lines: frozenset[int] = frozenset()
    """Lines of the open tail whose call results the code so far never reads (`unread_results`):
    a loop's exit may still come; their launches are windowed."""
    messages: int = 0

    @property
    def first_block(self) -> int:
        return self.layout[0][0]

    def block_of(self, lineno: int | None) -> tuple[int, int | None]:
        """Map a line of the shadow's code to (block, line within the block)."""
        if lineno is None:
            return self.layout[-1][0], None
        block, first = self.layout[0]
        for b, start in self.layout:
            if lineno >= start:
                block, first = b, start
        return block, lineno - first + 1

    def in_tail(self, lineno: int | None) -> bool:
        return self.tail_line is not None and lineno is not None and lineno >= self.tail_line


@dataclass
class _Spare:
    """A shadow fork made ahead, for the state it was forked in."""

    handle: ReplSession
    state: tuple[int, int, int]
    """(turn, blocks executed, effects) when it was forked."""


class NoSpeculation:
    """The sequential run's speculator: it ignores what the agent loop reports and every claim
    misses, so the loop reports the same way with speculation on or off."""

    async def __aenter__(self) -> NoSpeculation:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def start_turn(self, turn: int) -> None:
        """A turn starts (turns are numbered from 0)."""

    def statement_closed(self, block: int, lineno: int, end_lineno: int, source: str) -> None:
        """The segmenter closed a top-level statement (lines ``lineno..end_lineno`` of ``block``)."""

    def block_closed(self, block: int, code: str, broken: bool = False) -> None:
        """Block ``block`` (numbered from 0 in each turn) closed with ``code`` (``broken``: the
        segmenter could not split all of it into statements)."""

    def open_block_grew(self, tail: str) -> None:
        """The open block's text after its last closed statement is now ``tail``."""

    def block_started(self, block: int) -> None:
        """The authoritative run starts executing block ``block``."""

    def block_executed(self, block: int) -> None:
        """The authoritative run finished block ``block``."""

    async def end_turn(self) -> None:
        """The turn is over (its blocks executed, or the stream died)."""

    async def claim(self, name: str, args: tuple, kwargs: dict,
                    block: int | None = None) -> tuple[bool, Any]:
        """``(True, result)`` when an early call serves this call; here always a miss."""
        return False, None


class Speculator(NoSpeculation):
    """Shadow runs and early calls for one agent run; use as an async context manager. The
    agent loop reports to it as to `NoSpeculation`."""

    def __init__(self, repl: Repl, registry: ToolRegistry, budget: SpeculationBudget,
                 trace: Trace, stats: RunStats, ready: anyio.Event | None = None,
                 window: int = LAUNCH_WINDOW) -> None:
        self.repl = repl
        self._repl_ready = ready
        """Set once the REPL has started (shadows wait for it); None: started already."""
        self.registry = registry
        self.trace = trace
        self.stats = stats
        self.ledger = Ledger(self._invoke_early, budget, trace.now)
        self.speculatable = frozenset(t.name for t in registry if t.speculate)
        self.window = window
        self._reads = {t.name: t.reads for t in registry if t.speculate}
        self._effect_writes: list[frozenset[str]] = []
        """What the authoritative run's effectful calls wrote, in order (epoch n follows n)."""
        self._scopes = (
            tuple((t.name, tuple(sorted(t.reads))) for t in registry
                  if t.speculate and t.reads != ALL_SCOPES),
            tuple((t.name, tuple(sorted(t.writes))) for t in registry
                  if not t.speculate and t.writes != ALL_SCOPES))
        """The declared scopes, as the `Shadow` frame carries them: (reads, writes)."""
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._messages: ReplMessages | None = None
        """The REPL's stream of shadow messages, followed by a task of ``_tg``."""
        self._shadow: _Shadow | None = None
        self._dirty = anyio.Event()
        self._turn = -1
        self._blocks: list[_BlockCode] = []
        """This turn's blocks (the last one may still be open), as the segmenter closed them."""
        self._executed = 0
        self._tail = ""
        self._repair = TailRepair()
        self._shadowed_code = ""
        self._shadows = 0
        self._claims = 0
        self._effects = 0
        self._running_block_epoch: int | None = None
        self._asked: dict[tuple[int, int], Counter] = {}
        self._code_s = 0.0
        """When the code to shadow last changed (run time)."""
        self._spare: _Spare | None = None
        """A fork for the next shadow, made while the code streams (it starts without one)."""
        self._spare_wanted = anyio.Event()
        self._shadow_ran = anyio.Event()
        """The current shadow has run all its code (or there is none)."""
        self._shadow_ran.set()
        self._too_large_noted: set[tuple[int, int, int | None, str]] = set()
        """(turn, block, line, cap) of the launches refused for their argument size, traced."""

    async def __aenter__(self) -> Speculator:
        async with contextlib.AsyncExitStack() as stack:
            self._messages = self.repl.messages()
            stack.callback(self._messages.close)
            await stack.enter_async_context(self.ledger)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._drive)
            self._tg.start_soon(self._keep_spare)
            self._tg.start_soon(self._follow_messages, self._messages)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._tg is not None and self._stack is not None
        assert self._messages is not None
        try:
            self._messages.close()
            self._settle()
            await self._kill_shadow()
            await self._kill_spare()
            self._tg.cancel_scope.cancel()
            await self._stack.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        """The run is over: drop everything speculation held (calls, their payloads, keys)."""
        self.ledger.release()
        self._shadow = self._spare = None
        self._blocks, self._asked, self._tail, self._shadowed_code = [], {}, "", ""
        self._too_large_noted.clear()

    # -- what the agent loop reports -------------------------------------------------------------

    def start_turn(self, turn: int) -> None:
        self._turn = turn
        self._blocks, self._executed, self._tail = [], 0, ""
        self.ledger.new_turn()
        self._spare_wanted.set()

    def statement_closed(self, block: int, lineno: int, end_lineno: int, source: str) -> None:
        """The segmenter closed a top-level statement (lines ``lineno..end_lineno`` of ``block``)."""
        while len(self._blocks) <= block:
            self._blocks.append(_BlockCode())
        self._blocks[block].statements.append((lineno, end_lineno, source))
        self._tail = ""
        self._changed()

    def block_closed(self, block: int, code: str, broken: bool = False) -> None:
        """Block ``block`` (numbered from 0 in each turn) closed with ``code`` (``broken``: the
        segmenter could not split all of it into statements)."""
        while len(self._blocks) <= block:
            self._blocks.append(_BlockCode())
        closed = self._blocks[block]
        closed.closed, closed.broken = True, broken
        closed.lines = code.count("\n") + (0 if code.endswith("\n") or not code else 1)
        self._tail = ""
        self._changed()

    def open_block_grew(self, tail: str) -> None:
        """The open block's text after its last closed statement is now ``tail``."""
        self._tail = tail
        self._changed()

    def _changed(self) -> None:
        self._code_s = self.trace.now()
        self._dirty.set()

    def block_started(self, block: int) -> None:
        """The authoritative run starts executing block ``block``."""
        self._running_block_epoch = self._effects
        self._asked.setdefault((self._turn, block), Counter())

    def block_executed(self, block: int) -> None:
        """The authoritative run finished block ``block``: its unclaimed calls are settled."""
        self._executed = block + 1
        self._running_block_epoch = None
        self._settle(turn=self._turn, block=block)
        self._spare_wanted.set()
        self._changed()

    async def end_turn(self) -> None:
        """The turn is over: its unclaimed calls are settled and its shadow killed."""
        self._settle()
        await self._kill_shadow()
        await self._kill_spare()
        self._shadowed_code = ""

    # -- claims from the authoritative run ------------------------------------------------------

    async def claim(self, name: str, args: tuple, kwargs: dict,
                    block: int | None = None) -> tuple[bool, Any]:
        """``(True, result)`` when an early call serves this call; ``(False, None)`` on a miss.

        The early call's exception, if it raised, is raised here, exactly where a sequential
        run would have raised it. A call of a tool that is not speculatable advances the epoch
        (see the module docstring) before it runs.
        """
        tool = self.registry.get(name)
        seq = self._claims
        self._claims += 1
        if not tool.speculate:
            self._effect(tool)
            return False, None
        if self.ledger.arguments_refused(argument_bytes(args, kwargs)) == "launch":
            self.trace.emit("spec_claim", seq=seq, tool=name, early_id=None)
            self.stats.misses += 1  # no early call has arguments this large
            return False, None
        try:
            key = compact_key(tool.call_key(args, kwargs))
        except Exception:
            return False, None  # let the plain call raise the same validation error
        if block is not None:
            self._asked.setdefault((self._turn, block), Counter())[key] += 1
        call = self.ledger.claim(key, turn=self._turn)
        self.trace.emit("spec_claim", seq=seq, tool=name,
                        early_id=call.id if call is not None else None)
        if call is None:
            self.stats.misses += 1
            return False, None
        self.stats.hits += 1
        await call.done.wait()
        if call.started_s is not None:
            end = call.finished_s if call.finished_s is not None else call.claimed_s
            self.stats.hidden_s += max(0.0, min(end, call.claimed_s) - call.started_s)
        return True, call.outcome()

    def _effect(self, tool: Tool) -> None:
        """An effectful call is about to run: no call launched before it that reads a scope it
        writes may serve after it."""
        self._effects += 1
        self._spare_wanted.set()
        self._effect_writes.append(tool.writes)
        self.trace.emit("spec_effect", turn=self._turn, epoch=self._effects)
        self.ledger.cancel_unclaimed(tools=[name for name, reads in self._reads.items()
                                            if overlaps(reads, tool.writes)])

    def _overtakes_effect(self, name: str, epoch: int) -> bool:
        """Whether tool ``name`` reads a scope written by an effectful call the authoritative
        run made since ``epoch``."""
        reads = self._reads[name]
        return any(overlaps(reads, writes) for writes in self._effect_writes[epoch:])

    # -- early calls ----------------------------------------------------------------------------

    async def _invoke_early(self, call: EarlyCall) -> Any:
        return await traced_call(self.registry, self.trace, self.stats, call.tool, call.args,
                                 call.kwargs, call_id=call.id, mode="early")

    def _settle(self, *, turn: int | None = None, block: int | None = None) -> None:
        """Count the unclaimed early calls (of ``turn`` and ``block``, if given) once each:
        wasted if the authoritative run made that call in their block, else retracted."""
        for call in self.ledger.settle(turn=turn, block=block):
            asked = self._asked.get((call.origin.turn, call.origin.block), Counter())
            reason = "wasted" if asked[call.key] else "retracted"
            if reason == "wasted":
                self.stats.wasted += 1
            else:
                self.stats.retracted += 1
            self.trace.emit("spec_cancel", early_id=call.id, reason=reason)

    # -- shadows ----------------------------------------------------------------------------------

    def _shadow_code(self) -> tuple[list[tuple[int, int, str]], list[tuple[int, int]],
                                    int | None]:
        """(statements as (block, first line, source), layout, first line of the open tail).

        Lines are numbered through all the blocks the shadow runs; a closed block whose code
        the segmenter could not split into statements (a syntax error) is left out, as the
        real run executes none of it.
        """
        statements: list[tuple[int, int, str]] = []
        layout: list[tuple[int, int]] = []
        tail_line: int | None = None
        first = 1
        for index in range(self._executed, len(self._blocks)):
            block = self._blocks[index]
            if block.closed and block.broken:
                first += block.lines
                continue
            layout.append((index, first))
            statements += [(index, first + lineno - 1, source)
                           for lineno, _, source in block.statements]
            if not block.closed:
                end = block.statements[-1][1] if block.statements else 0
                repaired = self._repair(self._tail) if self._tail.strip() else None
                if repaired:
                    tail_line = first + end
                    statements.append((index, tail_line, repaired))
            first += block.lines
        return statements, layout, tail_line

    def _shadow_epoch(self) -> int | None:
        """The epoch a shadow started now would run in; None if it could launch nothing."""
        if self._running_block_epoch is None:
            return self._effects
        if self._running_block_epoch != self._effects:
            return None  # the running block passed an effect: wait until it has executed
        return self._effects

    async def _drive(self) -> None:
        """Keep the shadow in step with the code: replace it whenever the code changes."""
        if self._repl_ready is not None:
            await self._repl_ready.wait()
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            epoch = self._shadow_epoch()
            if epoch is None:
                continue  # the running shadow goes on; the next starts once the block executed
            code_s = self._code_s
            statements, layout, tail_line = self._shadow_code()
            code = repr(statements) if statements else ""
            if code == self._shadowed_code:
                continue
            await self._kill_shadow()
            self._shadowed_code = code
            if not code:
                continue
            try:
                await self._start_shadow(statements, layout, tail_line, epoch, code_s)
            except (ReplError, OSError):
                self._shadowed_code = ""  # the holder changed under us: try again
                self._dirty.set()
                await anyio.sleep(0.01)

    async def _start_shadow(self, statements: list[tuple[int, int, str]],
                            layout: list[tuple[int, int]], tail_line: int | None,
                            epoch: int, code_s: float) -> None:
        executed_before = self._executed
        spare = self._take_spare()
        handle = spare or await self.repl.fork_shadow()
        if self._executed != executed_before or self._effects != epoch:
            await handle.kill(wait=False)  # a block committed or an effect ran while we forked
            self._shadowed_code = ""
            self._dirty.set()
            return
        self._shadows += 1
        self._shadow_ran = anyio.Event()
        shadow = _Shadow(handle, self._shadows, self._turn, epoch, layout, tail_line, code_s)
        if tail_line is not None:
            tail = statements[-1][2]
            shadow.unread_lines = frozenset(tail_line - 1 + n for n in unread_result_lines(tail))
            in_while = while_loop_lines(tail)
            shadow.while_lines = None if in_while is None \
                else frozenset(tail_line - 1 + n for n in in_while)
        self._shadow = shadow
        lines = sum(source.count("\n") for _, _, source in statements)
        self.trace.emit("spec_peek", turn=self._turn, lines=lines, spare=spare is not None)
        shadow.posted_s = self.trace.now()
        await handle.post(Shadow(tuple(statements), tuple(sorted(self.speculatable)),
                                 SHADOW_CPU_S, *self._scopes))

    def _fork_state(self) -> tuple[int, int, int]:
        return self._turn, self._executed, self._effects

    async def _keep_spare(self) -> None:
        """Keep a shadow fork ready for the current state (turn, blocks executed, effects), so
        that a new shadow does not wait for its fork: one round trip off each launch's path."""
        if self._repl_ready is not None:
            await self._repl_ready.wait()
        while True:
            await self._spare_wanted.wait()
            self._spare_wanted = anyio.Event()
            if self._spare is not None and self._spare.state == self._fork_state():
                continue
            await self._kill_spare()
            with anyio.move_on_after(SPARE_DELAY_S):
                await self._shadow_ran.wait()
            state = self._fork_state()
            try:
                handle = await self.repl.fork_shadow()
            except (ReplError, OSError):  # the holder is being replaced: try again
                await anyio.sleep(0.01)
                self._spare_wanted.set()
                continue
            if state != self._fork_state():
                await handle.kill(wait=False)
                self._spare_wanted.set()
                continue
            self._spare = _Spare(handle, state)

    def _take_spare(self) -> ReplSession | None:
        """The spare fork, if it is still alive and of the current state; another is made."""
        spare, self._spare = self._spare, None
        self._spare_wanted.set()
        if spare is None:
            return None
        if spare.state == self._fork_state() and spare.handle.alive:
            return spare.handle
        assert self._tg is not None
        self._tg.start_soon(functools.partial(spare.handle.kill, wait=False))
        return None

    async def _kill_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(Exception):
                await spare.handle.kill(wait=False)

    async def _kill_shadow(self) -> None:
        shadow, self._shadow = self._shadow, None
        if shadow is not None:
            with contextlib.suppress(Exception):
                await shadow.handle.kill(wait=False)

    async def _follow_messages(self, messages: ReplMessages) -> None:
        """Handle the shadows' messages in arrival order, each before the next is received.

        A message this code cannot handle ends that shadow, never the run."""
        with contextlib.suppress(anyio.ClosedResourceError):
            async for token, message in messages:
                try:
                    self._on_message(token, message)
                except Exception as exc:
                    logger.warning("shadow message %r failed (%s: %s): the shadow is killed",
                                   message.op, type(exc).__name__, exc)
                    self.trace.emit("spec_shadow_error", error=f"{type(exc).__name__}: {exc}")
                    if self._shadow is not None and self._shadow.handle.token == token:
                        self._tg.start_soon(self._kill_shadow)

    def _on_message(self, token: str, message: ShadowMessage) -> None:
        if isinstance(message, RefusedCall):
            self.stats.shadow_tool_calls_refused += 1
            self.trace.emit("spec_refused", tool=message.name)
            return
        shadow = self._shadow
        if shadow is None or shadow.handle.token != token:
            return  # a superseded shadow: ignore what it still says
        shadow.messages += 1
        if shadow.messages > MAX_SHADOW_MESSAGES:
            raise RuntimeError(f"the shadow sent over {MAX_SHADOW_MESSAGES} messages")
        if isinstance(message, Launch):
            self._on_launch(shadow, message)
        elif isinstance(message, ShadowDone):
            self._shadow_ran.set()
            if not message.pending:
                self._retract_unadopted(shadow)

    def _on_launch(self, shadow: _Shadow, launch: Launch) -> None:
        local_id = launch.call
        deps = [shadow.local[d] for d in launch.deps if d in shadow.local]
        call = self._early_call(shadow, launch.name, launch.args, dict(launch.kwargs),
                                launch.lineno, deps)
        if call is None:
            self._post(shadow, EarlyPoisoned(local_id, "not launched"))
            return
        shadow.local[local_id] = call
        assert self._tg is not None
        self._tg.start_soon(self._deliver, shadow, local_id, call)

    def _early_call(self, shadow: _Shadow, name: Any, args: tuple, kwargs: dict,
                    lineno: int | None, deps: list[EarlyCall]) -> EarlyCall | None:
        """The early call serving this launch: adopted, newly started, or None (refused)."""
        if name not in self.speculatable or self._overtakes_effect(name, shadow.epoch):
            return None
        block, line = shadow.block_of(lineno)
        arg_bytes = argument_bytes(args, kwargs)
        if self.ledger.arguments_refused(arg_bytes) == "launch":
            self._note_too_large(name, block, line, arg_bytes, "launch")
            return None  # before its key: nothing this large was launched, or is kept
        try:
            key = compact_key(self.registry.get(name).call_key(args, kwargs))
        except Exception:
            return None
        origin = Origin(self._turn, block, line, shadow.epoch, shadow.in_tail(lineno),
                        shadow.number)
        if origin.in_tail and not self._window_allows(shadow, origin, lineno, key, deps):
            return None
        shadow.occurrences[key] += 1
        shadow.block_occurrences[block, key] += 1
        n = shadow.occurrences[key]
        same = self.ledger.adoptable(key, turn=self._turn, from_block=shadow.first_block)
        if n <= len(same):
            return same[n - 1]
        asked = self._asked.get((self._turn, block), Counter())[key]
        if asked >= shadow.block_occurrences[block, key]:
            return None  # the authoritative run has already made this call: too late
        if self.ledger.arguments_refused(arg_bytes) == "run":
            self._note_too_large(name, block, line, arg_bytes, "run")
            return None
        call = self.ledger.launch(name, key, args, kwargs, origin, arg_bytes)
        if call is None:
            return None  # a budget is spent
        self.stats.launched += 1
        self.trace.emit("spec_launch", early_id=call.id, tool=name, turn=self._turn, block=block,
                        lineno=line, deps=sorted({d.id for d in deps}), code_s=shadow.code_s,
                        posted_s=shadow.posted_s)
        return call

    def _note_too_large(self, name: str, block: int, line: int | None, arg_bytes: int | None,
                        cap: str) -> None:
        """Trace, once per call site and cap, a launch refused for the size of its arguments."""
        noted = (self._turn, block, line, cap)
        if noted in self._too_large_noted:
            return
        self._too_large_noted.add(noted)
        budget = self.ledger.budget
        limit = budget.max_arg_bytes_per_launch if cap == "launch" \
            else budget.max_arg_bytes_per_run
        self.trace.emit("spec_too_large", tool=name, turn=self._turn, block=block, lineno=line,
                        arg_bytes=arg_bytes, limit=limit, cap=cap)

    def _window_allows(self, shadow: _Shadow, origin: Origin, lineno: int | None, key: str,
                       deps: list[EarlyCall]) -> bool:
        """The ghost bound for launches from the open tail (see the module docstring)."""
        if shadow.tail_stalled:
            return False
        if (origin.site, key) in shadow.tail_keys and (
                shadow.while_lines is None or lineno in shadow.while_lines):
            shadow.tail_stalled = True  # the loop made no progress: stop launching from the tail
            return False
        shadow.tail_keys.add((origin.site, key))
        waited = any(d.origin.site == origin.site for d in deps)
        if not waited and lineno not in shadow.unread_lines:
            return True  # a map or a reduction: its results are used, not tested for an exit
        ahead = sum(1 for c in shadow.local.values()
                    if c.origin.site == origin.site and not c.claimed and c.live
                    and (waited or c.state != "done"))
        return ahead <= self.window

    async def _deliver(self, shadow: _Shadow, local_id: Any, call: EarlyCall) -> None:
        await call.done.wait()
        frame: HostFrame
        if call.state == "cancelled":
            frame = EarlyPoisoned(local_id, "cancelled")
        elif call.released:
            frame = EarlyPoisoned(local_id, "released")
        elif call.error is not None:
            frame = EarlyFailed(local_id, str(call.error))
        else:
            frame = EarlyResult(local_id, call.result)
        await self._post_async(shadow, frame)

    def _post(self, shadow: _Shadow, frame: HostFrame) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._post_async, shadow, frame)

    async def _post_async(self, shadow: _Shadow, frame: HostFrame) -> None:
        if shadow is self._shadow:
            with contextlib.suppress(Exception):
                await shadow.handle.post(frame)

    def _retract_unadopted(self, shadow: _Shadow) -> None:
        """The shadow ran all its code: calls of its blocks it did not adopt are cancelled now
        (counted when their block has executed or the turn ends)."""
        self.ledger.cancel_unclaimed(turn=self._turn, from_block=shadow.first_block,
                                     keep=list(shadow.local.values()))


__all__ = ["NoSpeculation", "Origin", "Speculator", "SpeculationBudget", "SHADOW_CPU_S",
           "LAUNCH_WINDOW", "compact_key"]
