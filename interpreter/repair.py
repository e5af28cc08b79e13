"""Open-tail repair: the longest runnable prefix of a statement that is still streaming.

While the model streams a code block, the text after the last complete top-level statement (the
*open tail*) may be a ``for`` loop whose body has only partly arrived, possibly cut mid-line.
:func:`repair_tail` turns it into code that compiles, without guessing anything:

* the incomplete last line (no newline yet) is dropped;
* a statement still open across lines (bracket, triple-quoted string, backslash) is dropped;
* a block header with no body yet gets an indented ``pass``;
* a ``try`` block with no ``except``/``finally`` yet gets ``finally: pass`` (exceptions still
  propagate, exactly as if the handlers had not arrived);
* if what is left does nothing but open blocks (e.g. only ``for x in xs:``), the answer is None.

A cheap scanner finds where logical lines end; ``compile()`` is then tried on those prefixes,
longest first, so the common case costs a single compilation. Results are cached by the
complete lines, so the calls made while one line streams in cost almost nothing.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["repair_tail"]

# Only the characters that change the structure of a line are tokens; the rest of the text is
# skipped by ``re.search`` at C speed. A bracket pair with nothing structural inside ("flat")
# is one token that changes nothing.
_TOKEN = re.compile(
    r"""
      (?P<flat>\([^()\[\]{}'"#\\\n]*\)|\[[^()\[\]{}'"#\\\n]*\]|\{[^()\[\]{}'"#\\\n]*\})
    | (?P<triple>'''|\"\"\")
    | (?P<single>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
    | (?P<open_single>['"])
    | (?P<comment>\#[^\n]*)
    | (?P<open>[(\[{])
    | (?P<close>[)\]}])
    | (?P<continuation>\\\n)
    | (?P<newline>\n)
    | (?P<colon>:)
    """,
    re.VERBOSE | re.DOTALL,
)
_TRIPLE_END = {"'''": re.compile(r"(?:[^\\]|\\.)*?'''", re.DOTALL),
               '"""': re.compile(r'(?:[^\\]|\\.)*?"""', re.DOTALL)}
_FIRST_WORD = re.compile(r"[A-Za-z_]\w*|@")


@dataclass(frozen=True)
class _LogicalLine:
    start: int  # first physical line (0-based)
    end: int  # one past the last physical line
    indent: int  # width of the leading whitespace
    indent_text: str
    first_word: str  # "for", "try", "@", "x", ...
    is_header: bool  # ends with ':' outside brackets, strings and comments


def _scan(lines: list[str]) -> list[_LogicalLine]:
    """The complete logical lines of ``lines`` (each ending with a newline)."""
    text = "".join(lines)
    result: list[_LogicalLine] = []
    depth = 0
    line_no = 0  # physical line at the current position
    start_line = 0  # first physical line of the current logical line
    start_pos = 0  # where that line starts in ``text``
    colon_end = -1  # end of the last ':' outside brackets in the current logical line
    pos = 0
    while True:
        match = _TOKEN.search(text, pos)
        if match is None:
            break
        kind = match.lastgroup
        pos = match.end()
        if kind == "newline":
            line_no += 1
            if depth:
                continue
            content = text[start_pos:match.start()].lstrip()
            if content and content[0] != "#":
                rest = text[colon_end:match.start()].lstrip() if colon_end >= 0 else "x"
                is_header = not rest or rest[0] == "#"
                result.append(_logical_line(lines, start_line, line_no, is_header))
            start_line, start_pos, colon_end = line_no, pos, -1
        elif kind == "continuation":
            line_no += 1
        elif kind == "triple":
            end = _TRIPLE_END[match.group()].match(text, pos)
            if end is None:
                break  # unterminated triple-quoted string: the rest is open
            pos = end.end()
            line_no += text.count("\n", match.start(), pos)
        elif kind == "open_single":
            break  # a string left open on its line: invalid, nothing after it counts
        elif kind == "open":
            depth += 1
        elif kind == "close":
            depth = max(0, depth - 1)
        elif kind == "colon" and not depth:
            colon_end = pos
    return result


def _logical_line(lines: list[str], start: int, end: int, is_header: bool) -> _LogicalLine:
    first = lines[start]
    stripped = first.lstrip(" \t\f")
    indent_text = first[: len(first) - len(stripped)]
    word = _FIRST_WORD.match(stripped)
    return _LogicalLine(start, end, len(indent_text.expandtabs(8)), indent_text,
                        word.group() if word else "", is_header)


def _body_indent(header: _LogicalLine) -> str:
    return header.indent_text + ("\t" if "\t" in header.indent_text else "    ")


def _does_something(logical: list[_LogicalLine], lines: list[str]) -> bool:
    """True if some line is more than a block header, a decorator or ``pass``."""
    for line in logical:
        if line.is_header or line.first_word == "@":
            continue
        if line.end - line.start == 1 and lines[line.start].strip() == "pass":
            continue
        return True
    return False


def _open_try_closers(logical: list[_LogicalLine]) -> list[str]:
    """``finally: pass`` lines closing every ``try`` still waiting for its handlers."""
    open_blocks: list[tuple[_LogicalLine, bool]] = []  # (header, is an unhandled try)
    for line in logical:
        while open_blocks and open_blocks[-1][0].indent >= line.indent:
            header, unhandled_try = open_blocks.pop()
            if (unhandled_try and header.indent == line.indent
                    and line.first_word in ("except", "finally")):
                unhandled_try = False
            if unhandled_try:
                return []  # a try that was left without handlers: not a prefix we can close
        if line.is_header:
            open_blocks.append((line, line.first_word == "try"))
    closers: list[str] = []
    for header, unhandled_try in reversed(open_blocks):
        if unhandled_try:
            closers.append(f"{header.indent_text}finally:\n{_body_indent(header)}pass\n")
    return closers


def _compiles(source: str) -> SyntaxError | None:
    try:
        compile(source, "<tail>", "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError and TabError are SyntaxErrors too
        return exc
    except (ValueError, OverflowError, MemoryError, RecursionError) as exc:
        return SyntaxError(str(exc))
    return None


def repair_tail(tail: str) -> str | None:
    """The longest runnable prefix of the open tail ``tail``, or None if nothing runnable remains.

    Runnable means: compiles, and does more than open blocks. Only whole lines are kept; block
    headers without a body get ``pass``, open ``try`` blocks get ``finally: pass``.
    """
    tail = tail.replace("\r\n", "\n")
    cut = tail.rfind("\n")
    if cut < 0:
        return None
    return _repair_complete_lines(tail[:cut])


@functools.lru_cache(maxsize=64)
def _repair_complete_lines(text: str) -> str | None:
    """:func:`repair_tail` for text made of complete lines (the final newline stripped).

    Cached: while a line streams in, every call sees the same complete lines.
    """
    lines = [line + "\n" for line in text.split("\n")]
    logical = _scan(lines)
    count = len(logical)
    while count > 0:
        kept = logical[:count]
        if not _does_something(kept, lines):
            return None
        last = kept[-1]
        if last.first_word == "@":  # a decorator still waiting for its def
            count -= 1
            continue
        source = "".join(lines[: last.end])
        if last.is_header:
            source += f"{_body_indent(last)}pass\n"
        source += "".join(_open_try_closers(kept))
        error = _compiles(source)
        if error is None:
            return source
        count -= 1
        bad_line = (error.lineno or 0) - 1  # skip every prefix that still contains the error
        if 0 <= bad_line < last.start:
            while count > 0 and logical[count - 1].end > bad_line:
                count -= 1
    return None
