"""Wire protocol between the runtime and its sandbox worker processes.

Every message is one *frame*: a 4-byte big-endian length followed by a pickled ``dict``
with a string ``"op"`` key. The two directions are trusted differently:

* runtime -> worker frames come from trusted code and are decoded with plain ``pickle``;
* worker -> runtime frames are **untrusted** (the worker runs model-written code) and are
  decoded by :func:`decode_untrusted`, whose unpickler refuses every class lookup, so only
  plain data (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset) can
  arrive. Frames longer than :data:`MAX_FRAME_BYTES` are refused before they are read.

Each worker process has its own connection. It opens it with ``hello`` and then serves the
commands the runtime sends on that connection.

Runtime -> worker (``id`` is a request id; the answer is a ``reply`` with the same id):

==================  ====================================================================
``init``            ``limits`` (dict), ``tools`` (list of ``(name, signature)``): sent once
                    to the root process after its hello.
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
``tool_error``      ``call``, ``type`` (a name from :data:`SAFE_EXCEPTION_NAMES` or None),
                    ``original_type``, ``message``: a tool call failed.
==================  ====================================================================

Worker -> runtime:

==================  ====================================================================
``hello``           ``pid``, ``role`` (root / holder / cell / fork), ``token``.
``forked``          ``token``, ``pid``: sent by a parent right after it forked a child.
``reply``           ``id``, ``ok``; then ``value``, or ``error_type`` and ``message``.
                    A cell's reply value is ``{stdout, error, error_type, final}``.
``call``            ``call`` (id), ``name``, ``args`` (tuple), ``kwargs`` (dict): a tool call.
``child_exit``      ``pid``, ``code`` (int or None), ``signal`` (int or None): a child of
                    the sender was reaped.
==================  ====================================================================
"""

from __future__ import annotations

import builtins
import io
import pickle
import socket
import struct
from typing import Any

TOKEN_ENV = "AGENTRT_REPL_TOKEN"
"""Environment variable carrying the root worker's hello token."""

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest frame the runtime accepts from a worker (64 MiB)."""

HEADER = struct.Struct(">I")
PICKLE_PROTOCOL = 5
MAX_PLAIN_DEPTH = 100

SAFE_EXCEPTION_NAMES = frozenset({
    "ArithmeticError", "AssertionError", "AttributeError", "ConnectionError", "EOFError",
    "FileExistsError", "FileNotFoundError", "IndexError", "KeyError", "LookupError",
    "NotImplementedError", "OverflowError", "PermissionError", "RuntimeError",
    "TimeoutError", "TypeError", "UnicodeError", "ValueError", "ZeroDivisionError",
})
"""Builtin exception types a failing tool call is re-raised as inside the sandbox."""

_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)


class ProtocolError(Exception):
    """A frame broke the protocol (too large, undecodable, or not a message)."""


class FrameTooLargeError(ProtocolError):
    """An encoded message exceeds :data:`MAX_FRAME_BYTES`."""


class NotPlainDataError(TypeError):
    """A value cannot be converted to plain data."""


def to_plain(value: Any, *, max_depth: int = MAX_PLAIN_DEPTH) -> Any:
    """Return a copy of ``value`` made only of plain builtin data.

    Subclasses of plain types (``OrderedDict``, ``defaultdict``, named tuples, ``IntEnum``
    ...) become their base type, read through the base type's own methods so that no
    overridden method runs. Anything else raises :class:`NotPlainDataError`.
    """
    return _to_plain(value, max_depth)


def _to_plain(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return value
    if depth <= 0:
        raise NotPlainDataError("value is nested too deeply (or contains itself)")
    if kind is list or kind is tuple:
        items = [_to_plain(item, depth - 1) for item in value]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {_to_plain(k, depth - 1): _to_plain(v, depth - 1) for k, v in value.items()}
    if kind is set or kind is frozenset:
        items = [_to_plain(item, depth - 1) for item in value]
        return set(items) if kind is set else frozenset(items)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return bytes(memoryview(value))
    if isinstance(value, dict):
        return {_to_plain(k, depth - 1): _to_plain(v, depth - 1) for k, v in dict.items(value)}
    if isinstance(value, (list, tuple)):
        base = list if isinstance(value, list) else tuple
        items = [_to_plain(item, depth - 1) for item in base.__iter__(value)]
        return items if base is list else tuple(items)
    if isinstance(value, (set, frozenset)):
        base = set if isinstance(value, set) else frozenset
        return base(_to_plain(item, depth - 1) for item in base.__iter__(value))
    raise NotPlainDataError(
        f"{kind.__name__} is not plain data (use None, bool, int, float, str, bytes, "
        "list, tuple, dict, set or frozenset)")


def encode_frame(message: dict[str, Any], *, limit: int | None = MAX_FRAME_BYTES) -> bytes:
    """Pickle ``message`` and prefix its length; raise FrameTooLargeError past ``limit``."""
    payload = pickle.dumps(message, protocol=PICKLE_PROTOCOL)
    if limit is not None and len(payload) > limit:
        raise FrameTooLargeError(
            f"message of {len(payload)} bytes exceeds the {limit} byte frame limit")
    if len(payload) > 0xFFFFFFFF:
        raise FrameTooLargeError(f"message of {len(payload)} bytes cannot be framed")
    return HEADER.pack(len(payload)) + payload


def decode_trusted(payload: bytes) -> dict[str, Any]:
    """Decode a frame sent by the runtime (trusted direction)."""
    return pickle.loads(payload)


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that can build plain data only: every class lookup is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data may cross")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def decode_untrusted(payload: bytes) -> dict[str, Any]:
    """Decode a frame sent by a worker: plain data only, and it must be a message dict."""
    try:
        message = _PlainUnpickler(io.BytesIO(payload)).load()
    except Exception as exc:  # any malformed pickle is a protocol error
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if type(message) is not dict or type(message.get("op")) is not str:
        raise ProtocolError("a frame must hold a dict with a string 'op'")
    return message


def safe_exception_class(name: object) -> type[BaseException] | None:
    """The builtin exception class called ``name`` if it is in the safe set, else None."""
    if isinstance(name, str) and name in SAFE_EXCEPTION_NAMES:
        return getattr(builtins, name)
    return None


def wire_exception_type(exc: BaseException) -> str | None:
    """The closest safe builtin type of ``exc`` (walking its MRO), or None."""
    for cls in type(exc).__mro__:
        if cls.__name__ in SAFE_EXCEPTION_NAMES and getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return None


class FramedSocket:
    """A blocking, framed connection (worker side)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(cls, path: str) -> "FramedSocket":
        """Connect to the runtime's Unix socket at ``path``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return cls(sock)

    def fileno(self) -> int:
        """The socket's file descriptor (for ``select``)."""
        return self._sock.fileno()

    def send(self, message: dict[str, Any]) -> None:
        """Send one message; raise FrameTooLargeError (nothing sent) if it is too big."""
        self._sock.sendall(encode_frame(message))

    def recv(self) -> dict[str, Any]:
        """Receive one message from the runtime; raise EOFError when the runtime is gone."""
        (length,) = HEADER.unpack(self._recv_exactly(HEADER.size))
        return decode_trusted(self._recv_exactly(length))

    def close(self) -> None:
        """Close this process's descriptor (the peer keeps its own)."""
        self._sock.close()

    def _recv_exactly(self, size: int) -> bytes:
        buffer = bytearray(size)
        view = memoryview(buffer)
        received = 0
        while received < size:
            count = self._sock.recv_into(view[received:], size - received)
            if count == 0:
                raise EOFError("the runtime closed the connection")
            received += count
        return bytes(buffer)
