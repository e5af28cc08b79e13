"""`ShadowCode`: the code a shadow runs, kept in step with what the segmenter reports.

That code is every block of the turn that has closed but not executed for real, plus the open
block's closed statements and its open tail repaired to its longest runnable prefix
(``repair_tail``). Lines are numbered through all the blocks it holds; a closed block the
segmenter could not split into statements (a syntax error) is left out, as the real run
executes none of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrt.interpreter.repair import TailRepair

Statement = tuple[int, int, str]
"""(block, first line in the shadow's code, source) of one statement."""


@dataclass
class _BlockCode:
    """One block of the turn as the segmenter reported it."""

    statements: list[tuple[int, int, str]] = field(default_factory=list)
    """(first line, last line, source) of each closed top-level statement."""
    closed: bool = False
    broken: bool = False
    """Closed with code the segmenter could not split (the real cell is a syntax error)."""
    lines: int = 0


@dataclass(frozen=True)
class ShadowProgram:
    """What one shadow runs: its statements, where each block starts, where the tail starts."""

    statements: tuple[Statement, ...]
    layout: tuple[tuple[int, int], ...]
    """(block index, first line) of each block in the code, in order."""
    tail_line: int | None
    """First line of the repaired open tail (None: no tail)."""

    @property
    def tail(self) -> str | None:
        """The repaired open tail's source (the last statement), if there is one."""
        return self.statements[-1][2] if self.tail_line is not None else None

    @property
    def lines(self) -> int:
        return sum(source.count("\n") for _, _, source in self.statements)


class ShadowCode:
    """The turn's code as the segmenter closed it, and the part not yet executed for real."""

    def __init__(self) -> None:
        self._blocks: list[_BlockCode] = []
        """This turn's blocks (the last one may still be open)."""
        self.executed = 0
        """Blocks of the turn the authoritative run has executed."""
        self._tail = ""
        self._repair = TailRepair()

    def start_turn(self) -> None:
        self._blocks, self.executed, self._tail = [], 0, ""

    def statement_closed(self, block: int, lineno: int, end_lineno: int, source: str) -> None:
        """The segmenter closed a top-level statement (lines ``lineno..end_lineno`` of ``block``)."""
        self._block(block).statements.append((lineno, end_lineno, source))
        self._tail = ""

    def block_closed(self, block: int, code: str, broken: bool = False) -> None:
        """Block ``block`` closed with ``code`` (``broken``: not all of it could be split)."""
        closed = self._block(block)
        closed.closed, closed.broken = True, broken
        closed.lines = code.count("\n") + (0 if code.endswith("\n") or not code else 1)
        self._tail = ""

    def open_block_grew(self, tail: str) -> None:
        """The open block's text after its last closed statement is now ``tail``."""
        self._tail = tail

    def block_executed(self, block: int) -> None:
        """The authoritative run executed block ``block``: shadows no longer run it."""
        self.executed = block + 1

    def release(self) -> None:
        """Drop the turn's code (the run is over)."""
        self._blocks, self._tail = [], ""

    def program(self) -> ShadowProgram:
        """The code a shadow started now runs."""
        statements: list[Statement] = []
        layout: list[tuple[int, int]] = []
        tail_line: int | None = None
        first = 1
        for index in range(self.executed, len(self._blocks)):
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
        return ShadowProgram(tuple(statements), tuple(layout), tail_line)

    def _block(self, index: int) -> _BlockCode:
        while len(self._blocks) <= index:
            self._blocks.append(_BlockCode())
        return self._blocks[index]
