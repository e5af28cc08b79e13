"""`LaunchGate`: which early call, if any, serves a launch a shadow run asks for.

A launch is refused when its tool is not speculatable, when it would overtake an effect (the
tool reads a scope written since the shadow's epoch), when its arguments pass a size cap (traced
once per call site and cap with ``spec_too_large``), when the ghost bound or the launch window
stops it, when the program has already made that call, or when a budget is spent. Otherwise the
n-th launch of a key in one shadow run *adopts* the n-th live early call of that key made this
turn by its blocks, and past those a new early call starts (``spec_launch``).

**Ghost bound and window**, for launches from the open tail (the statement still streaming):
a call site inside a ``while`` that repeats a key within one shadow run stops the tail's
launches (the loop made no progress: its update has not streamed yet); launches whose loop exit
may depend on results go out in a window of ``window`` calls per call site beyond the first one
the loop may still wait on. Launches that waited for an earlier result of their own site count
every unclaimed call of the site; launches whose result the code so far never reads count the
unclaimed calls still running. Maps and reductions are not throttled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentrt.interpreter.frames import Launch
from agentrt.interpreter.unread_results import unread_result_lines, while_loop_lines
from agentrt.tools import ToolRegistry

from .claims import Claims
from .effect_epochs import EffectEpochs
from .events import SpecLaunch, SpecTooLarge
from .ledger import EarlyCall, Ledger, Origin, argument_bytes, compact_key
from .results import RunStats
from .shadow_code import ShadowProgram
from .trace import Trace

LAUNCH_WINDOW = 4
"""Default of ``Agent(speculation_window=...)``: early calls one call site of the open tail may
launch beyond the first call its loop may still wait on."""


@dataclass
class ShadowLaunches:
    """One shadow run: where its code comes from, and the early calls it launched or adopted."""

    number: int
    """Which shadow run of the run this is (from 1)."""
    turn: int
    epoch: int
    layout: tuple[tuple[int, int], ...]
    """(block index, first line) of each block in the shadow's code, in order."""
    tail_line: int | None
    """First line of the repaired open tail in the shadow's code (None: no tail)."""
    code_s: float = 0.0
    """When the code it runs was complete (the delta or block that completed it), run time."""
    posted_s: float = 0.0
    """When it was forked and sent its code."""
    local: dict[Any, EarlyCall] = field(default_factory=dict)
    """The shadow's call ids -> the early calls serving them."""
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

    @classmethod
    def of(cls, program: ShadowProgram, number: int, turn: int, epoch: int,
           code_s: float) -> ShadowLaunches:
        """The run of ``program``, its open tail analysed for the ghost bound and the window."""
        run = cls(number, turn, epoch, program.layout, program.tail_line, code_s)
        tail, first = program.tail, program.tail_line
        if tail is not None and first is not None:
            run.unread_lines = frozenset(first - 1 + n for n in unread_result_lines(tail))
            in_while = while_loop_lines(tail)
            run.while_lines = None if in_while is None \
                else frozenset(first - 1 + n for n in in_while)
        return run

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


