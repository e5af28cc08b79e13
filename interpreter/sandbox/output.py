"""The running cell: its capped output, and the context the sandbox's helpers share.

Each `Sandbox` has one :class:`SandboxContext`, handed to the builtins and module facades it
builds (nothing is reached through module globals): the namespace (``dir()`` without
arguments), its provenance (what it made, by identity: provenance.py), admission (what a cell
may hold: admission.py) and guards (guards.py),
the module facades built so far, and the :class:`OutputBuffer` of the cell now running, which
``print``, ``pprint.pprint``, ``typing.reveal_type``, ``SHOW_VARS`` and ``help`` write to
(between cells, and in a shadow run, there is none and writes are dropped).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .admission import Admission
from .guards import Guards
from .provenance import Provenance


class OutputBuffer:
    """Collects printed text up to ``max_chars`` and counts what it dropped."""

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._parts: list[str] = []
        self._size = 0
        self._dropped = 0

    def write(self, text: str) -> None:
        """Append ``text``, keeping at most ``max_chars`` characters in total."""
        room = self._max_chars - self._size
        if len(text) <= room:
            self._parts.append(text)
            self._size += len(text)
            return
        if room > 0:
            self._parts.append(text[:room])
            self._size += room
        self._dropped += len(text) - max(room, 0)

    def text(self) -> str:
        """Everything kept so far (without the truncation note)."""
        return "".join(self._parts)

    def getvalue(self) -> str:
        """Everything kept, plus a note on how much was dropped."""
        text = self.text()
        if self._dropped:
            text += f"\n[output truncated: {self._dropped} more characters]"
        return text


class SandboxContext:
    """What one sandbox's builtins and module facades share (see the module docstring)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self.output: OutputBuffer | None = None
        """The output of the cell now running (None between cells)."""
        self.provenance = Provenance(namespace)
        """What the sandbox made: classes, functions and their instances, by identity."""
        self.admission = Admission(self.provenance)
        """What a cell may hold (admission.py)."""
        self.guards = Guards(self.provenance, self.admission)
        """The guards of this sandbox."""
        self.facades: dict[str, Any] = {}
        """Module facades built so far, by module name (see modules.py)."""

    @contextmanager
    def running(self, output: OutputBuffer) -> Iterator[OutputBuffer]:
        """While the block runs, a cell runs and prints to ``output``."""
        self.output = output
        try:
            yield output
        finally:
            self.output = None

    def write(self, text: str) -> None:
        """Write to the running cell's output (dropped between cells)."""
        if self.output is not None:
            self.output.write(text)


class Printer:
    """Target of RestrictedPython's print rewriting (``print(...)`` -> ``_print._call_print``)."""

    __slots__ = ("_context",)

    def __init__(self, context: SandboxContext) -> None:
        self._context = context

    def _call_print(self, *objects: Any, sep: str | None = " ", end: str | None = "\n",
                    file: Any = None, flush: bool = False) -> None:
        if sep is not None and not isinstance(sep, str):
            raise TypeError(f"sep must be None or a string, not {type(sep).__name__}")
        if end is not None and not isinstance(end, str):
            raise TypeError(f"end must be None or a string, not {type(end).__name__}")
        if file is not None:
            builtins.print(*objects, sep=sep, end=end, file=file)
            return
        write = self._context.write
        sep = " " if sep is None else sep
        for index, obj in enumerate(objects):
            if index:
                write(sep)
            write(obj if type(obj) is str else str(obj))
        write("\n" if end is None else end)

    def __call__(self) -> str:  # the ``printed`` name
        output = self._context.output
        return output.text() if output is not None else ""
