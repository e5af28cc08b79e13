"""Tool speculation: drive shadow runs while code streams, serve the authoritative run's claims.

While a response streams, `Speculator` keeps one *shadow* process running the code the model has
written so far and not yet executed for real: the closed blocks of this turn whose authoritative
execution has not committed, plus the open block's text repaired to its longest runnable prefix
(``repair_tail``). Each time that code grows by a line the shadow is replaced by a fresh fork of
the namespace holder that runs the new code from the top. Shadows launch speculatable calls;
the ledger keys them by (tool, canonical arguments) and a later shadow that makes the same call
(the n-th occurrence of a key in a shadow maps to the n-th launch of that key) *adopts* the call
already in flight instead of starting another. When a shadow has run all its code and a call
it covers was not adopted, that call is *retracted*.

The authoritative run (the kernel executing the complete block) claims calls by key: a hit waits
for the early call's result, a miss calls the tool itself. What is never claimed is cancelled
when its block has executed (``wasted``). Trace events: ``spec_peek`` [turn, lines],
``spec_launch`` [early_id, tool, turn, block, lineno, deps], ``spec_claim`` [seq, tool,
early_id or None], ``spec_cancel`` [early_id, reason: wasted | retracted], and ``tool_started`` /
``tool_finished`` with ``mode="early"``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from agentrt.interpreter.kernel import Kernel, KernelError, KernelProcess
from agentrt.interpreter.ledger import EarlyCall, Ledger, SpeculationBudget
from agentrt.interpreter.repair import repair_tail
from agentrt.tools import ToolRegistry

from .results import RunStats
from .trace import Trace

SHADOW_CPU_S = 2
"""CPU seconds one shadow may burn (a runaway ``while`` is stopped there)."""


@dataclass
class _Shadow:
    """One shadow process and what it has adopted."""

    handle: KernelProcess
    turn: int
    layout: list[tuple[int, int]]
    """(block index, first line) of each block in the shadow's code, in order."""
    local: dict[Any, EarlyCall] = field(default_factory=dict)
    occurrences: Counter = field(default_factory=Counter)
    launched: int = 0

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


