"""The messages between the runtime (the host) and its sandbox worker processes.

This module owns every op name of the protocol: both sides use these constants, never string
literals. Each message a worker may send is a frozen dataclass below; the worker builds one and
sends :meth:`WorkerFrame.to_message`, and the host turns every decoded frame back into one with
:func:`parse_worker_frame`, which checks each field's type before anything reads it. A frame that
does not fit (unknown op, missing or extra field, wrong type) raises
:class:`~.protocol.ProtocolError`: the host ends that worker's session, counts and logs it, and
the run goes on. Framing (length prefix, pickle, plain data only) is :mod:`.protocol`'s job.

Host -> worker frames come from trusted code; they are dicts with these ops (``id`` is a request
id, answered by a ``reply`` with the same id):

==================  ====================================================================
``init``            ``limits`` (dict), ``tools`` (list of ``(name, signature)``), ``jail``
                    (lock-down settings or None): once, to the root process after its hello.
``spawn``           ``id``, ``token``: root only; fork a namespace holder with an empty
                    namespace that connects with ``token``.
``exec``            ``id``, ``code``, ``name``, ``fork`` (bool), ``token`` (when forking),
                    ``cpu_s``: run a cell. With ``fork`` the holder forks a child that
                    connects with ``token``, runs the cell, sends the ``reply`` and becomes
                    the holder; without it the cell runs in place.
``fork``            ``id``, ``token``: fork a copy of this namespace that connects with
                    ``token``; the reply value is the child's pid.
``set_var``         ``id``, ``name``, ``value``: bind a variable (plain data).
``get_var``         ``id``, ``name``: reply with the variable's value as plain data.
``summary``         ``id``: reply with ``{name: [type name, short repr]}``.
``set_proxy``       ``id``, ``factory`` (``"package.module:function"``): rebuild the tool
                    proxies with another proxy factory.
``extend``          ``id``, ``hook`` (``"package.module:function"``): call
                    ``hook(sandbox, channel)`` in the process.
``exit``            no reply; the process exits at once.
``tool_result``     ``call``, ``value``: the outcome of a tool call.
``tool_error``      ``call``, ``type`` (a name from ``SAFE_EXCEPTION_NAMES`` or None),
                    ``original_type``, ``message``: a tool call failed.
``shadow``          ``statements`` (``[block, first line, source]`` each), ``speculatable``
                    (tool names), ``cpu_s``, ``force_timeout``: become a shadow run
                    (shadow_worker.py); no reply.
``early_result``    ``call``, ``value``: the result of a call the shadow launched.
``early_fail``      ``call``, ``message``: that call raised.
``early_poison``    ``call``, ``message``: that call was not launched or was cancelled.
==================  ====================================================================

Worker -> host frames (untrusted) are the dataclasses :class:`Hello`, :class:`Forked`,
:class:`Reply`, :class:`ToolCall`, :class:`ChildExit`, and, from shadow forks only,
:class:`Launch` and :class:`ShadowDone`. The host adds :class:`RefusedCall` notices to the
stream of shadow messages (repl/messages.py); no worker sends one.
"""

from __future__ import annotations

import dataclasses
import types
import typing
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
SET_PROXY = "set_proxy"
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

ROLES = frozenset({"root", "holder", "cell", "fork"})
"""What a process says it is in its hello (the host checks it against what it started)."""


class WorkerFrame:
    """Base of the frames a worker sends (each subclass is a frozen dataclass with an ``op``)."""

    op: ClassVar[str]

    def to_message(self) -> dict[str, Any]:
        """The plain-data dict that goes on the wire."""
        message = {"op": self.op}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            message[field.name] = getattr(self, field.name)
        return message


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
    """The answer to request ``id``: ``value`` when ``ok``, else ``error_type`` and ``message``.
    A cell's reply value is ``{stdout, error, error_type, final}``."""

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
    ``stopped`` says why it stopped early, if it did)."""

    op: ClassVar[str] = SHADOW_DONE
    executed: int
    abandoned: int
    pending: int
    stopped: str | None = None


@dataclasses.dataclass(frozen=True)
class RefusedCall(WorkerFrame):
    """Made by the host: a shadow fork tried a real tool call to ``name`` and was refused."""

    op: ClassVar[str] = REFUSED_CALL
    name: str


ShadowMessage = Union[Launch, ShadowDone, RefusedCall]
"""What the REPL's message stream carries (with the sending session's token)."""

_WORKER_FRAMES: dict[str, type[WorkerFrame]] = {
    cls.op: cls for cls in (Hello, Forked, Reply, ToolCall, ChildExit, Launch, ShadowDone)}
SHADOW_OPS = frozenset({LAUNCH, SHADOW_DONE})
"""Ops only a shadow fork may send."""


def parse_worker_frame(message: dict[str, Any]) -> WorkerFrame:
    """The typed frame for a decoded worker message; ProtocolError if it does not fit."""
    op = message.get("op")
    cls = _WORKER_FRAMES.get(op) if type(op) is str else None
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}")
    hints = _hints(cls)
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


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


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


__all__ = [
    "CALL", "CHILD_EXIT", "EARLY_FAIL", "EARLY_POISON", "EARLY_RESULT", "EXEC", "EXIT", "EXTEND",
    "FORK", "FORKED", "GET_VAR", "HELLO", "INIT", "LAUNCH", "REFUSED_CALL", "REPLY", "ROLES",
    "SET_PROXY", "SET_VAR", "SHADOW", "SHADOW_DONE", "SHADOW_OPS", "SPAWN", "SUMMARY",
    "TOOL_ERROR", "TOOL_RESULT", "ChildExit", "Forked", "Hello", "Launch", "RefusedCall", "Reply",
    "ShadowDone", "ShadowMessage", "ToolCall", "WorkerFrame", "parse_worker_frame",
]
