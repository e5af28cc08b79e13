"""Every message between the runtime (the host) and its sandbox worker processes, typed.

This module owns every op name of the protocol and every frame: each is a frozen dataclass
below with its ``op``, built by the side that sends it and sent as
:meth:`Frame.to_message`; the receiving side turns each decoded frame back into its dataclass
(:func:`parse_host_frame` in a worker, :func:`parse_worker_frame` in the host) before anything
reads it, so both sides use the same classes and no op name is written anywhere else. The shadow
interpreter's messages are frames like the others: the host asks a fork to become a shadow
(:class:`Shadow`) and answers its launches (:class:`EarlyResult`, :class:`EarlyFailed`,
:class:`EarlyPoisoned`); the shadow sends :class:`Launch` and :class:`ShadowDone`; the host adds
:class:`RefusedCall` notices to the stream of shadow messages (repl/messages.py).

The table of all frames, with who sends them, is in :mod:`.protocol` (which owns the framing:
length prefix, pickle, plain data only). Host -> worker frames come from trusted code: a worker
that gets one it cannot parse answers the request with an error, or, for a frame that is no
request, stops loudly (its log says why). Worker -> host frames are untrusted:
:func:`parse_worker_frame` checks each field's type, and a frame that does not fit (unknown op,
missing or extra field, wrong type) raises :class:`~.protocol.ProtocolError`; the host then ends
that worker's session, counts and logs it, and the run goes on.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from types import MappingProxyType
from typing import Any, ClassVar, Union

from .protocol import ProtocolError

# -- op names: host -> worker ------------------------------------------------------------------
INIT = "init"
SPAWN = "spawn"
EXEC = "exec"
FORK = "fork"
SET_VAR = "set_var"
GET_VAR = "get_var"
SUMMARY = "summary"
EXTEND = "extend"
EXIT = "exit"
TOOL_RESULT = "tool_result"
TOOL_ERROR = "tool_error"
SHADOW = "shadow"
EARLY_RESULT = "early_result"
EARLY_FAIL = "early_fail"
EARLY_POISON = "early_poison"

# -- op names: worker -> host ------------------------------------------------------------------
HELLO = "hello"
FORKED = "forked"
REPLY = "reply"
CALL = "call"
CHILD_EXIT = "child_exit"
LAUNCH = "launch"
SHADOW_DONE = "shadow_done"

# -- made by the host for the shadow-message stream --------------------------------------------
REFUSED_CALL = "refused_call"

EXIT_PROTOCOL = 71
"""Exit status of a worker process that got a frame from the runtime it could not handle."""

ROLES = frozenset({"root", "holder", "cell", "fork"})
"""What a process says it is in its hello (the host checks it against what it started)."""


class Frame:
    """Base of every frame (each subclass is a frozen dataclass with an ``op``)."""

    op: ClassVar[str]

    def to_message(self) -> dict[str, Any]:
        """The plain-data dict that goes on the wire."""
        message = {"op": self.op}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            message[field.name] = getattr(self, field.name)
        return message


class HostFrame(Frame):
    """A frame the host sends to a worker (trusted)."""


class Request(HostFrame):
    """A host frame answered by a :class:`Reply` with the same ``id`` (the host numbers its
    requests as it sends them: build one with ``id`` left at 0)."""

    id: int


class WorkerFrame(Frame):
    """A frame a worker sends to the host (untrusted: parsed by :func:`parse_worker_frame`)."""


# -- host -> worker ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Init(HostFrame):
    """Once, to the root process after its hello: ``limits`` (``memory_mb``,
    ``max_output_chars``, ``recursion_limit``), ``tools`` (``(name, signature)`` each) and the
    ``jail`` lock-down settings (``seccomp``, ``disk_mb``, ``bound_pids``; None: no jail)."""

    op: ClassVar[str] = INIT
    limits: dict[str, int]
    tools: tuple[tuple[str, str], ...]
    jail: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Spawn(Request):
    """Root only: fork a namespace holder with an empty namespace that connects with
    ``token``; the reply value is its pid."""

    op: ClassVar[str] = SPAWN
    token: str
    id: int = 0


@dataclasses.dataclass(frozen=True)
class Exec(Request):
    """Run cell ``code`` (called ``name`` in tracebacks) with ``cpu_s`` seconds of CPU. With
    ``fork`` the holder forks a child that connects with ``token``, runs the cell, sends the
    reply and becomes the holder; without it the cell runs in place. The reply value is
    ``{stdout, error, error_type, final}``."""

    op: ClassVar[str] = EXEC
    code: str
    name: str
    fork: bool
    cpu_s: float
    token: str | None = None
    id: int = 0


@dataclasses.dataclass(frozen=True)
class Fork(Request):
    """Fork a copy of this namespace that connects with ``token``; the reply value is the
    child's pid."""

    op: ClassVar[str] = FORK
    token: str
    id: int = 0


