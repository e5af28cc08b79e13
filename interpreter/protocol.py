"""Framing of the protocol between the runtime and its sandbox worker processes.

Every message is one *frame*: a 4-byte big-endian length followed by a pickled ``dict`` with a
string ``"op"`` key. Each frame is a frozen dataclass of :mod:`.frames`, which owns every op
name; both sides build and read frames only through those classes. All of them:

================  =================  ==============================================================
op                frame              from, to: meaning
================  =================  ==============================================================
``init``          ``Init``           host, root: limits, tools and jail settings, once after hello
``spawn``         ``Spawn``          host, root: fork an empty namespace holder (reply: its pid)
``exec``          ``Exec``           host, holder or fork: run a cell, in place or fork-per-cell
``fork``          ``Fork``           host, holder or fork: fork a copy of the namespace (reply: its
                                     pid)
``set_var``       ``SetVar``         host, holder or fork: bind a variable (plain data)
``get_var``       ``GetVar``         host, holder or fork: reply with a variable's value
``summary``       ``Summary``        host, holder or fork: reply with each variable's type and repr
``extend``        ``Extend``         host, holder or fork: call ``hook(sandbox, channel)``
``exit``          ``Exit``           host, any process: exit at once (no reply)
``tool_result``   ``ToolResult``     host, caller: what a tool call returned
``tool_error``    ``ToolFailed``     host, caller: what a tool call raised
``shadow``        ``Shadow``         host, fork: become a shadow run of these statements (no reply)
``early_result``  ``EarlyResult``    host, shadow: the result of a launched call
``early_fail``    ``EarlyFailed``    host, shadow: a launched call raised
``early_poison``  ``EarlyPoisoned``  host, shadow: a launch was refused, or its call cancelled
``hello``         ``Hello``          any process, host: the first frame of every connection
``forked``        ``Forked``         parent, host: it forked the child that will connect with a
                                     token
``reply``         ``Reply``          any process, host: the answer to a request, by id
``call``          ``ToolCall``       cell or fork, host: call a tool (answered by ``tool_result``
                                     or ``tool_error``)
``child_exit``    ``ChildExit``      parent or root, host: it reaped a child (names the cause only)
``launch``        ``Launch``         shadow, host: start a speculatable call early
``shadow_done``   ``ShadowDone``     shadow, host: it ran all its statements
``refused_call``  ``RefusedCall``    host, its own shadow-message stream (never on the wire): a
                                     shadow's tool call was refused
================  =================  ==============================================================

The two directions are trusted differently:

* runtime -> worker frames come from trusted code and are decoded with plain ``pickle``. They
  are written without copying their large values (:func:`encode_trusted`): a ``str`` or
  ``bytes`` of at least :data:`OUT_OF_BAND_BYTES` leaves the pickle (a persistent id in its
  place, the same one for each reference to it) and follows it, in order, as chunks of at most
  :data:`CHUNK_BYTES` (each a 4-byte length and its bytes, UTF-8 with ``surrogatepass`` for a
  ``str``; a zero length ends it), so the runtime holds one chunk of it at a time, never a
  serialised copy of the whole value. A frame without such values is the plain frame;
* worker -> runtime frames are **untrusted** (the worker runs model-written code). Frames longer
  than :data:`MAX_FRAME_BYTES` are refused before they are read. :func:`decode_untrusted` first
  checks the pickle's opcodes (:func:`check_untrusted_pickle`: only the opcodes that build plain
  data, memo references only to earlier objects, and a bound on the memory the decoded data
  will take), then unpickles with a ``find_class`` that refuses everything, so only plain data
  (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset) arrives.
  :func:`plain_size` measures decoded data with shared references counted each time they
  appear, in time proportional to the distinct objects, so the host can bound what a frame
  expands to before anything copies, hashes or prints it.

Each worker process has its own connection; it opens it with ``hello`` and then serves the
frames the runtime sends on that connection.
"""

from __future__ import annotations

import builtins
import io
import pickle
import re
import socket
import struct
from collections.abc import Iterator
from itertools import chain
from typing import Any

