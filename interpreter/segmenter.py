"""The stream segmenter: finds code blocks in a streamed model response and reports, as the text
arrives, which top-level statements of the current block are complete.

Rules:

* A block opens with a line that is exactly ```` ```repl ````, ```` ```python ```` or ```` ```py ````
  at column 0 (any letter case, trailing spaces allowed) and closes with a line that is exactly
  ```` ``` ```` at column 0 (trailing spaces allowed). A fence line is recognised wherever it
  appears, even inside a triple-quoted string of the code: that is the one known ambiguity of
  the format, resolved in favour of the fence. Any other fence (```` ```json ````, a bare
  ```` ``` ````) opens a quoted block, closed by the next ```` ``` ```` line, that is neither
  code nor prose (a code fence inside one still opens a code block). The rest is prose
  (:attr:`CodeStream.prose`: the runtime looks for ``FINAL(...)`` written as text there).
* A top-level statement is *closed* when nothing that follows can still belong to it:
  a simple statement as soon as the newline ending its last line arrives and the tokenizer finds
  it complete (brackets balanced, no open triple-quoted string, no trailing backslash); a compound
  statement (``def``, ``class``, ``if``, ``for``, ``while``, ``try``, ``with``, ``match``,
  ``async ...``, with any decorators above it) once a later line starts at column 0 with code that
  is not one of its continuation clauses (``elif`` / ``else`` / ``except`` / ``finally``), or when
  the block closes. Comment and blank lines between statements belong to none of them.
  Semicolon-separated statements on one line are reported as one.
* Broken code doesn't stall the segmenter: a line with an unmatched closing bracket or a stray
  character ends where Python's own tokenizer would give up, and is reported like any statement
  (executing it surfaces the SyntaxError). Text after an unclosed bracket or string can't be
  split, so nothing more is reported before the block ends (``BlockClosed.broken``); the block's
  code is always complete.

Logical lines come from the interpreter's one statement scanner (statements.py), which
tokenizes each new line together with the logical line it continues, never the whole block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from .statements import LogicalLine, LogicalLines

__all__ = ["BlockClosed", "BlockOpened", "CodeStream", "SegmentEvent", "StatementClosed"]


@dataclass(frozen=True)
class BlockOpened:
    """A code block started; ``index`` counts blocks from 0 within the response."""

    index: int
    lang: str


@dataclass(frozen=True)
class StatementClosed:
    """One complete top-level statement of block ``block_index``.

    ``source`` is the exact text of lines ``lineno`` to ``end_lineno`` (1-based, inclusive,
    counted within the block's code), decorators included.
    """

    block_index: int
    stmt_index: int
    source: str
    lineno: int
    end_lineno: int


@dataclass(frozen=True)
class BlockClosed:
    """A code block ended; ``code`` is all of it. ``unterminated``: the response ended first.
    ``broken``: code after its last reported statement could not be split into statements (an
    unclosed bracket or string: running the block is a syntax error)."""

    block_index: int
    code: str
    unterminated: bool
    broken: bool = False


SegmentEvent = BlockOpened | StatementClosed | BlockClosed

_OPEN_FENCE = re.compile(r"```(repl|python|py)[ \t]*", re.IGNORECASE)
_MAYBE_FENCE = re.compile(r"`{1,3}[ \t]*\r?")
_WORD = re.compile(r"[^\W\d]\w*")

# Heads of compound statements -> the clauses that may continue them at column 0.
_CONTINUATIONS: Final[dict[str, frozenset[str]]] = {
    "if": frozenset({"elif", "else"}),
    "for": frozenset({"else"}),
    "async for": frozenset({"else"}),
    "while": frozenset({"else"}),
    "try": frozenset({"except", "else", "finally"}),
    "with": frozenset(),
    "async with": frozenset(),
    "def": frozenset(),
    "async def": frozenset(),
    "class": frozenset(),
    "match": frozenset(),
    # Clauses met without their statement (a syntax error) still own their bodies.
    "elif": frozenset({"elif", "else"}),
    "else": frozenset(),
    "except": frozenset({"except", "else", "finally"}),
    "finally": frozenset(),
}


@dataclass
class _OpenStatement:
    start: int
    """Index of its first line."""
    end: int
    """Index after its last line so far."""
    continuations: frozenset[str] | None
    """Clauses that may still join it; None while only decorators have been seen."""


class CodeStream:
    """Incremental segmenter of one model response: `feed` text deltas, then `finish`."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_block = False
        self._quoted = False
        self._finished = False
        self._block_index = -1
        self._prose: list[str] = []
        self._start_block()

    # -- public API --------------------------------------------------------------------------

    def feed(self, delta: str) -> list[SegmentEvent]:
        """Add streamed text; return the events it completes, in order."""
        if self._finished:
            raise RuntimeError("CodeStream.feed() called after finish()")
        events: list[SegmentEvent] = []
        text = self._pending + delta
        start = 0
        newline = text.find("\n", len(self._pending))
        while newline >= 0:
            self._on_line(text[start : newline + 1], events)
            start = newline + 1
            newline = text.find("\n", start)
        self._pending = text[start:]
        if self._in_block:
            self._close_on_partial_line(events)
        return events

    def finish(self) -> list[SegmentEvent]:
        """End of the response: close an unterminated block (``BlockClosed(unterminated=True)``)."""
        if self._finished:
            return []
        self._finished = True
        events: list[SegmentEvent] = []
        tail, self._pending = self._pending, ""
        if self._in_block:
            if tail and _is_close_fence(tail):
                self._close_block(events, unterminated=False)
            else:
                if tail:
                    self._add_line(tail, events)
                self._close_block(events, unterminated=True)
        else:
            match = _OPEN_FENCE.fullmatch(_strip_eol(tail))
            if match:
                self._open_block(match.group(1).lower(), events)
                self._close_block(events, unterminated=True)
            elif not self._quoted:
                self._prose.append(tail)
        return events

    @property
    def in_block(self) -> bool:
        """True while inside a code block."""
        return self._in_block

    @property
    def prose(self) -> str:
        """The response's complete lines so far (all of it after `finish`) outside code blocks,
        quoted blocks and fence lines."""
        return "".join(self._prose)

    @property
    def current_block_code(self) -> str:
        """The current block's code so far ("" outside a block), a partial last line included
        unless it may still turn out to be the closing fence."""
        if not self._in_block:
            return ""
        if _MAYBE_FENCE.fullmatch(self._pending):
            return self._code
        return self._code + self._pending

    @property
    def open_tail(self) -> str:
        """The current block's text after its last closed statement ("" outside a block)."""
        return self.current_block_code[self._line_offset(self._closed_upto) :]

    # -- lines -------------------------------------------------------------------------------

    def _on_line(self, line: str, events: list[SegmentEvent]) -> None:
        if self._in_block:
            if _is_close_fence(line):
                self._close_block(events, unterminated=False)
            else:
                self._add_line(line, events)
            return
        match = _OPEN_FENCE.fullmatch(_strip_eol(line))
        if match:
            self._quoted = False
            self._open_block(match.group(1).lower(), events)
        elif _is_close_fence(line) if self._quoted else line.startswith("```"):
            self._quoted = not self._quoted
        elif not self._quoted:
            self._prose.append(line)

    def _start_block(self) -> None:
        self._scanner = LogicalLines()
        self._offsets: list[int] = []
        self._code = ""
        self._stmt_count = 0
        self._closed_upto = 0
        self._checked_start: int | None = None
        """The logical line in progress whose start was checked against the open statement."""
        self._open: _OpenStatement | None = None

    def _open_block(self, lang: str, events: list[SegmentEvent]) -> None:
        self._block_index += 1
        self._in_block = True
        self._start_block()
        events.append(BlockOpened(self._block_index, lang))

    def _close_block(self, events: list[SegmentEvent], unterminated: bool) -> None:
        start = self._scanner.open_start
        if start is not None:
            # The logical line in progress can't be completed any more: it is not reported. If it
            # is indented it belongs to the open statement, which is then incomplete as well.
            if _indent(self._scanner.lines[start]) > 0:
                self._open = None
        if self._open is not None:
            self._close_open(events)
        events.append(BlockClosed(self._block_index, self._code, unterminated,
                                  broken=start is not None))
        self._in_block = False
        self._start_block()

    def _add_line(self, line: str, events: list[SegmentEvent]) -> None:
        self._offsets.append(len(self._code))
        self._code += line
        for logical in self._scanner.add(line):
            self._on_logical_line(logical, events)
        start = self._scanner.open_start
        if start is not None and start != self._checked_start:
            self._checked_start = start
            self._close_if_new_statement(self._scanner.lines[start], events, word_complete=True)

    def _line_offset(self, index: int) -> int:
        return self._offsets[index] if index < len(self._offsets) else len(self._code)

    # -- logical lines -----------------------------------------------------------------------

    def _on_logical_line(self, line: LogicalLine, events: list[SegmentEvent]) -> None:
        start, end, head = line.start, line.end, line.head
        if line.indent:
            if self._open is not None:
                self._open.end = end
            else:  # an unexpected indent: report it on its own
                self._emit(start, end, events)
            return
        open_stmt = self._open
        if open_stmt is not None:
            if open_stmt.continuations is None:  # decorators: the next line joins them
                open_stmt.end = end
                if head != "@":
                    open_stmt.continuations = _CONTINUATIONS.get(head, frozenset())
                return
            if head in open_stmt.continuations:
                open_stmt.end = end
                return
            self._close_open(events)
        if head == "@":
            self._open = _OpenStatement(start, end, None)
        elif head in _CONTINUATIONS:
            self._open = _OpenStatement(start, end, _CONTINUATIONS[head])
        else:
            self._emit(start, end, events)

    def _close_on_partial_line(self, events: list[SegmentEvent]) -> None:
        """Close the open compound statement as soon as the partial last line shows that a new
        statement starts at column 0."""
        if self._scanner.open_start is None:
            self._close_if_new_statement(self._pending, events, word_complete=False)

    def _close_if_new_statement(
        self, line: str, events: list[SegmentEvent], *, word_complete: bool
    ) -> None:
        """Close the open compound statement if ``line``, the start of the next logical line,
        begins at column 0 with something other than one of its continuation clauses."""
        open_stmt = self._open
        if open_stmt is None or open_stmt.continuations is None:
            return
        if not line or line[0].isspace() or line[0] == "#":
            return
        match = _WORD.match(line)
        if match:
            word = match.group()
            if word in open_stmt.continuations:
                return
            if not word_complete and match.end() == len(line):  # the word may still grow
                if any(clause.startswith(word) for clause in open_stmt.continuations):
                    return
        self._close_open(events)

    def _close_open(self, events: list[SegmentEvent]) -> None:
        assert self._open is not None
        start, end = self._open.start, self._open.end
        self._open = None
        self._emit(start, end, events)

    def _emit(self, start: int, end: int, events: list[SegmentEvent]) -> None:
        source = self._code[self._line_offset(start) : self._line_offset(end)]
        events.append(StatementClosed(self._block_index, self._stmt_count, source, start + 1, end))
        self._stmt_count += 1
        self._closed_upto = end


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t\f"))


def _strip_eol(line: str) -> str:
    return line.rstrip("\n").rstrip("\r")


def _is_close_fence(line: str) -> bool:
    return _strip_eol(line).rstrip(" \t") == "```"
