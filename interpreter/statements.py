"""The statement scanner: where Python's logical lines end, for code that may still be arriving.

:class:`LogicalLines` takes physical lines one at a time and reports each logical line as soon as
it is complete (brackets balanced, no open triple-quoted string, no trailing backslash), with
what it starts with and its last token. It is the one scanner of the interpreter: the segmenter
(which statements of a streaming block are complete) and the open-tail repair (the longest
runnable prefix of the statement still streaming) both read code through it.

Broken code does not stall it: a line with an unmatched closing bracket or a stray character
ends where Python's own tokenizer gives up (its last token is then None), and executing it
surfaces the SyntaxError. Text after an unclosed bracket or string cannot be split: that logical
line never completes. Each new line is tokenized together with the logical line it continues,
never the whole text, so feeding a few hundred lines costs about as much as tokenizing them once.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

_HEAD = re.compile(r"@|[^\W\d]\w*")
_ASYNC_HEAD = re.compile(r"async[ \t]+(def|for|with)\b")
_CLOSERS = frozenset(")]}'\"")
_SKIP_TOKENS = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT})


@dataclass(frozen=True)
class LogicalLine:
    """One complete logical line: physical lines ``start`` to ``end`` (0-based, ``end``
    exclusive) of the lines scanned."""

    start: int
    end: int
    indent: str
    """The leading whitespace of its first line."""
    head: str
    """What it starts with: a keyword (``"for"``, ``"async def"``, ``"else"``...), ``"@"``, a
    name, or ``""``; ``match`` counts as a keyword only when the line ends with ``:``."""
    last_token: str | None
    """Its last significant token; None when the tokenizer gave up on it (broken code)."""

    @property
    def is_header(self) -> bool:
        """Whether it opens a block (it ends with a colon)."""
        return self.last_token == ":"

    @property
    def width(self) -> int:
        """The width of its indentation (tabs to multiples of 8)."""
        return len(self.indent.expandtabs(8))


class LogicalLines:
    """Incremental scanner: :meth:`add` physical lines (each ending with a newline), get the
    logical lines they complete. Blank and comment-only lines between logical lines belong to
    none."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._next = 0
        """Index of the first line not yet part of a reported logical line."""
        self._start: int | None = None
        self._scanned_to = 0

    @property
    def open_start(self) -> int | None:
        """Index of the first line of the logical line in progress (None: there is none)."""
        return self._start

    def add(self, line: str) -> list[LogicalLine]:
        """Add one physical line; the logical lines it completes, in order."""
        self.lines.append(line)
        done: list[LogicalLine] = []
        lines = self.lines
        while True:
            if self._start is None:
                while self._next < len(lines) and _is_blank_or_comment(lines[self._next]):
                    self._next += 1
                if self._next == len(lines):
                    return done
                self._start = self._scanned_to = self._next
            found = self._scan()
            if found is None:
                return done
            end, last_token = found
            start, self._start, self._next = self._start, None, end
            first = lines[start]
            stripped = first.lstrip(" \t\f")
            done.append(LogicalLine(start, end, first[:len(first) - len(stripped)],
                                    _head(stripped, last_token), last_token))

    def _scan(self) -> tuple[int, str | None] | None:
        """(end, last significant token) of the logical line in progress, or None if incomplete."""
        start, stop = self._start, len(self.lines)
        assert start is not None
        if self._scanned_to > start:
            # Already incomplete at the last scan: only a closing bracket or quote in the new
            # lines, or a backslash ending the previous line, can complete it.
            new_lines = self.lines[self._scanned_to:stop]
            if not self.lines[self._scanned_to - 1].rstrip("\r\n").endswith("\\") and not any(
                    _CLOSERS.intersection(line) for line in new_lines):
                self._scanned_to = stop
                return None
        self._scanned_to = stop
        return _logical_line_end(self.lines, start, stop)


def logical_lines(lines: list[str]) -> list[LogicalLine]:
    """The complete logical lines of ``lines`` (each ending with a newline), in order; a
    logical line still open at the end is left out."""
    scanner = LogicalLines()
    found: list[LogicalLine] = []
    for line in lines:
        found += scanner.add(line)
    return found


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


def _head(text: str, last_token: str | None) -> str:
    """What a logical line (its first line without indentation) starts with."""
    match = _HEAD.match(text)
    if not match:
        return ""
    word = match.group()
    if word == "async":
        pair = _ASYNC_HEAD.match(text)
        return f"async {pair.group(1)}" if pair else word
    if word == "match" and last_token != ":":
        return ""  # ``match`` is a soft keyword: here it is a plain name
    return word


def _is_blank_or_comment(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")
