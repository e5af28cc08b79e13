"""`Turn`: the protocol of one model response, the same for every loop that runs model code.

A turn takes the response's text as it streams (`Turn.feed`), finds its code blocks and their
complete statements with the segmenter, reports that code to speculation, hands each block to
run to its loop (``on_block``) and executes a block when the loop asks (`Turn.execute`), with
the trace events of each step. The blocks' tool calls are served by the run's `ProgramCalls`.

What differs between loops is a parameter, not a second protocol: which blocks run
(`BlockSelection`), how a cell runs and what its failure means (the ``run`` given to
`Turn.execute`, `CellFailed`), what a served call also does (`ProgramCalls`' ``on_result``).
The `Agent` streams from an engine and makes the blocks' output the next prompt; the RLM
environment is fed by the RLM library's root model and answers each of its cells.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from agentrt.interpreter.segmenter import (
    BlockClosed,
    BlockOpened,
    CodeStream,
    SegmentEvent,
    StatementClosed,
)

from .errors import AgentrtError
from .events import (
    BlockClosedEvent,
    BlockOpenedEvent,
    DeltaEvent,
    ExecFinished,
    ExecStarted,
    StatementClosedEvent,
    TurnFinished,
    TurnStarted,
)
from .program_calls import ProgramCalls


@dataclass(frozen=True)
class BlockSelection:
    """Which of the segmenter's code blocks a loop runs; the others are neither traced nor
    speculated."""

    languages: frozenset[str] | None = None
    """Fence languages of the blocks it runs (None: every code block)."""
    unterminated: bool = True
    """Whether it runs a block the response ended inside (speculation sees it either way)."""


EVERY_BLOCK = BlockSelection()


@dataclass(frozen=True)
class Block:
    """A block to run: its number among the turn's selected blocks (from 0), and its code."""

    index: int
    code: str


class CellFailed(AgentrtError):
    """A cell could not run, and the turn goes on: ``str(self)`` is the block's error."""


class Executed(Protocol):
    """What a cell's run reports: its error text, and its final answer (None: none)."""

    error: str | None
    final: Any


E = TypeVar("E", bound=Executed)


class Turn:
    """One response of the model (turns are numbered from 0 in a run)."""

    def __init__(self, index: int, calls: ProgramCalls,
                 on_block: Callable[[Block], None] = lambda block: None,
                 selection: BlockSelection = EVERY_BLOCK) -> None:
        self.index = index
        self.calls = calls
        self.trace = calls.trace
        self._on_block = on_block
        self._selection = selection
        self._segmenter = CodeStream()
        self._numbers: dict[int, int] = {}
        """Segmenter block index -> number among the selected blocks."""
        self._in_selected = False

    @property
    def prose(self) -> str:
        """The response's text outside code and other fenced blocks, so far."""
        return self._segmenter.prose

    def start(self) -> None:
        self.trace.emit(TurnStarted(self.index))
        self.calls.speculator.start_turn(self.index)

    def feed(self, text: str, *, delta: bool = True) -> None:
        """Text of the response (``delta``: as the model streamed it, traced; else code
        given whole)."""
        if not text:
            return
        if delta:
            self.trace.emit(DeltaEvent(self.index, len(text), text))
        self._forward(self._segmenter.feed(text))
        if "\n" in text and self._in_selected:
            self.calls.speculator.open_block_grew(self._segmenter.open_tail)

    def finish(self) -> None:
        """The response is complete (a block still open closes, unterminated)."""
        self._forward(self._segmenter.finish())

    def _forward(self, events: Sequence[SegmentEvent]) -> None:
        speculator = self.calls.speculator
        for ev in events:
            if isinstance(ev, BlockOpened):
                langs = self._selection.languages
                self._in_selected = langs is None or ev.lang in langs
                if self._in_selected:
                    self._numbers[ev.index] = len(self._numbers)
                    self.trace.emit(BlockOpenedEvent(self.index, self._numbers[ev.index]))
                continue
            block = self._numbers.get(ev.block_index)
            if block is None:
                continue
            if isinstance(ev, StatementClosed):
                self.trace.emit(StatementClosedEvent(self.index, block, ev.stmt_index, ev.lineno))
                speculator.statement_closed(block, ev.lineno, ev.end_lineno, ev.source)
            elif isinstance(ev, BlockClosed):
                self._in_selected = False
                self.trace.emit(BlockClosedEvent(self.index, block, len(ev.code),
                                                 ev.unterminated))
                if self._selection.unterminated or not ev.unterminated:
                    self._on_block(Block(block, ev.code))
                speculator.block_closed(block, ev.code, ev.broken)

    async def execute(self, block: Block, run: Callable[[str], Awaitable[E]]) -> E:
        """Run ``block``'s code with ``run`` as the authoritative run; its calls are served
        as this block's. A `CellFailed` from ``run`` is the block's error (speculation counts
        the block as executed); any other exception is the loop's failure. Both are traced in
        ``exec_finished`` and raised on."""
        self.trace.emit(ExecStarted(self.index, block.index))
        self.calls.block = (self.index, block.index)
        self.calls.speculator.block_started(block.index)
        try:
            result = await run(block.code)
        except Exception as exc:
            if isinstance(exc, CellFailed):
                self.calls.speculator.block_executed(block.index)
            self.trace.emit(ExecFinished(self.index, block.index, str(exc), False))
            raise
        self.calls.speculator.block_executed(block.index)
        self.trace.emit(ExecFinished(self.index, block.index, result.error,
                                     result.final is not None))
        return result

    async def end_speculation(self) -> None:
        """The turn's code is over (its blocks ran, or the response died): speculation
        counts its early calls (`Claims.settle`) and stops its shadow."""
        await self.calls.speculator.end_turn()

    def finished(self, finish_reason: str | None = None, completion_tokens: int = 0) -> None:
        self.trace.emit(TurnFinished(self.index, finish_reason, completion_tokens))
