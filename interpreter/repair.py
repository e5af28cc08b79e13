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

The interpreter's statement scanner (statements.py, the segmenter's) finds where logical lines
end; ``compile()`` is then tried on those prefixes, longest first, so the common case costs a
single compilation. :class:`TailRepair` remembers its last answer, so the calls made while one
line streams in cost almost nothing.
"""

from __future__ import annotations

from .statements import LogicalLine, logical_lines

__all__ = ["TailRepair", "repair_tail"]


def _body_indent(header: LogicalLine) -> str:
    return header.indent + ("\t" if "\t" in header.indent else "    ")


def _does_something(logical: list[LogicalLine], lines: list[str]) -> bool:
    """True if some line is more than a block header, a decorator or ``pass``."""
    for line in logical:
        if line.is_header or line.head == "@":
            continue
        if line.end - line.start == 1 and lines[line.start].strip() == "pass":
            continue
        return True
    return False


def _open_try_closers(logical: list[LogicalLine]) -> list[str]:
    """``finally: pass`` lines closing every ``try`` still waiting for its handlers."""
    open_blocks: list[tuple[LogicalLine, bool]] = []  # (header, is an unhandled try)
    for line in logical:
        while open_blocks and open_blocks[-1][0].width >= line.width:
            header, unhandled_try = open_blocks.pop()
            if (unhandled_try and header.width == line.width
                    and line.head in ("except", "finally")):
                unhandled_try = False
            if unhandled_try:
                return []  # a try that was left without handlers: not a prefix we can close
        if line.is_header:
            open_blocks.append((line, line.head == "try"))
    closers: list[str] = []
    for header, unhandled_try in reversed(open_blocks):
        if unhandled_try:
            closers.append(f"{header.indent}finally:\n{_body_indent(header)}pass\n")
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


class TailRepair:
    """:func:`repair_tail` that remembers its last answer: while a line streams in, every call
    sees the same complete lines."""

    def __init__(self) -> None:
        self._last: tuple[str, str | None] = ("", None)

    def __call__(self, tail: str) -> str | None:
        tail = tail.replace("\r\n", "\n")
        complete = tail[:tail.rfind("\n") + 1]
        if complete != self._last[0]:
            self._last = (complete, repair_tail(complete))
        return self._last[1]


def _repair_complete_lines(text: str) -> str | None:
    """:func:`repair_tail` for text made of complete lines (the final newline stripped)."""
    lines = [line + "\n" for line in text.split("\n")]
    logical = logical_lines(lines)
    count = len(logical)
    while count > 0:
        kept = logical[:count]
        if not _does_something(kept, lines):
            return None
        last = kept[-1]
        if last.head == "@":  # a decorator still waiting for its def
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