from agentrt.errors import AgentrtError

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame the runtime accepts from a worker (16 MiB)."""
MAX_DECODED_BYTES = 48 * 1024 * 1024
"""Most memory one worker frame may take once decoded (estimated from its opcodes first)."""

HEADER = struct.Struct(">I")
PICKLE_PROTOCOL = 5
MAX_PLAIN_DEPTH = 100
MAX_VALUE_BYTES = 4 * MAX_FRAME_BYTES
"""Largest value a worker may return (its :func:`plain_size`, shared references expanded)."""
MAX_VALUE_DEPTH = MAX_PLAIN_DEPTH + 4
"""How deeply a returned value may nest (a cell's result wraps its FINAL value twice)."""
OUT_OF_BAND_BYTES = 1 << 20
"""A ``str`` or ``bytes`` at least this long travels after a runtime -> worker frame's pickle."""
CHUNK_BYTES = 1 << 20
"""Characters (``str``) or bytes of such a value per chunk."""
SMALL_FRAME_BYTES = 64 * 1024
"""A runtime -> worker frame whose pickle is at most this long is sent as one piece."""

SAFE_EXCEPTION_NAMES = frozenset({
    "ArithmeticError", "AssertionError", "AttributeError", "ConnectionError", "EOFError",
    "FileExistsError", "FileNotFoundError", "IndexError", "KeyError", "LookupError",
    "NotImplementedError", "OverflowError", "PermissionError", "RuntimeError",
    "TimeoutError", "TypeError", "UnicodeError", "ValueError", "ZeroDivisionError",
})
"""Builtin exception types a failing tool call is re-raised as inside the sandbox."""

_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)


class ProtocolError(AgentrtError):
    """A frame broke the protocol (too large, undecodable, or not a message)."""


class FrameTooLargeError(ProtocolError):
    """An encoded message exceeds :data:`MAX_FRAME_BYTES`."""


class NotPlainDataError(AgentrtError, TypeError):
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
    """Decode a frame sent by the runtime (trusted direction) that has no out-of-band values."""
    return pickle.loads(payload)


class _OutOfBandPickler(pickle.Pickler):
    """Pickles a runtime -> worker frame, leaving out its large strings and bytes (``leaves``,
    in the order the pickle refers to them)."""

    def __init__(self, file: io.BytesIO, leaves: list[str | bytes]) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.leaves = leaves
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> tuple[int, bool] | None:
        kind = type(obj)
        if (kind is str or kind is bytes) and len(obj) >= OUT_OF_BAND_BYTES:
            index = self._index.get(id(obj))
            if index is None:
                index = self._index[id(obj)] = len(self.leaves)
                self.leaves.append(obj)
            return index, kind is str
        return None


def encode_trusted(message: dict[str, Any]) -> Iterator[bytes | memoryview]:
    """A runtime -> worker frame as the pieces to send, in order: the length-prefixed pickle,
    then each large ``str`` or ``bytes`` it left out, in chunks made as they are sent (see the
    module docstring). A ``bytes`` value is sent from its own memory; a ``str`` is encoded one
    chunk at a time."""
    leaves: list[str | bytes] = []
    body = io.BytesIO()
    _OutOfBandPickler(body, leaves).dump(message)
    view = body.getbuffer()
    if len(view) > 0xFFFFFFFF:
        raise FrameTooLargeError(f"message of {len(view)} bytes cannot be framed")
    if len(view) <= SMALL_FRAME_BYTES:
        yield HEADER.pack(len(view)) + bytes(view)
    else:
        yield HEADER.pack(len(view))
        yield view
    del view, body
    for leaf in leaves:
        if type(leaf) is str:
            for start in range(0, len(leaf), CHUNK_BYTES):
                piece = leaf[start:start + CHUNK_BYTES].encode("utf-8", "surrogatepass")
                yield HEADER.pack(len(piece))
                yield piece
        else:
            data = memoryview(leaf)
            for start in range(0, len(data), CHUNK_BYTES):
                yield HEADER.pack(min(CHUNK_BYTES, len(data) - start))
                yield data[start:start + CHUNK_BYTES]
        yield HEADER.pack(0)


