"""Tool speculation: drive shadow runs while code streams, serve the authoritative run's claims.

`Speculator` is the one owner of speculation's rules, the coordinator of parts with one job
each: `ShadowCode` (the code a shadow runs), `SpareFork` (a fork made ahead), `EffectEpochs`
(effects and the epochs they start), `LaunchGate` (which early call serves a launch: adoption,
caps, the ghost bound and the window), `Claims` (claims, and what unclaimed calls count as) and
the `Ledger` (the early calls and the budgets). `NoSpeculation` stands in for it in a sequential
run (every claim misses). Here *speculation* always means tool calls; the engine *drafts* tokens.

While a response streams the speculator keeps one *shadow* process running the code the model
has written so far and not yet executed for real. Each time that code grows by a line the shadow
is replaced by a fresh fork of the namespace holder that runs the new code from the top (the
spare fork when it is of the current state). Shadows launch speculatable calls; the gate keys
them by (tool, canonical arguments), and a later shadow that makes the same call *adopts* the
call already in flight instead of starting another. When a shadow has run all its code and a
call it covers was not adopted, that call is cancelled.

Rules that keep the promise "same answers and effects, sooner":

* **No early effects.** A shadow fork may not make real tool calls (the REPL refuses and
  counts them); the shadow routes every tool object it reaches through its launch logic, and a
  tool that is not speculatable is never run there.
* **Effect barrier** (`agentrt.effect_epochs`): a read never overtakes a write to a scope it
  reads; pure calls and reads of other scopes cross. When the authoritative run reaches an
  effectful call, the epoch advances and every unclaimed early call that reads a scope it
  writes is cancelled.
* **Ghost bound and window** (`agentrt.launch_gate`): launches from the open tail are bounded;
  a closed statement is followed exactly.

Counting (`agentrt.claims`) is decided once a block has executed (or the turn ended), from what
the program did. Speculation's trace events (``spec_*``, and ``tool_started`` / ``tool_finished``
with ``mode="early"``) are typed in `agentrt.events`.

Memory: keys of calls with long arguments are kept as digests, a call's arguments are dropped
once its tool has run, its result once its block has executed, and everything speculation held
when the run ends (the trace keeps ids, names and sizes, never arguments or results).

Shadow messages arrive typed and checked by the REPL (``agentrt.interpreter.frames``); a shadow
is still untrusted, so nothing it says can end the run.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
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
from agentrt.interpreter.repl import Repl, ReplError, ReplMessages, ReplSession
from agentrt.tools import Tool, ToolRegistry
from agentrt.tools.scopes import ALL_SCOPES

from .claims import Claims
from .effect_epochs import EffectEpochs
from .events import SpecEffect, SpecPeek, SpecRefused, SpecShadowError
from .launch_gate import LAUNCH_WINDOW, LaunchGate, ShadowLaunches
from .ledger import EarlyCall, Ledger, Origin, SpeculationBudget, compact_key
from .results import RunStats
from .shadow_code import ShadowCode, ShadowProgram
from .spare_fork import SpareFork
from .tool_calls import traced_call
from .trace import Trace

SHADOW_CPU_S = 2
"""CPU seconds one shadow may burn (a runaway ``while`` is stopped there)."""
MAX_SHADOW_MESSAGES = 1024
"""Messages one shadow may send; past it, it is killed (its speculation is best effort)."""

logger = logging.getLogger(__name__)


@dataclass
class _Shadow:
    """One shadow process and its run."""

    handle: ReplSession
    run: ShadowLaunches
    messages: int = 0


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
        self.code = ShadowCode()
        self.epochs = EffectEpochs(registry)
        self.claims = Claims(self.ledger, trace, stats)
        self.gate = LaunchGate(registry, self.ledger, self.epochs, self.claims, trace, stats,
                               window)
        self.spare = SpareFork(repl, self._fork_state, ready)
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
        self._shadowed: tuple | None = None
        """The statements the current shadow runs (None: none)."""
        self._shadows = 0
        self._code_s = 0.0
        """When the code to shadow last changed (run time)."""

    async def __aenter__(self) -> Speculator:
        async with contextlib.AsyncExitStack() as stack:
            self._messages = self.repl.messages()
            stack.callback(self._messages.close)
            await stack.enter_async_context(self.ledger)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._drive)
            self._tg.start_soon(self.spare.keep, self._tg)
            self._tg.start_soon(self._follow_messages, self._messages)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._tg is not None and self._stack is not None
        assert self._messages is not None
        try:
            self._messages.close()
            self.claims.settle()
            await self._kill_shadow()
            await self.spare.kill()
            self._tg.cancel_scope.cancel()
            await self._stack.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        """The run is over: drop everything speculation held (calls, their payloads, keys)."""
        self.ledger.release()
        self._shadow, self._shadowed = None, None
        self.spare.release()
        self.code.release()
        self.claims.release()
        self.gate.release()

    # -- what the agent loop reports -------------------------------------------------------------

    def start_turn(self, turn: int) -> None:
        self._turn = turn
        self.code.start_turn()
        self.ledger.new_turn()
        self.spare.want()

    def statement_closed(self, block: int, lineno: int, end_lineno: int, source: str) -> None:
        """The segmenter closed a top-level statement (lines ``lineno..end_lineno`` of ``block``)."""
        self.code.statement_closed(block, lineno, end_lineno, source)
        self._changed()

    def block_closed(self, block: int, code: str, broken: bool = False) -> None:
        """Block ``block`` (numbered from 0 in each turn) closed with ``code`` (``broken``: the
        segmenter could not split all of it into statements)."""
        self.code.block_closed(block, code, broken)
        self._changed()

    def open_block_grew(self, tail: str) -> None:
        """The open block's text after its last closed statement is now ``tail``."""
        self.code.open_block_grew(tail)
        self._changed()

    def _changed(self) -> None:
        self._code_s = self.trace.now()
        self._dirty.set()

    def block_started(self, block: int) -> None:
        """The authoritative run starts executing block ``block``."""
        self.epochs.block_started()
        self.claims.block_started(self._turn, block)

    def block_executed(self, block: int) -> None:
        """The authoritative run finished block ``block``: its unclaimed calls are settled."""
        self.code.block_executed(block)
        self.epochs.block_executed()
        self.claims.settle(turn=self._turn, block=block)
        self.spare.want()
        self._changed()

    async def end_turn(self) -> None:
        """The turn is over: its unclaimed calls are settled and its shadow killed."""
        self.claims.settle()
        await self._kill_shadow()
        await self.spare.kill()
        self._shadowed = None

    # -- claims from the authoritative run ------------------------------------------------------

    async def claim(self, name: str, args: tuple, kwargs: dict,
                    block: int | None = None) -> tuple[bool, Any]:
        """``(True, result)`` when an early call serves this call; ``(False, None)`` on a miss.

        The early call's exception, if it raised, is raised here, exactly where a sequential
        run would have raised it. A call of a tool that is not speculatable advances the epoch
        before it runs.
        """
        tool = self.registry.get(name)
        if not tool.speculate:
            self._effect(tool)
        return await self.claims.claim(tool, args, kwargs, turn=self._turn, block=block)

    def _effect(self, tool: Tool) -> None:
        """An effectful call is about to run: no call launched before it that reads a scope it
        writes may serve after it."""
        stale = self.epochs.advance(tool)
        self.spare.want()
        self.trace.emit(SpecEffect(self._turn, self.epochs.current))
        self.ledger.cancel_unclaimed(tools=stale)

    async def _invoke_early(self, call: EarlyCall) -> Any:
        return await traced_call(self.registry, self.trace, self.stats, call.tool, call.args,
                                 call.kwargs, call_id=call.id, mode="early")

    # -- shadows ----------------------------------------------------------------------------------

    def _fork_state(self) -> tuple[int, int, int]:
        """What a fork is valid for: (turn, blocks executed, effects)."""
        return self._turn, self.code.executed, self.epochs.current

    async def _drive(self) -> None:
        """Keep the shadow in step with the code: replace it whenever the code changes."""
        if self._repl_ready is not None:
            await self._repl_ready.wait()
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            epoch = self.epochs.shadow_epoch()
            if epoch is None:
                continue  # the running shadow goes on; the next starts once the block executed
            code_s = self._code_s
            program = self.code.program()
            statements = program.statements or None
            if statements == self._shadowed:
                continue
            await self._kill_shadow()
            self._shadowed = statements
            if statements is None:
                continue
            try:
                await self._start_shadow(program, epoch, code_s)
            except (ReplError, OSError):
                self._shadowed = None  # the holder changed under us: try again
                self._dirty.set()
                await anyio.sleep(0.01)

    async def _start_shadow(self, program: ShadowProgram, epoch: int, code_s: float) -> None:
        executed_before = self.code.executed
        spare = self.spare.take()
        handle = spare or await self.repl.fork_shadow()
        if self.code.executed != executed_before or self.epochs.current != epoch:
            await handle.kill(wait=False)  # a block committed or an effect ran while we forked
            self._shadowed = None
            self._dirty.set()
            return
        self._shadows += 1
        self.spare.shadow_started()
        run = ShadowLaunches.of(program, self._shadows, self._turn, epoch, code_s)
        self._shadow = _Shadow(handle, run)
        self.trace.emit(SpecPeek(self._turn, program.lines, spare is not None))
        run.posted_s = self.trace.now()
        await handle.post(Shadow(program.statements, tuple(sorted(self.gate.speculatable)),
                                 SHADOW_CPU_S, *self._scopes))

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
                    self.trace.emit(SpecShadowError(f"{type(exc).__name__}: {exc}"))
                    if self._shadow is not None and self._shadow.handle.token == token:
                        self._tg.start_soon(self._kill_shadow)

    def _on_message(self, token: str, message: ShadowMessage) -> None:
        if isinstance(message, RefusedCall):
            self.stats.shadow_tool_calls_refused += 1
            self.trace.emit(SpecRefused(message.name))
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
            self.spare.shadow_ran()
            if not message.pending:
                self.gate.retract_unadopted(shadow.run)

    def _on_launch(self, shadow: _Shadow, launch: Launch) -> None:
        call = self.gate.admit(shadow.run, launch)
        if call is None:
            self._post(shadow, EarlyPoisoned(launch.call, "not launched"))
            return
        assert self._tg is not None
        self._tg.start_soon(self._deliver, shadow, launch.call, call)

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


__all__ = ["NoSpeculation", "Origin", "Speculator", "SpeculationBudget", "SHADOW_CPU_S",
           "LAUNCH_WINDOW", "compact_key"]
