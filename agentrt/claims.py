"""`Claims`: the authoritative run's claims on early calls, and what the unclaimed ones count as.

A call of a speculatable tool claims, by key, the oldest live unclaimed early call of the turn
(a **hit**: it waits for that call's outcome, a private copy of its result or its exception
raised exactly where a sequential run raises it); finding none is a **miss** and the caller
runs the tool. Counting is decided once a block has executed (or the turn ended), from what the
program did: an early call never claimed is **wasted** if the program called its key in that
block, **retracted** if it never did. ``launched == hits + wasted + retracted``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from agentrt.tools import Tool

from .events import SpecCancel, SpecClaim
from .ledger import Ledger, argument_bytes, compact_key
from .results import RunStats
from .trace import Trace


class Claims:
    """Claims and counts of one run, on its `Ledger`."""

    def __init__(self, ledger: Ledger, trace: Trace, stats: RunStats) -> None:
        self.ledger = ledger
        self.trace = trace
        self.stats = stats
        self._asked: dict[tuple[int, int], Counter] = {}
        """(turn, block) -> how many times the program called each key there."""
        self._seq = 0

    def block_started(self, turn: int, block: int) -> None:
        self._asked.setdefault((turn, block), Counter())

    def asked(self, turn: int, block: int, key: str) -> int:
        """How many times the program has called ``key`` in that block so far."""
        return self._asked.get((turn, block), Counter())[key]

    async def claim(self, tool: Tool, args: tuple, kwargs: dict, *, turn: int,
                    block: int | None) -> tuple[bool, Any]:
        """``(True, result)`` when an early call of ``turn`` serves this call of the program
        (made in ``block``, if known); ``(False, None)`` on a miss and for a tool that is not
        speculatable."""
        seq = self._seq
        self._seq += 1
        if not tool.speculate:
            return False, None
        if self.ledger.arguments_refused(argument_bytes(args, kwargs)) == "launch":
            self.trace.emit(SpecClaim(seq, tool.name, None))
            self.stats.misses += 1  # no early call has arguments this large
            return False, None
        try:
            key = compact_key(tool.call_key(args, kwargs))
        except Exception:
            return False, None  # let the plain call raise the same validation error
        if block is not None:
            self._asked.setdefault((turn, block), Counter())[key] += 1
        call = self.ledger.claim(key, turn=turn)
        self.trace.emit(SpecClaim(seq, tool.name, call.id if call is not None else None))
        if call is None:
            self.stats.misses += 1
            return False, None
        self.stats.hits += 1
        await call.done.wait()
        if call.started_s is not None:
            end = call.finished_s if call.finished_s is not None else call.claimed_s
            self.stats.hidden_s += max(0.0, min(end, call.claimed_s) - call.started_s)
        return True, call.outcome()

    def settle(self, *, turn: int | None = None, block: int | None = None) -> None:
        """Count the unclaimed early calls (of ``turn`` and ``block``, if given) once each:
        wasted if the program made that call in their block, else retracted."""
        for call in self.ledger.retire(turn=turn, block=block):
            asked = self._asked.get((call.origin.turn, call.origin.block), Counter())
            reason = "wasted" if asked[call.key] else "retracted"
            if reason == "wasted":
                self.stats.wasted += 1
            else:
                self.stats.retracted += 1
            self.trace.emit(SpecCancel(call.id, reason))

    def release(self) -> None:
        """Drop the keys the program called (the run is over)."""
        self._asked = {}