class _OutOfBandUnpickler(pickle.Unpickler):
    """Unpickles a runtime -> worker frame, reading the values it left out from ``link``."""

    def __init__(self, payload: bytes, link: FramedSocket) -> None:
        super().__init__(io.BytesIO(payload))
        self._link = link
        self._leaves: list[str | bytes] = []

    def persistent_load(self, pid: Any) -> Any:
        index, is_str = pid
        if index < len(self._leaves):
            return self._leaves[index]
        if index != len(self._leaves):
            raise pickle.UnpicklingError(f"out-of-band value {index} out of order")
        data = bytearray()
        while True:
            (length,) = HEADER.unpack(self._link._recv_exactly(HEADER.size))
            if not length:
                break
            data += self._link._recv_exactly(length)
        leaf = str(data, "utf-8", "surrogatepass") if is_str else bytes(data)
        self._leaves.append(leaf)
        return leaf


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that can build plain data only: every class lookup is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data may cross")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def decode_untrusted(payload: bytes) -> dict[str, Any]:
    """Decode a frame sent by a worker: plain data only, and it must be a message dict."""
    check_untrusted_pickle(payload)
    try:
        message = _PlainUnpickler(io.BytesIO(payload)).load()
    except Exception as exc:  # any malformed pickle is a protocol error
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if type(message) is not dict or type(message.get("op")) is not str:
        raise ProtocolError("a frame must hold a dict with a string 'op'")
    return message


# Opcodes a plain-data pickle (protocol 4 or 5, as ``pickle.dumps`` writes it) may use, by how
# their argument is laid out, and about what each costs once decoded (object plus a slot in its
# container). Everything else (classes, reductions, text protocols, PUT/BINPUT with a memo index
# of the sender's choosing, buffers) is refused.
_SLOT = 16
_ARGLESS = {ord("N"): _SLOT, 0x88: _SLOT, 0x89: _SLOT, ord("]"): 56 + _SLOT,
            ord(")"): _SLOT, ord("}"): 64 + _SLOT, 0x8F: 216 + _SLOT,
            0x85: 48 + _SLOT, 0x86: 56 + _SLOT, 0x87: 64 + _SLOT,    # TUPLE1..3
            ord("a"): 8, ord("s"): 48}                                 # APPEND, SETITEM
_FIXED = {ord("K"): (1, _SLOT), ord("M"): (2, 28 + _SLOT), ord("J"): (4, 32 + _SLOT),
          ord("G"): (8, 24 + _SLOT)}
_RUN_OF = {code: re.compile(b"(?:%s.{%d})+" % (re.escape(bytes([code])), width), re.DOTALL)
           for code, (width, _) in _FIXED.items()}
_SIZED = {0x8A: 1, ord("C"): 1, 0x8C: 1, 0x8B: 4, ord("B"): 4, ord("X"): 4, 0x8E: 8, 0x8D: 8}
_FROM_MARK = {ord("t"): 40, ord("l"): 56, ord("d"): 64, 0x91: 216,   # build from marked items
              ord("e"): 8, ord("u"): 48, 0x90: 32}                    # APPENDS, SETITEMS, ADDITEMS
_MEMOIZE, _MARK, _FRAME, _STOP = 0x94, ord("("), 0x95, ord(".")
_GETS = {ord("h"): 1, ord("j"): 4}


def check_untrusted_pickle(payload: bytes, *, budget: int = MAX_DECODED_BYTES) -> None:
    """Raise ProtocolError unless ``payload`` is a pickle of plain data (protocol 4 or 5) that
    decodes within about ``budget`` bytes of memory. One pass over its opcodes (runs of
    numbers are skipped at C speed)."""
    end = len(payload)
    if end < 3 or payload[0] != 0x80 or payload[1] not in (4, 5):
        raise ProtocolError("a frame must be a pickle of protocol 4 or 5")
    position, cost, memo, marks = 2, 0, 0, 0
    argless, sized, fixed, from_mark = _ARGLESS, _SIZED, _FIXED, _FROM_MARK
    while position < end:
        code = payload[position]
        position += 1
        if code == _MEMOIZE:
            memo += 1
            cost += 16
            continue
        if code in sized:
            width = sized[code]
            if width == 1 and position < end:
                length = payload[position]
            else:
                length = int.from_bytes(payload[position:position + width], "little")
            position += width + length
            cost += length + 80 + _SLOT
        elif code in argless:
            cost += argless[code]
        elif code in fixed:
            width, weight = fixed[code]
            run = _RUN_OF[code].match(payload, position - 1)  # this and the same ones after it
            if run is None:
                raise ProtocolError("a frame ended inside an opcode")
            position = run.end()
            cost += (position - run.start()) // (width + 1) * weight
        elif code == _MARK:
            marks += 1
            cost += 8
            continue
        elif code in from_mark:
            if marks == 0:
                raise ProtocolError("a frame is malformed (no mark)")
            marks -= 1
            cost += from_mark[code]
        elif code in _GETS:
            width = _GETS[code]
            if int.from_bytes(payload[position:position + width], "little") >= memo:
                raise ProtocolError("a frame refers to an object it has not built")
            position += width
            cost += _SLOT
        elif code == _FRAME:
            position += 8
        elif code == _STOP:
            if position != end:
                raise ProtocolError("a frame has data after its STOP opcode")
            return
        else:
            raise ProtocolError(f"a frame used pickle opcode {bytes([code])!r}, which only "
                                "non-plain data needs")
        if cost > budget:
            raise ProtocolError(
                f"a frame would take more than {budget // (1024 * 1024)} MiB once decoded")
    raise ProtocolError("a frame ended before its STOP opcode")


