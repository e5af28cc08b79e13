"""The trace's event types: one frozen dataclass per kind, in one registry (`EVENTS`).

An event is made with its fields, each checked against its annotation when it is made: an
unknown or missing field, or a value of the wrong type, raises `TypeError` at the emit site.
``docs/trace.md`` lists the same types (`event_table`; a test compares them, and
``python -m agentrt.events docs/trace.md`` rewrites that list).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

EVENTS: dict[str, type[EventData]] = {}
"""Every event type by its kind, in the order they are defined (filled once, at import)."""

_Check = Callable[[Any], bool]


class EventData:
    """What happened, without its time (`agentrt.trace.Event` adds it)."""

    kind: ClassVar[str]
    _names: ClassVar[tuple[str, ...]] = ()
    _checks: ClassVar[tuple[tuple[str, _Check, str], ...]] = ()

    def __post_init__(self) -> None:
        for name, check, annotation in self._checks:
            value = getattr(self, name)
            if not check(value):
                raise TypeError(f"event {self.kind!r}: field {name!r} must be {annotation}, "
                                f"got {value!r:.80} ({type(value).__name__})")

    def fields(self) -> dict[str, Any]:
        """The fields by name, in order (a saved trace's ``data``)."""
        return {name: getattr(self, name) for name in self._names}


E = TypeVar("E", bound=EventData)


def event(kind: str) -> Callable[[type[E]], type[E]]:
    """Register the decorated class as the event type of ``kind`` (a frozen dataclass whose
    fields are checked against their annotations)."""

    def register(cls: type[E]) -> type[E]:
        if kind in EVENTS:
            raise ValueError(f"event kind {kind!r} is registered twice")
        cls = dataclasses.dataclass(frozen=True)(cls)
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        cls.kind = kind
        cls._names = tuple(f.name for f in dataclasses.fields(cls))
        cls._checks = tuple((f.name, _checker(hints[f.name]), str(f.type))
                            for f in dataclasses.fields(cls))
        EVENTS[kind] = cls
        return cls

    return register


def _checker(hint: Any) -> _Check:
    """A predicate for values of the annotation ``hint`` (the forms event fields use)."""
    origin = typing.get_origin(hint)
    if hint is type(None) or hint is None:
        return lambda v: v is None
    if hint is Any:
        return lambda v: True
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin is Literal:
        allowed = typing.get_args(hint)
        return lambda v: v in allowed
    if origin in (types.UnionType, typing.Union):
        options = [_checker(h) for h in typing.get_args(hint)]
        return lambda v: any(check(v) for check in options)
    if origin is list:
        (item,) = typing.get_args(hint)
        check_item = _checker(item)
        return lambda v: isinstance(v, list) and all(check_item(x) for x in v)
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    raise TypeError(f"event fields cannot be annotated {hint!r}")


# -- the run ------------------------------------------------------------------------------------

@event("run_started")
class RunStarted(EventData):
    """The run began."""

    task: str


@event("run_finished")
class RunFinished(EventData):
    """The run ended (the last event of an agent run)."""

    status: str
    """final, max_turns, error, interrupted or cancelled."""
    answer: str
    """The answer's repr, cut at 200 characters."""


@event("run_error")
class RunError(EventData):
    """What stopped the run: where, the exception's type and message."""

    error: str


# -- turns and the response ---------------------------------------------------------------------

@event("turn_started")
class TurnStarted(EventData):
    """A model response begins (turns are numbered from 0)."""

    turn: int


@event("turn_finished")
class TurnFinished(EventData):
    """A turn ended: its blocks ran and its speculation settled."""

    turn: int
    finish_reason: str | None = None
    """The engine's (``final`` when a block gave the answer; None when the loop does not know)."""
    completion_tokens: int = 0


@event("delta")
class DeltaEvent(EventData):
    """Text the model streamed (one per engine delta)."""

    turn: int
    chars: int
    text: str


@event("block_opened")
class BlockOpenedEvent(EventData):
    """A code block's opening fence streamed (blocks are numbered from 0 in each turn)."""

    turn: int
    block: int


@event("statement_closed")
class StatementClosedEvent(EventData):
    """A top-level statement of the block is complete (``lineno``: its first line)."""

    turn: int
    block: int
    stmt: int
    lineno: int


@event("block_closed")
class BlockClosedEvent(EventData):
    """A code block's closing fence streamed (``unterminated``: the response ended first)."""

    turn: int
    block: int
    chars: int
    unterminated: bool


# -- the authoritative run ----------------------------------------------------------------------

@event("exec_started")
class ExecStarted(EventData):
    """The authoritative run starts executing a block."""

    turn: int
    block: int


@event("exec_finished")
class ExecFinished(EventData):
    """The block executed (``error``: its error, None when it ran clean; ``final``: it gave the
    answer)."""

    turn: int
    block: int
    error: str | None
    final: bool


@event("tool_started")
class ToolStarted(EventData):
    """A tool invocation starts: ``sync`` for the program's call, ``early`` for a speculative
    one (which has no turn, block or line of its own: see its ``spec_launch``)."""

    call_id: int
    """Numbered per mode: an early call's is its ``early_id``."""
    tool: str
    mode: Literal["sync", "early"]
    turn: int | None = None
    block: int | None = None
    lineno: int | None = None


@event("tool_finished")
class ToolFinished(EventData):
    """A tool invocation ended (``error``: what it raised)."""

    call_id: int
    tool: str
    mode: Literal["sync", "early"]
    error: str | None


@event("program_call")
class ProgramCall(EventData):
    """A call of the program, served (hit or miss), in program order: digests of its arguments
    and result, or its error."""

    tool: str
    args: str
    result: str | None
    error: str | None


# -- speculation --------------------------------------------------------------------------------

@event("spec_peek")
class SpecPeek(EventData):
    """A shadow started on the code so far (``spare``: it was the fork made ahead)."""

    turn: int
    lines: int
    spare: bool


@event("spec_launch")
class SpecLaunch(EventData):
    """An early call started (``deps``: the early calls its arguments came from; ``code_s``:
    when the code making it was complete; ``posted_s``: when its shadow got that code)."""

    early_id: int
    tool: str
    turn: int
    block: int
    lineno: int | None
    deps: list[int]
    code_s: float
    posted_s: float


@event("spec_claim")
class SpecClaim(EventData):
    """The program called a speculatable tool: ``early_id`` served it (a hit), or None (a miss)."""

    seq: int
    tool: str
    early_id: int | None


@event("spec_cancel")
class SpecCancel(EventData):
    """An unclaimed early call, counted once its block executed or its turn ended."""

    early_id: int
    reason: Literal["wasted", "retracted"]


@event("spec_effect")
class SpecEffect(EventData):
    """The program reached an effectful call: the epoch advances (stale readers cancelled)."""

    turn: int
    epoch: int


@event("spec_refused")
class SpecRefused(EventData):
    """A real tool call arrived from a shadow fork and was refused (never, unless the shadow's
    dispatcher was bypassed)."""

    tool: str


@event("spec_too_large")
class SpecTooLarge(EventData):
    """A launch refused for its arguments' size: past the per-launch cap, or past the run's
    total (once per call site and cap); the call runs when its statement executes."""

    tool: str
    turn: int
    block: int
    lineno: int | None
    arg_bytes: int | None
    """None: past the sandbox's own limits."""
    limit: int
    cap: Literal["launch", "run"]


@event("spec_shadow_error")
class SpecShadowError(EventData):
    """A shadow message that could not be handled (or too many): that shadow is killed."""

    error: str


# -- the list in docs/trace.md ------------------------------------------------------------------

TABLE_START = "<!-- event types: generated by `python -m agentrt.events docs/trace.md` -->"
TABLE_END = "<!-- end of event types -->"


def event_table() -> str:
    """The registered event types as the markdown table of ``docs/trace.md``."""
    rows = ["| kind | fields | what happened |", "|---|---|---|"]
    for kind, cls in EVENTS.items():
        fields = ", ".join(f"{f.name}: {f.type}" + ("" if f.default is dataclasses.MISSING
                                                    else f" = {f.default!r}")
                           for f in dataclasses.fields(cls))
        doc = " ".join((cls.__doc__ or "").split())
        rows.append(f"| `{kind}` | {fields.replace('|', '&#124;')} | {doc} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


def rewrite_docs(path: Path) -> bool:
    """Put `event_table` between the markers in ``path``; whether the file changed."""
    text = path.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    new = text[:start] + event_table() + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = rewrite_docs(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/trace.md"))
    print("updated" if changed else "up to date")