class LaunchGate:
    """Admits the launches of one run's shadows."""

    def __init__(self, registry: ToolRegistry, ledger: Ledger, epochs: EffectEpochs,
                 claims: Claims, trace: Trace, stats: RunStats,
                 window: int = LAUNCH_WINDOW) -> None:
        self.registry = registry
        self.ledger = ledger
        self.epochs = epochs
        self.claims = claims
        self.trace = trace
        self.stats = stats
        self.window = window
        self.speculatable = frozenset(t.name for t in registry if t.speculate)
        self._too_large_noted: set[tuple[int, int, int | None, str]] = set()
        """(turn, block, line, cap) of the launches refused for their argument size, traced."""

    def admit(self, run: ShadowLaunches, launch: Launch) -> EarlyCall | None:
        """The early call serving ``launch`` (adopted or new, recorded in ``run.local``), or
        None when it is refused."""
        deps = [run.local[d] for d in launch.deps if d in run.local]
        call = self._early_call(run, launch.name, launch.args, dict(launch.kwargs),
                                launch.lineno, deps)
        if call is not None:
            run.local[launch.call] = call
        return call

    def retract_unadopted(self, run: ShadowLaunches) -> None:
        """``run`` ran all its code: the early calls of its blocks it did not adopt are
        cancelled (counted when their block has executed or the turn ends)."""
        self.ledger.cancel_unclaimed(turn=run.turn, from_block=run.first_block,
                                     keep=list(run.local.values()))

    def release(self) -> None:
        self._too_large_noted.clear()

    def _early_call(self, run: ShadowLaunches, name: Any, args: tuple, kwargs: dict,
                    lineno: int | None, deps: list[EarlyCall]) -> EarlyCall | None:
        if name not in self.speculatable or self.epochs.overtakes(name, run.epoch):
            return None
        block, line = run.block_of(lineno)
        arg_bytes = argument_bytes(args, kwargs)
        if self.ledger.arguments_refused(arg_bytes) == "launch":
            self._note_too_large(run.turn, name, block, line, arg_bytes, "launch")
            return None  # before its key: nothing this large was launched, or is kept
        try:
            key = compact_key(self.registry.get(name).call_key(args, kwargs))
        except Exception:
            return None
        origin = Origin(run.turn, block, line, run.epoch, run.in_tail(lineno), run.number)
        if origin.in_tail and not self._window_allows(run, origin, lineno, key, deps):
            return None
        run.occurrences[key] += 1
        run.block_occurrences[block, key] += 1
        n = run.occurrences[key]
        same = self.ledger.adoptable(key, turn=run.turn, from_block=run.first_block)
        if n <= len(same):
            return same[n - 1]
        if self.claims.asked(run.turn, block, key) >= run.block_occurrences[block, key]:
            return None  # the authoritative run has already made this call: too late
        if self.ledger.arguments_refused(arg_bytes) == "run":
            self._note_too_large(run.turn, name, block, line, arg_bytes, "run")
            return None
        call = self.ledger.launch(name, key, args, kwargs, origin, arg_bytes)
        if call is None:
            return None  # a budget is spent
        self.stats.launched += 1
        self.trace.emit(SpecLaunch(call.id, name, run.turn, block, line,
                                   sorted({d.id for d in deps}), run.code_s, run.posted_s))
        return call

    def _note_too_large(self, turn: int, name: str, block: int, line: int | None,
                        arg_bytes: int | None, cap: str) -> None:
        """Trace, once per call site and cap, a launch refused for the size of its arguments."""
        noted = (turn, block, line, cap)
        if noted in self._too_large_noted:
            return
        self._too_large_noted.add(noted)
        budget = self.ledger.budget
        limit = budget.max_arg_bytes_per_launch if cap == "launch" \
            else budget.max_arg_bytes_per_run
        self.trace.emit(SpecTooLarge(name, turn, block, line, arg_bytes, limit, cap))

    def _window_allows(self, run: ShadowLaunches, origin: Origin, lineno: int | None, key: str,
                       deps: list[EarlyCall]) -> bool:
        """The ghost bound and the launch window for a launch from the open tail."""
        if run.tail_stalled:
            return False
        if (origin.site, key) in run.tail_keys and (
                run.while_lines is None or lineno in run.while_lines):
            run.tail_stalled = True  # the loop made no progress: stop launching from the tail
            return False
        run.tail_keys.add((origin.site, key))
        waited = any(d.origin.site == origin.site for d in deps)
        if not waited and lineno not in run.unread_lines:
            return True  # a map or a reduction: its results are used, not tested for an exit
        ahead = sum(1 for c in run.local.values()
                    if c.origin.site == origin.site and not c.claimed and c.live
                    and (waited or c.state != "done"))
        return ahead <= self.window
