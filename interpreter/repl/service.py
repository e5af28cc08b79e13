"""The socket service: accepts worker connections, reads their frames and dispatches them.

Replies resolve pending requests, tool calls run concurrently through the tool handler,
process bookkeeping (``forked``, ``child_exit``) updates the process table, and any other
message from a forked process is passed on, unread, to the message stream (messages.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from ..protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    NotPlainDataError,
    ProtocolError,
    decode_untrusted,
    to_plain,
    wire_exception_type,
)
from .messages import ReplMessages
from .processes import Proc, ProcessTable
from .results import ReplProcessDied

logger = logging.getLogger(__name__)

ToolHandler = Callable[[str, tuple[Any, ...], dict[str, Any]], Awaitable[Any]]
"""``async handler(tool_name, args, kwargs) -> result`` (result must be plain data)."""

HELLO_TIMEOUT_S = 10.0



class ReplService:
    """Listens on the REPL's Unix socket and keeps one reader task per worker connection.

    ``namespaces``: the workers run in the jail's PID namespace (their own pids differ from
    the runtime's). ``messages``, when set, receives the messages of forked processes that
    the service does not handle itself, and a ``refused_call`` notice for each refused call.
    """

    def __init__(self, table: ProcessTable, tools: Mapping[str, str], tool_handler: ToolHandler,
                 *, namespaces: bool, messages: ReplMessages | None = None) -> None:
        self._table = table
        self._tools = tools
        self._tool_handler = tool_handler
        self._handler_takes_line = "line" in inspect.signature(tool_handler).parameters
        self._namespaces = namespaces
        self.messages = messages
        self._listener: anyio.abc.Listener | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self.refused_tool_calls = 0
        """Real tool calls refused because they came from a shadow fork."""

    async def start(self, socket_path: str) -> None:
        """Listen on ``socket_path`` (owner-only) and start serving connections."""
        self._listener = await anyio.create_unix_listener(socket_path, mode=0o600)
        ready = anyio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(ready))
        await ready.wait()

    def start_soon(self, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``func(*args)`` in the service's task group (ends when the service closes)."""
        assert self._group is not None
        self._group.start_soon(func, *args)

    async def aclose(self) -> None:
        """Stop serving: cancel every connection task and close the listener."""
        if self._group is not None:
            self._group.cancel_scope.cancel()
        if self._task is not None:
            await asyncio.wait([self._task])
            if not self._task.cancelled() and self._task.exception() is not None:
                logger.error("REPL service task failed", exc_info=self._task.exception())
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.aclose()

    async def _run(self, ready: anyio.Event) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self._serve_listener)
            ready.set()
            await anyio.sleep_forever()

    async def _serve_listener(self) -> None:
        try:
            await self._listener.serve(self._on_connection)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def _on_connection(self, stream: anyio.abc.ByteStream) -> None:
        proc: Proc | None = None
        try:
            receiver = BufferedByteReceiveStream(stream)
            with anyio.fail_after(HELLO_TIMEOUT_S):
                hello = await _read_frame(receiver)
            proc = self._accept_hello(hello, _peer_pid(stream))
            if proc is None:
                return
            proc.stream = stream
            proc.ready.set()
            while True:
                self._dispatch(proc, await _read_frame(receiver))
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                anyio.ClosedResourceError, ConnectionError, TimeoutError):
            pass
        except ProtocolError as exc:
            if proc is not None:
                logger.warning("sandbox process %s broke the protocol: %s", proc.pid, exc)
                self._table.kill(proc, f"it broke the protocol ({exc})")
        except Exception:
            logger.exception("unexpected error on a sandbox connection")
            if proc is not None:
                self._table.kill(proc, "unexpected error on its connection")
        finally:
            if proc is not None:
                proc.mark_dead()
                self._table.forget_if_finished(proc)
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()

    def _accept_hello(self, hello: dict[str, Any], peer_pid: int | None) -> Proc | None:
        token, pid = hello.get("token"), hello.get("pid")
        if hello.get("op") != "hello" or type(token) is not str or type(pid) is not int or pid <= 0:
            return None
        proc = self._table.by_token.get(token)
        if proc is None or proc.stream is not None or proc.dead.is_set():
            return None
        if proc.wire_pid is not None and proc.wire_pid != pid:
            return None
        proc.wire_pid, proc.pid = pid, peer_pid or pid
        self._table.by_pid[pid] = proc
        return proc

    def _dispatch(self, proc: Proc, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "reply":
            pending = self._table.pending.get(message.get("id"))  # type: ignore[arg-type]
            if pending is not None and proc in pending.senders:
                pending.resolve(message, proc)
        elif op == "call":
            call_id, name = message.get("call"), message.get("name")
            args, kwargs = message.get("args"), message.get("kwargs")
            if type(call_id) is not int or type(name) is not str \
                    or type(args) not in (list, tuple) or type(kwargs) is not dict \
                    or not all(type(k) is str for k in kwargs):
                raise ProtocolError("malformed tool call")
            line = message.get("line")
            if not proc.tool_calls_allowed:
                self._refuse_tool_call(proc, call_id, name)
                return
            self._group.start_soon(self._run_tool_call, proc, call_id, name, tuple(args), kwargs,
                                   line if type(line) is int else None, self._messages_mark())
        elif op == "forked":
            child = self._table.by_token.get(message.get("token"))  # type: ignore[arg-type]
            pid = message.get("pid")
            if child is not None and child.parent is proc and child.wire_pid is None \
                    and type(pid) is int and pid > 0:
                child.wire_pid = pid
                if not self._namespaces:
                    child.pid = pid
                self._table.by_pid[pid] = child
        elif op == "child_exit":
            target = self._table.by_pid.get(message.get("pid"))  # type: ignore[arg-type]
            code, number = message.get("code"), message.get("signal")
            if target is not None:
                target.record_exit(code if type(code) is int else None,
                                   number if type(number) is int else None)
                if target.stream is None:
                    target.mark_dead()
                self._table.forget_if_finished(target)
        elif proc.role == "fork":
            self._post(proc.token, message)
        else:
            raise ProtocolError(f"unknown message {op!r}")

    def _post(self, token: str, message: dict[str, Any]) -> None:
        if self.messages is not None:
            self.messages.post(token, message)

    def _messages_mark(self) -> int:
        """How many messages precede a tool call dispatched now (0: no stream to wait for)."""
        messages = self.messages
        return messages.mark() if messages is not None and not messages.closed else 0

    def _refuse_tool_call(self, proc: Proc, call_id: int, name: str) -> None:
        self.refused_tool_calls += 1
        self._post(proc.token, {"op": "refused_call", "name": name})
        reply = {"op": "tool_error", "call": call_id, "type": "PermissionError",
                 "original_type": "PermissionError",
                 "message": f"{name}(): a shadow process may not call tools"}

        async def send() -> None:
            with contextlib.suppress(ReplProcessDied):
                await proc.send(reply)

        self._group.start_soon(send)

    async def _run_tool_call(self, proc: Proc, call_id: int, name: str,
                             args: tuple[Any, ...], kwargs: dict[str, Any],
                             line: int | None = None, messages_before: int = 0) -> None:
        reply: dict[str, Any] | None = None
        with anyio.CancelScope() as scope:
            proc.tool_scopes.add(scope)
            try:
                messages = self.messages
                if messages is not None and messages_before:
                    await messages.wait_received(messages_before)  # they precede this call
                if name not in self._tools:
                    raise LookupError(f"unknown tool {name!r}")
                if self._handler_takes_line:
                    value = await self._tool_handler(name, args, kwargs, line=line)
                else:
                    value = await self._tool_handler(name, args, kwargs)
                reply = {"op": "tool_result", "call": call_id,
                         "value": _plain_tool_value(name, value)}
            except Exception as exc:
                reply = {"op": "tool_error", "call": call_id, "type": wire_exception_type(exc),
                         "original_type": type(exc).__name__, "message": str(exc)}
            finally:
                proc.tool_scopes.discard(scope)
        if reply is not None:
            with contextlib.suppress(ReplProcessDied):
                await proc.send(reply)

async def _read_frame(receiver: BufferedByteReceiveStream) -> dict[str, Any]:
    (length,) = HEADER.unpack(await receiver.receive_exactly(HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return decode_untrusted(await receiver.receive_exactly(length))


def _plain_tool_value(name: str, value: Any) -> Any:
    """A tool's return value as plain data (pydantic models and dataclasses are dumped)."""
    try:
        return to_plain(value)
    except NotPlainDataError:
        pass
    if callable(getattr(value, "model_dump", None)):
        value = value.model_dump()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return to_plain(value)
    except NotPlainDataError as exc:
        raise TypeError(
            f"tool {name!r} returned a value the sandbox cannot receive: {exc}") from None


def _peer_pid(stream: anyio.abc.ByteStream) -> int | None:
    """The pid of the process at the other end of a Unix socket, as this process sees it
    (workers in the jail's PID namespace know themselves by other numbers)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    except OSError:
        return None
    return pid if pid > 0 else None