@dataclasses.dataclass(frozen=True)
class SetVar(Request):
    """Bind variable ``name`` to ``value`` (plain data)."""

    op: ClassVar[str] = SET_VAR
    name: str
    value: Any
    id: int = 0


@dataclasses.dataclass(frozen=True)
class GetVar(Request):
    """Reply with the value of variable ``name`` as plain data."""

    op: ClassVar[str] = GET_VAR
    name: str
    id: int = 0


@dataclasses.dataclass(frozen=True)
class Summary(Request):
    """Reply with ``{name: [type name, short repr]}`` for every variable."""

    op: ClassVar[str] = SUMMARY
    id: int = 0


@dataclasses.dataclass(frozen=True)
class Extend(Request):
    """Call ``hook(sandbox, channel)`` in the process (``hook`` is
    ``"package.module:function"``); later forks inherit what it did."""

    op: ClassVar[str] = EXTEND
    hook: str
    id: int = 0


@dataclasses.dataclass(frozen=True)
class Exit(HostFrame):
    """Exit at once (no reply)."""

    op: ClassVar[str] = EXIT


@dataclasses.dataclass(frozen=True)
class ToolResult(HostFrame):
    """The value tool call ``call`` returned."""

    op: ClassVar[str] = TOOL_RESULT
    call: int
    value: Any


@dataclasses.dataclass(frozen=True)
class ToolFailed(HostFrame):
    """Tool call ``call`` raised: re-raised in the sandbox as the builtin exception ``type``
    (a name from ``SAFE_EXCEPTION_NAMES``), else as ``ToolError("original_type: message")``."""

    op: ClassVar[str] = TOOL_ERROR
    call: int
    type: str | None
    original_type: str
    message: str


@dataclasses.dataclass(frozen=True)
class Shadow(HostFrame):
    """Become a shadow run (shadow_worker.py) of ``statements`` (``(block, first line,
    source)`` each, in order), launching only the ``speculatable`` tools, with ``cpu_s``
    seconds of CPU; no reply. ``reads`` gives the effect scopes of the speculatable tools that
    declare them (``(tool, scopes)``; a pure tool's are empty) and ``writes`` those of the
    effectful tools that declare them; a tool not listed reads or writes every scope
    (``agentrt.tools.scopes``)."""

    op: ClassVar[str] = SHADOW
    statements: tuple[tuple[int, int, str], ...]
    speculatable: tuple[str, ...]
    cpu_s: float
    reads: tuple[tuple[str, tuple[str, ...]], ...] = ()
    writes: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class EarlyResult(HostFrame):
    """The result of the call the shadow launched as ``call``."""

    op: ClassVar[str] = EARLY_RESULT
    call: int
    value: Any


@dataclasses.dataclass(frozen=True)
class EarlyFailed(HostFrame):
    """The call the shadow launched as ``call`` raised (``message`` says what)."""

    op: ClassVar[str] = EARLY_FAIL
    call: int
    message: str


@dataclasses.dataclass(frozen=True)
class EarlyPoisoned(HostFrame):
    """The call the shadow launched as ``call`` was not launched, or was cancelled."""

    op: ClassVar[str] = EARLY_POISON
    call: int
    message: str


# -- worker -> host ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hello(WorkerFrame):
    """First frame of every connection: ``token`` authenticates the process the host started,
    ``pid`` is its pid in its own PID namespace, ``role`` one of :data:`ROLES`."""

    op: ClassVar[str] = HELLO
    pid: int
    role: str
    token: str

    def __post_init__(self) -> None:
        if self.pid <= 0 or self.role not in ROLES or not 0 < len(self.token) <= 128:
            raise ProtocolError("hello: bad pid, role or token")


@dataclasses.dataclass(frozen=True)
class Forked(WorkerFrame):
    """Sent by a parent right after it forked the child that will connect with ``token``;
    ``pid`` is the child's pid in the parent's PID namespace."""

    op: ClassVar[str] = FORKED
    token: str
    pid: int


@dataclasses.dataclass(frozen=True)
class Reply(WorkerFrame):
    """The answer to request ``id``: ``value`` when ``ok``, else ``error_type`` and ``message``."""

    op: ClassVar[str] = REPLY
    id: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class ToolCall(WorkerFrame):
    """A tool call: ``call`` is the caller's id for it, ``line`` the cell line that made it."""

    op: ClassVar[str] = CALL
    call: int
    name: str
    args: tuple
    kwargs: dict[str, Any]
    line: int | None = None