class Speculator:
    """Shadow runs and early calls for one agent run; use as an async context manager."""

    def __init__(self, kernel: Kernel, registry: ToolRegistry, budget: SpeculationBudget,
                 trace: Trace, stats: RunStats) -> None:
        self.kernel = kernel
        self.registry = registry
        self.trace = trace
        self.stats = stats
        self.ledger = Ledger(self._invoke_early, budget, trace.now)
        self.speculatable = [t.name for t in registry if t.speculate]
        self._tg: anyio.abc.TaskGroup | None = None
        self._shadow: _Shadow | None = None
        self._dirty = anyio.Event()
        self._turn = -1
        self._closed_blocks: list[str] = []
        self._executed = 0
        self._open_code: str | None = None
        self._shadowed_code = ""
        self._claims = 0

    async def __aenter__(self) -> "Speculator":
        await self.ledger.__aenter__()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._drive)
        self.kernel.on_message = self._on_message
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._tg is not None
        self.kernel.on_message = None
        self._end_turn_calls()
        await self._kill_shadow()
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        return await self.ledger.__aexit__(None, None, None)

    # -- what the agent loop reports -------------------------------------------------------------

    def start_turn(self, turn: int) -> None:
        self._turn = turn
        self._closed_blocks, self._executed, self._open_code = [], 0, None
        self.ledger.new_turn()

    def code_changed(self, closed_blocks: list[str], open_code: str | None) -> None:
        """The response's code grew: the closed blocks so far and the open block's text."""
        self._closed_blocks = list(closed_blocks)
        self._open_code = open_code
        self._dirty.set()

    def block_executed(self, block: int) -> None:
        """The authoritative run finished block ``block``: its unclaimed calls are wasted."""
        self._executed = block + 1
        self._cancel(lambda c: c.tag == (self._turn, block), "wasted")
        self._dirty.set()

    async def end_turn(self) -> None:
        self._end_turn_calls()
        await self._kill_shadow()
        self._shadowed_code = ""

    def _end_turn_calls(self) -> None:
        self._cancel(lambda c: True, "wasted")

    # -- claims from the authoritative run ------------------------------------------------------

    async def claim(self, name: str, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """``(True, result)`` when an early call serves this call; ``(False, None)`` on a miss.

        The early call's exception, if it raised, is raised here, exactly where a sequential
        run would have raised it.
        """
        tool = self.registry.get(name)
        seq = self._claims
        self._claims += 1
        if not tool.speculate:
            return False, None
        try:
            key = tool.call_key(args, kwargs)
        except Exception:
            return False, None  # let the plain call raise the same validation error
        call = self.ledger.claim(key)
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

    # -- early calls ----------------------------------------------------------------------------

    async def _invoke_early(self, call: EarlyCall) -> Any:
        self.stats.tool_calls[call.tool] += 1
        self.trace.emit("tool_started", call_id=call.id, tool=call.tool, mode="early")
        try:
            result = await self.registry.call(call.tool, call.args, call.kwargs)
        except BaseException as exc:
            self.trace.emit("tool_finished", call_id=call.id, tool=call.tool, mode="early",
                            error=f"{type(exc).__name__}: {exc}")
            raise
        self.trace.emit("tool_finished", call_id=call.id, tool=call.tool, mode="early", error=None)
        return result

    def _cancel(self, predicate, reason: str) -> None:
        for call in list(self.ledger.calls):
            if predicate(call) and self.ledger.cancel(call, retract=reason == "retracted"):
                if reason == "retracted":
                    self.stats.retracted += 1
                else:
                    self.stats.wasted += 1
                self.trace.emit("spec_cancel", early_id=call.id, reason=reason)

    # -- shadows ----------------------------------------------------------------------------------

    def _shadow_code(self) -> tuple[str, list[tuple[int, int]]]:
        parts: list[str] = []
        layout: list[tuple[int, int]] = []
        line = 1
        blocks = list(enumerate(self._closed_blocks))[self._executed:]
        if self._open_code is not None:
            tail = repair_tail(self._open_code)
            if tail:
                blocks.append((len(self._closed_blocks), tail))
        for index, code in blocks:
            code = code if code.endswith("\n") else code + "\n"
            layout.append((index, line))
            parts.append(code)
            line += code.count("\n")
        return "".join(parts), layout

    async def _drive(self) -> None:
        """Keep the shadow in step with the code: replace it whenever the code changes."""
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            code, layout = self._shadow_code()
            if code == self._shadowed_code:
                continue
            await self._kill_shadow()
            self._shadowed_code = code
            if not code.strip():
                continue
            try:
                await self._start_shadow(code, layout)
            except (KernelError, OSError):
                self._shadowed_code = ""  # the holder changed under us: try again
                self._dirty.set()
                await anyio.sleep(0.01)

    async def _start_shadow(self, code: str, layout: list[tuple[int, int]]) -> None:
        executed_before = self._executed
        handle = await self.kernel.fork_holder()
        if self._executed != executed_before:  # a block committed while we forked
            await handle.kill(wait=False)
            self._shadowed_code = ""
            self._dirty.set()
            return
        shadow = _Shadow(handle, self._turn, layout)
        self._shadow = shadow
        self.trace.emit("spec_peek", turn=self._turn, lines=code.count("\n"))
        await handle.post({"op": "shadow", "code": code, "speculatable": self.speculatable,
                           "cpu_s": SHADOW_CPU_S, "force_timeout": None})

    async def _kill_shadow(self) -> None:
        shadow, self._shadow = self._shadow, None
        if shadow is not None:
            with contextlib.suppress(Exception):
                await shadow.handle.kill(wait=False)

    def _on_message(self, token: str, message: dict[str, Any]) -> None:
        shadow = self._shadow
        if shadow is None or shadow.handle.token != token:
            return  # a superseded shadow: ignore what it still says
        op = message.get("op")
        if op == "launch":
            self._on_launch(shadow, message)
        elif op == "shadow_done":
            if not message.get("pending"):
                self._retract_unadopted(shadow)

    def _on_launch(self, shadow: _Shadow, message: dict[str, Any]) -> None:
        local_id = message.get("call")
        name = message.get("name")
        args = tuple(message.get("args") or ())
        kwargs = dict(message.get("kwargs") or {})
        block, line = shadow.block_of(message.get("lineno"))
        call = None
        if name in self.speculatable:
            tool = self.registry.get(name)
            try:
                key = tool.call_key(args, kwargs)
            except Exception:
                key = None
            if key is not None:
                shadow.occurrences[key] += 1
                n = shadow.occurrences[key]
                same = [c for c in self.ledger.calls
                        if c.key == key and c.tag[0] == self._turn and c.tag[1] >= shadow.first_block
                        and c.state != "cancelled"]
                if n <= len(same):
                    call = same[n - 1]
                elif shadow.launched < self.ledger.budget.max_per_shadow:
                    call = self.ledger.launch(name, key, args, kwargs, tag=(self._turn, block))
                    if call is not None:
                        shadow.launched += 1
                        self.stats.launched += 1
                        deps = sorted({shadow.local[d].id for d in message.get("deps") or ()
                                       if d in shadow.local})
                        self.trace.emit("spec_launch", early_id=call.id, tool=name,
                                        turn=self._turn, block=block, lineno=line, deps=deps)
        if call is None:
            self._post(shadow, {"op": "early_poison", "call": local_id, "message": "not launched"})
            return
        shadow.local[local_id] = call
        assert self._tg is not None
        self._tg.start_soon(self._deliver, shadow, local_id, call)

    async def _deliver(self, shadow: _Shadow, local_id: Any, call: EarlyCall) -> None:
        await call.done.wait()
        if call.state == "cancelled":
            message = {"op": "early_poison", "call": local_id, "message": "cancelled"}
        elif call.error is not None:
            message = {"op": "early_fail", "call": local_id, "message": str(call.error)}
        else:
            message = {"op": "early_result", "call": local_id, "value": call.result}
        await self._post_async(shadow, message)

    def _post(self, shadow: _Shadow, message: dict[str, Any]) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._post_async, shadow, message)

    async def _post_async(self, shadow: _Shadow, message: dict[str, Any]) -> None:
        if shadow is self._shadow:
            with contextlib.suppress(Exception):
                await shadow.handle.post(message)

    def _retract_unadopted(self, shadow: _Shadow) -> None:
        adopted = {id(c) for c in shadow.local.values()}
        self._cancel(
            lambda c: c.tag[0] == self._turn and c.tag[1] >= shadow.first_block
            and id(c) not in adopted,
            "retracted",
        )


__all__ = ["Speculator", "SpeculationBudget", "SHADOW_CPU_S"]
