"""The stream segmenter: finds code blocks in a streamed model response and reports, as the text
arrives, which top-level statements of the current block are complete.

Rules:

* A block opens with a line that is exactly ```` ```repl ````, ```` ```python ```` or ```` ```py ````
  at column 0 (any letter case, trailing spaces allowed) and closes with a line that is exactly
  ```` ``` ```` at column 0 (trailing spaces allowed). A fence line is recognised wherever it
  appears, even inside a triple-quoted string of the code: that is the one known ambiguity of
  the format, resolved in favour of the fence. Text outside blocks is prose and is ignored.
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
  split, so nothing more is reported before the block ends; the block's code is always complete.

Each new line is tokenized together with the logical line it continues, never the whole block,
so feeding a block of a few hundred lines costs about as much as tokenizing it once.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

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
    """A code block ended; ``code`` is all of it. ``unterminated``: the response ended first."""

    block_index: int
    code: str
    unterminated: bool


SegmentEvent = BlockOpened | StatementClosed | BlockClosed

_OPEN_FENCE = re.compile(r"```(repl|python|py)[ \t]*", re.IGNORECASE)
_MAYBE_FENCE = re.compile(r"`{1,3}[ \t]*\r?")
_WORD = re.compile(r"[^\W\d]\w*")
_HEAD = re.compile(r"@|[^\W\d]\w*")
_ASYNC_HEAD = re.compile(r"async[ \t]+(def|for|with)\b")
_CLOSERS = frozenset(")]}'\"")
_SKIP_TOKENS = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT})

# Heads of compound statements -> the clauses that may continue them at column 0.
_CONTINUATIONS: dict[str, frozenset[str]] = {
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
        self._finished = False
        self._block_index = -1
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
        return events

    @property
    def in_block(self) -> bool:
        """True while inside a code block."""
        return self._in_block

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
        if not self._in_block:
            match = _OPEN_FENCE.fullmatch(_strip_eol(line))
            if match:
                self._open_block(match.group(1).lower(), events)
        elif _is_close_fence(line):
            self._close_block(events, unterminated=False)
        else:
            self._add_line(line, events)

    def _start_block(self) -> None:
        self._lines: list[str] = []
        self._offsets: list[int] = []
        self._code = ""
        self._stmt_count = 0
        self._closed_upto = 0
        self._next = 0
        self._logical_start: int | None = None
        self._scanned_to = 0
        self._open: _OpenStatement | None = None

    def _open_block(self, lang: str, events: list[SegmentEvent]) -> None:
        self._block_index += 1
        self._in_block = True
        self._start_block()
        events.append(BlockOpened(self._block_index, lang))

    def _close_block(self, events: list[SegmentEvent], unterminated: bool) -> None:
        if self._logical_start is not None:
            # The logical line in progress can't be completed any more: it is not reported. If it
            # is indented it belongs to the open statement, which is then incomplete as well.
            if _indent(self._lines[self._logical_start]) > 0:
                self._open = None
        if self._open is not None:
            self._close_open(events)
        events.append(BlockClosed(self._block_index, self._code, unterminated))
        self._in_block = False
        self._start_block()

    def _add_line(self, line: str, events: list[SegmentEvent]) -> None:
        self._offsets.append(len(self._code))
        self._lines.append(line)
        self._code += line
        self._advance(events)

    def _line_offset(self, index: int) -> int:
        return self._offsets[index] if index < len(self._offsets) else len(self._code)

    # -- logical lines -----------------------------------------------------------------------

    def _advance(self, events: list[SegmentEvent]) -> None:
        """Consume every logical line completed by the lines received so far."""
        lines = self._lines
        while True:
            if self._logical_start is None:
                while self._next < len(lines) and _is_blank_or_comment(lines[self._next]):
                    self._next += 1
                if self._next == len(lines):
                    return
                self._logical_start = self._scanned_to = self._next
                self._close_if_new_statement(lines[self._next], events, word_complete=True)
            found = self._scan_logical_line()
            if found is None:
                return
            end, last_token = found
            start = self._logical_start
            self._logical_start = None
            self._next = end
            self._on_logical_line(start, end, last_token, events)

    def _scan_logical_line(self) -> tuple[int, str | None] | None:
        """(end, last significant token) of the logical line in progress, or None if incomplete."""
        start, stop = self._logical_start, len(self._lines)
        assert start is not None
        if self._scanned_to > start:
            # Already incomplete at the last scan: only a closing bracket or quote in the new
            # lines, or a backslash ending the previous line, can complete it.
            new_lines = self._lines[self._scanned_to : stop]
            if not _strip_eol(self._lines[self._scanned_to - 1]).endswith("\\") and not any(
                _CLOSERS.intersection(line) for line in new_lines
            ):
                self._scanned_to = stop
                return None
        self._scanned_to = stop
        return _logical_line_end(self._lines, start, stop)

    def _on_logical_line(
        self, start: int, end: int, last_token: str | None, events: list[SegmentEvent]
    ) -> None:
        first = self._lines[start]
        indent = _indent(first)
        if indent > 0:
            if self._open is not None:
                self._open.end = end
            else:  # an unexpected indent: report it on its own
                self._emit(start, end, events)
            return
        head = _head(first, last_token)
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
        if self._logical_start is None:
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


def _logical_line_end(lines: list[str], start: int, stop: int) -> tuple[int, str | None] | None:
    """Where the logical line starting at ``lines[start]`` ends (exclusive line index), with its
    last significant token; None while it is incomplete (open bracket, string or backslash)."""
    text = "".join(lines[start:stop])
    if not text.endswith("\n"):
        text += "\n"
    depth = 0
    last: str | None = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            row = tok.start[0]
            if tok.type == tokenize.NEWLINE:
                return start + row, last
            if tok.type == tokenize.ERRORTOKEN and not tok.string.isspace():
                return start + row, None  # a stray character or an unterminated string
            if tok.type == tokenize.OP:
                if tok.string in ("(", "[", "{"):
                    depth += 1
                elif tok.string in (")", "]", "}"):
                    depth -= 1
                    if depth < 0:
                        return start + row, None  # an unmatched closing bracket
            if tok.type not in _SKIP_TOKENS:
                last = tok.string
    except tokenize.TokenError as exc:
        message = str(exc.args[0]) if exc.args else ""
        if "EOF" in message or "triple-quoted" in message:
            return None
        return stop, None
    except SyntaxError:  # newer tokenizers raise on broken code
        return stop, None
    return stop, last


def _head(line: str, last_token: str | None) -> str:
    """What a column-0 logical line starts with: a keyword, "@", "async def"..., or a name."""
    match = _HEAD.match(line)
    if not match:
        return ""
    word = match.group()
    if word == "async":
        pair = _ASYNC_HEAD.match(line)
        return f"async {pair.group(1)}" if pair else word
    if word == "match" and last_token != ":":
        return ""  # ``match`` is a soft keyword: here it is a plain name
    return word


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t\f"))


def _is_blank_or_comment(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _strip_eol(line: str) -> str:
    return line.rstrip("\n").rstrip("\r")


def _is_close_fence(line: str) -> bool:
    return _strip_eol(line).rstrip(" \t") == "```"