@dataclasses.dataclass(frozen=True)
class ChildExit(WorkerFrame):
    """The sender reaped child ``pid`` (its own PID namespace). The host uses it only to name
    the cause of a death it has observed itself."""

    op: ClassVar[str] = CHILD_EXIT
    pid: int
    code: int | None
    signal: int | None


@dataclasses.dataclass(frozen=True)
class Launch(WorkerFrame):
    """From a shadow fork: launch speculatable tool ``name`` early. ``call`` is the shadow's
    id for it, ``lineno`` the line of the shadow's code, ``deps`` the ids of the launches whose
    results the arguments came from."""

    op: ClassVar[str] = LAUNCH
    call: int
    name: str
    args: tuple
    kwargs: dict[str, Any]
    lineno: int | None = None
    deps: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ShadowDone(WorkerFrame):
    """From a shadow fork: it ran all its code (``pending`` launches still wait for inputs;
    ``effects``: effectful calls it passed without running them)."""

    op: ClassVar[str] = SHADOW_DONE
    executed: int
    abandoned: int
    pending: int
    effects: int = 0


# -- made by the host ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RefusedCall(Frame):
    """A shadow fork tried a real tool call to ``name`` and was refused (never on the wire:
    the host puts it on the stream of shadow messages)."""

    op: ClassVar[str] = REFUSED_CALL
    name: str


ShadowMessage = Union[Launch, ShadowDone, RefusedCall]
"""What the REPL's message stream carries (with the sending session's token)."""

HOST_FRAMES: MappingProxyType[str, type[HostFrame]] = MappingProxyType({
    cls.op: cls for cls in (Init, Spawn, Exec, Fork, SetVar, GetVar, Summary, Extend, Exit,
                            ToolResult, ToolFailed, Shadow, EarlyResult, EarlyFailed,
                            EarlyPoisoned)})
"""Every host -> worker frame, by op."""
WORKER_FRAMES: MappingProxyType[str, type[WorkerFrame]] = MappingProxyType({
    cls.op: cls for cls in (Hello, Forked, Reply, ToolCall, ChildExit, Launch, ShadowDone)})
"""Every worker -> host frame, by op."""
SHADOW_FRAMES = (Launch, ShadowDone)
"""Frames only a shadow fork may send."""


def parse_host_frame(message: dict[str, Any]) -> HostFrame:
    """The typed frame for a message from the host; ProtocolError if it is none (the host is
    trusted, so its fields are not checked one by one)."""
    op = message.get("op")
    cls = HOST_FRAMES.get(op) if type(op) is str else None
    if cls is None:
        raise ProtocolError(f"unknown op {op!r} from the runtime")
    try:
        return cls(**{key: value for key, value in message.items() if key != "op"})
    except TypeError as exc:
        raise ProtocolError(f"{op}: {exc}") from None


def parse_worker_frame(message: dict[str, Any]) -> WorkerFrame:
    """The typed frame for a decoded worker message; ProtocolError if it does not fit."""
    op = message.get("op")
    cls = WORKER_FRAMES.get(op) if type(op) is str else None
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}")
    hints = _FIELD_TYPES[cls]
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in message:
            value = message[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:
            raise ProtocolError(f"{op}: missing field {field.name!r}")
        values[field.name] = _checked(value, hints[field.name], f"{op}.{field.name}")
    extra = set(message) - set(values) - {"op"}
    if extra:
        raise ProtocolError(f"{op}: unexpected fields {sorted(map(str, extra))}")
    try:
        return cls(**values)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"{op}: {exc}") from None


_FIELD_TYPES: MappingProxyType[type, dict[str, Any]] = MappingProxyType(
    {cls: typing.get_type_hints(cls) for cls in WORKER_FRAMES.values()})


def _checked(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it has type ``hint`` (lists become tuples where a tuple is declared)."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _checked(value, inner, where)
    if hint is int and type(value) is int or hint is bool and type(value) is bool \
            or hint is str and type(value) is str:
        return value
    if (hint is tuple or origin is tuple) and type(value) in (list, tuple):
        if args and args[-1] is Ellipsis:
            return tuple(_checked(item, args[0], where) for item in value)
        return tuple(value)
    if origin is dict and type(value) is dict and all(type(key) is str for key in value):
        return value
    raise ProtocolError(f"{where}: expected {_name(hint)}, got {type(value).__name__}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