class PlainDataTooLarge(AgentrtError, ValueError):
    """Plain data is bigger (shared references expanded) or deeper than a limit allows."""


_SCALAR_SIZE = 8
_CONTAINERS = (list, tuple, set, frozenset, dict)
_COUNTED_BY_LENGTH = (str, bytes, bytearray)
_PLAIN_SCALARS_8 = frozenset({int, float, bool, type(None)})
_chain = chain.from_iterable


def _items(container: Any) -> Any:
    """The items of a container (a dict's keys and values), through its base class."""
    kind = type(container)
    if issubclass(kind, dict):
        return _chain(dict.items(container))
    for base in (list, tuple, set, frozenset):
        if issubclass(kind, base):
            return base.__iter__(container)
    raise TypeError(kind)


def plain_size(value: Any, *, limit: int, max_depth: int) -> int:
    """The size of ``value`` with every shared reference counted each time it appears.

    A ``str`` counts one per character, ``bytes`` / ``bytearray`` one per byte, any other
    non-container 8, and every list, tuple, set, frozenset or dict 8 plus its items (a dict's
    keys and values). Types are read with ``type()`` and containers are read through their base
    class, so nothing the value's own class defines runs (and a value the shadow has not
    resolved yet counts 8, unforced). Each distinct container is measured once, so the cost
    follows the distinct objects, not the expanded size. Raises `PlainDataTooLarge` as soon as
    the size passes ``limit``, or when containers nest ``max_depth`` levels deep (a container
    that holds itself does).
    """
    kind = type(value)
    if not issubclass(kind, _CONTAINERS):
        size = len(value) if issubclass(kind, _COUNTED_BY_LENGTH) else _SCALAR_SIZE
        if size > limit:
            raise PlainDataTooLarge(f"plain data is larger than {limit:,} bytes")
        return size
    too_deep = f"containers nest {max_depth} levels deep or more (or contain themselves)"
    finished: dict[int, tuple[int, int]] = {}  # id -> (size, levels) of measured containers
    # One entry per container being measured: [container, items, size so far, levels below].
    stack: list[list[Any]] = [[value, _items(value), _SCALAR_SIZE, 0]]
    scalars, by_length, containers = _PLAIN_SCALARS_8, _COUNTED_BY_LENGTH, _CONTAINERS
    while True:
        entry = stack[-1]
        size, levels, depth = entry[2], entry[3], len(stack)
        for item in entry[1]:
            kind = type(item)
            if kind in scalars:
                size += _SCALAR_SIZE
                continue
            if kind is str or issubclass(kind, by_length):
                size += len(item)
            elif issubclass(kind, containers):
                known = finished.get(id(item))
                if known is None:
                    if depth >= max_depth:
                        raise PlainDataTooLarge(too_deep)
                    entry[2], entry[3] = size, levels
                    stack.append([item, _items(item), _SCALAR_SIZE, 0])
                    break
                if depth + known[1] > max_depth:
                    raise PlainDataTooLarge(too_deep)
                size += known[0]
                levels = max(levels, known[1])
            else:
                size += _SCALAR_SIZE
            if size > limit:
                raise PlainDataTooLarge(f"plain data is larger than {limit:,} bytes")
        else:  # this container is measured: add it to its parent
            if size > limit:
                raise PlainDataTooLarge(f"plain data is larger than {limit:,} bytes")
            stack.pop()
            finished[id(entry[0])] = (size, levels + 1)
            if not stack:
                return size
            parent = stack[-1]
            parent[2] += size
            parent[3] = max(parent[3], levels + 1)


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
        """Receive one message from the runtime (with the values that follow its pickle, see
        :func:`encode_trusted`); raise EOFError when the runtime is gone."""
        (length,) = HEADER.unpack(self._recv_exactly(HEADER.size))
        return _OutOfBandUnpickler(self._recv_exactly(length), self).load()

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
