"""The socket service: accepts worker connections, authenticates them, reads and checks their
frames and dispatches them.

The runtime trusts no worker. Before a connection has authenticated it may send one hello frame
of at most :data:`HELLO_MAX_BYTES` within :data:`HELLO_TIMEOUT_S`; at most
:data:`MAX_PENDING_HELLOS` connections may wait for their hello (the oldest is dropped) and at
most :data:`MAX_CONNECTIONS` be open. Every later frame is bounded (``MAX_FRAME_BYTES``; one frame
over :data:`LARGE_FRAME_BYTES` read at a time, within :data:`FRAME_BODY_TIMEOUT_S`), decoded as
plain data, typed by :func:`~..frames.parse_worker_frame` and bounded in expanded size (tool
arguments by ``MAX_ARG_BYTES``, reply values by ``MAX_VALUE_BYTES``) before anything else reads
it. A frame that breaks these rules ends that worker's session: the process and everything it
started are killed, ``protocol_errors`` counts it and a warning is logged; the REPL goes on.

Replies resolve pending requests, tool calls run concurrently through the tool handler (at most
:data:`MAX_TOOL_CALLS_IN_FLIGHT` at once), ``forked`` and ``child_exit`` reports update the
process table (``child_exit`` only names causes), and the messages of shadow forks go, typed, to
the message stream (messages.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .. import frames
from ..arg_limits import check_arguments
from ..frames import (
    ChildExit,
    Forked,
    Hello,
    Launch,
    RefusedCall,
    Reply,
    ShadowMessage,
    ToolCall,
    ToolFailed,
    ToolResult,
    WorkerFrame,
)
from ..protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    MAX_VALUE_BYTES,
    MAX_VALUE_DEPTH,
    NotPlainDataError,
    PlainDataTooLarge,
    ProtocolError,
    decode_untrusted,
    plain_size,
    to_plain,
    wire_exception_type,
)
from ..rate import TokenBucket
from . import process_tree
from .messages import ReplMessages
from .processes import Proc, ProcessTable
from .results import ReplProcessDied

logger = logging.getLogger(__name__)

ToolHandler = Callable[[str, tuple[Any, ...], dict[str, Any]], Awaitable[Any]]
"""``async handler(tool_name, args, kwargs) -> result`` (result must be plain data)."""

HELLO_TIMEOUT_S = 5.0
HELLO_MAX_BYTES = 4096
MAX_PENDING_HELLOS = 4
MAX_CONNECTIONS = 24
"""Open worker connections per REPL (authenticated or not); each live worker holds one."""
LARGE_FRAME_BYTES = 64 * 1024
FRAME_BODY_TIMEOUT_S = 30.0
MAX_TOOL_CALLS_IN_FLIGHT = 64
REFUSALS_BURST = 256
REFUSALS_PER_S = 128
MAX_REFUSED_CONNECTIONS = 16
"""Connections a worker may open without a valid hello before its session is ended."""
HANGUP_GRACE_S = 1.0
"""How long a process may run on after closing its connection."""
MAX_REFUSED_CALLS = 64
"""Refused tool calls a shadow fork may make before its session is ended."""
MAX_IGNORED_FRAMES = 64
"""Frames a process may send that change nothing (stale replies, reports about strangers)."""


class ReplService:
    """Listens on the REPL's Unix socket ``socket_path`` (owner-only) and keeps one reader task
    per worker connection; use as an async context manager (its tasks run in a task group of
    the task that enters it, until it exits).

    ``messages``, when set, receives the messages of shadow forks, typed, and a
    ``RefusedCall`` notice for each refused tool call.
    """

    def __init__(self, socket_path: str, table: ProcessTable, tools: Mapping[str, str],
                 tool_handler: ToolHandler, *, messages: ReplMessages | None = None) -> None:
        self._socket_path = socket_path
        self._table = table
        self._tools = tools
        self._tool_handler = tool_handler
        self._handler_takes_line = "line" in inspect.signature(tool_handler).parameters
        self.messages = messages
        self._listener: anyio.abc.Listener | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._connections = 0
        self._waiting_hello: deque[anyio.CancelScope] = deque()
        self._large_frame = anyio.Lock()
        self._tool_slots = anyio.Semaphore(MAX_TOOL_CALLS_IN_FLIGHT)
        self._refusals = TokenBucket(REFUSALS_BURST, REFUSALS_PER_S)
        self.protocol_errors = 0
        """Worker sessions ended because a frame broke the protocol."""
        self.refused_connections = 0
        """Connections closed unread: over the cap, or dropped while waiting for a hello."""

    async def __aenter__(self) -> ReplService:
        """Listen on the socket and start serving connections."""
        async with contextlib.AsyncExitStack() as stack:
            self._listener = await stack.enter_async_context(
                await anyio.create_unix_listener(self._socket_path, mode=0o600))
            self._group = await stack.enter_async_context(anyio.create_task_group())
            self._group.start_soon(self._serve_listener)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Stop serving: cancel every connection task and close the listener."""
        assert self._group is not None and self._stack is not None
        self._group.cancel_scope.cancel()
        return await self._stack.__aexit__(*exc_info)

    def start_soon(self, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``func(*args)`` in the service's task group (ends when the service closes)."""
        assert self._group is not None
        self._group.start_soon(func, *args)

    async def _serve_listener(self) -> None:
        """Accept connections; while many are refused, accept more slowly (a flood of
        connections costs the runtime at most :data:`REFUSALS_PER_S` of them a second)."""
        try:
            while True:
                stream = await self._listener.accept()
                self._group.start_soon(self._on_connection, stream)
                await anyio.sleep(self._refusals.debt_s())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    def _refuse(self, stream: anyio.abc.ByteStream | None = None) -> None:
        """Count a connection closed unread. Its process is a rogue: a worker that keeps
        connecting without a valid hello has its session ended; any other process of the jail
        that does is killed."""
        self.refused_connections += 1
        self._refusals.spend()
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None) if stream else None
        pid, pidfd = process_tree.peer_credentials(sock) if sock is not None else (None, None)
        if pidfd is None:
            return
        try:
            proc = next((p for p in self._table.by_token.values() if p.pid == pid), None)
            if proc is not None:
                proc.refused_connections += 1
                if proc.refused_connections > MAX_REFUSED_CONNECTIONS:
                    self._end_session(proc, f"over {MAX_REFUSED_CONNECTIONS} connections "
                                            "without a valid hello")
            elif self._table.is_stray(pid):
                process_tree.signal_pidfd(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)

    # -- connections ---------------------------------------------------------------------------
    async def _on_connection(self, stream: anyio.abc.ByteStream) -> None:
        if self._connections >= MAX_CONNECTIONS:
            self._refuse(stream)
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()
            return
        self._connections += 1
        proc: Proc | None = None
        try:
            receiver = BufferedByteReceiveStream(stream)
            proc = await self._authenticate(stream, receiver)
            if proc is None:
                return
            while True:
                await self._dispatch(proc, await self._read_frame(receiver))
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                anyio.ClosedResourceError, ConnectionError):
            pass
        except ProtocolError as exc:
            if proc is not None:
                self._end_session(proc, exc)
        except Exception:
            logger.exception("unexpected error on a sandbox connection")
            if proc is not None:
                self._end_session(proc, "unexpected error on its connection")
        finally:
            self._connections -= 1
            if proc is None:  # it never said a valid hello
                self._refuse(stream)
            else:
                proc.mark_dead()
                if not proc.exited.is_set():  # normally it is exiting; if not, it has to
                    self.start_soon(self._after_hangup, proc)
                self._table.forget_if_finished(proc)
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await stream.aclose()

    async def _authenticate(self, stream: anyio.abc.ByteStream,
                            receiver: BufferedByteReceiveStream) -> Proc | None:
        """Read the hello (small, prompt) and match it to a process the runtime started."""
        with anyio.CancelScope() as scope:
            self._waiting_hello.append(scope)
            if len(self._waiting_hello) > MAX_PENDING_HELLOS:
                self._waiting_hello.popleft().cancel()  # drop the oldest waiter
            try:
                with anyio.move_on_after(HELLO_TIMEOUT_S):
                    (length,) = HEADER.unpack(await receiver.receive_exactly(HEADER.size))
                    if length > HELLO_MAX_BYTES:
                        return None
                    hello = frames.parse_worker_frame(
                        decode_untrusted(await receiver.receive_exactly(length)))
                    return self._accept_hello(hello, stream)
            except ProtocolError:
                return None
            finally:
                with contextlib.suppress(ValueError):
                    self._waiting_hello.remove(scope)
        return None

    def _accept_hello(self, hello: WorkerFrame, stream: anyio.abc.ByteStream) -> Proc | None:
        if not isinstance(hello, Hello):
            return None
        proc = self._table.by_token.get(hello.token)
        if proc is None or proc.stream is not None or proc.dead.is_set() \
                or proc.role != hello.role:
            return None
        if proc.wire_pid is not None and proc.wire_pid != hello.pid:
            return None
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        pid, pidfd = process_tree.peer_credentials(sock) if sock is not None else (None, None)
        if pid is None or pidfd is None:
            if pidfd is not None:
                os.close(pidfd)
            logger.warning("cannot identify the process behind a sandbox connection")
            return None
        proc.wire_pid, proc.pid, proc.pidfd = hello.pid, pid, pidfd
        self._table.by_pid[hello.pid] = proc
        proc.stream = stream
        proc.ready.set()
        self.start_soon(self._watch_exit, proc, pidfd)
        return proc

    async def _watch_exit(self, proc: Proc, pidfd: int) -> None:
        """Mark ``proc`` exited when its pidfd turns readable (the kernel's word, not its own)."""
        try:
            await process_tree.exited(pidfd)
        finally:
            proc.close_pidfd()
        proc.observe_exit()
        self._table.forget_if_finished(proc)

    async def _read_frame(self, receiver: BufferedByteReceiveStream) -> WorkerFrame:
        (length,) = HEADER.unpack(await receiver.receive_exactly(HEADER.size))
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} "
                                "byte limit")
        if length <= LARGE_FRAME_BYTES:
            return frames.parse_worker_frame(decode_untrusted(
                await receiver.receive_exactly(length)))
        async with self._large_frame:  # one large frame in memory at a time
            with anyio.move_on_after(FRAME_BODY_TIMEOUT_S) as body:
                payload = await receiver.receive_exactly(length)
            if body.cancelled_caught:
                raise ProtocolError(f"a frame of {length} bytes took over "
                                    f"{FRAME_BODY_TIMEOUT_S:g} s to arrive")
            return frames.parse_worker_frame(decode_untrusted(payload))

    async def _after_hangup(self, proc: Proc) -> None:
        """A process closed its connection: it must exit, or it is killed with what it
        started."""
        with anyio.move_on_after(HANGUP_GRACE_S):
            await proc.exited.wait()
        if not proc.exited.is_set():
            self._end_session(proc, "it closed its connection but kept running")

    def _end_session(self, proc: Proc, why: Any) -> None:
        """A worker broke the protocol: kill it and what it started, count and log it."""
        if proc.session_ended:
            return
        proc.session_ended = True
        self.protocol_errors += 1
        logger.warning("sandbox %s process %s broke the protocol (%s): its session is ended",
                       proc.role, proc.pid, why)
        self._table.kill(proc, f"it broke the protocol ({why})")
        self.start_soon(self._table.kill_tree, proc, "it broke the protocol")

    # -- frames ----------------------------------------------------------------------------------
    async def _dispatch(self, proc: Proc, frame: WorkerFrame) -> None:
        if isinstance(frame, Reply):
            self._on_reply(proc, frame)
        elif isinstance(frame, ToolCall):
            await self._on_tool_call(proc, frame)
        elif isinstance(frame, Forked):
            self._on_forked(proc, frame)
        elif isinstance(frame, ChildExit):
            self._on_child_exit(proc, frame)
        elif isinstance(frame, frames.SHADOW_FRAMES) and proc.role == "fork":
            _check_arguments_on_receipt(frame)
            await self._post(proc.token, frame)
        else:
            raise ProtocolError(f"a {proc.role} process may not send {frame.op!r}")

    def _on_reply(self, proc: Proc, reply: Reply) -> None:
        if not 0 < reply.id <= self._table.requests_made:
            raise ProtocolError(f"reply to request {reply.id}, which was never made")
        pending = self._table.pending.get(reply.id)
        if pending is None:  # a request that timed out or was abandoned
            self._ignored(proc, "replies to requests no longer open")
            return
        if proc not in pending.senders:
            raise ProtocolError(f"reply to request {reply.id}, which it was not asked")
        if reply.ok:
            try:
                plain_size(reply.value, limit=MAX_VALUE_BYTES, max_depth=MAX_VALUE_DEPTH)
            except PlainDataTooLarge as exc:
                raise ProtocolError(f"reply value: {exc}") from None
        pending.resolve(reply, proc)

    async def _on_tool_call(self, proc: Proc, call: ToolCall) -> None:
        if call.name not in self._tools:
            raise ProtocolError(f"call of unknown tool {call.name!r}")
        _check_arguments_on_receipt(call)
        if not proc.tool_calls_allowed:
            await self._refuse_tool_call(proc, call)
            return
        mark = self._messages_mark()
        await self._tool_slots.acquire()
        self._group.start_soon(self._run_tool_call, proc, call, mark)

    def _on_forked(self, proc: Proc, forked: Forked) -> None:
        child = self._table.by_token.get(forked.token)
        if child is None or child.parent is not proc or forked.pid <= 0 \
                or child.wire_pid not in (None, forked.pid):  # its hello may come first
            raise ProtocolError("a 'forked' report for a child it was not asked to fork")
        child.wire_pid = forked.pid
        self._table.by_pid[forked.pid] = child

    def _on_child_exit(self, proc: Proc, report: ChildExit) -> None:
        target = self._table.by_pid.get(report.pid)
        if target is None or (target.parent is not proc and proc is not self._table.root):
            if proc is not self._table.root:  # the root also reaps orphans it never knew
                self._ignored(proc, "exit reports for processes that are not its children")
            return
        target.report_exit(report.code, report.signal)
        if target.stream is None and not target.exited.is_set() \
                and self._table.host_pid_of(target) is None:  # confirmed: it never connected
            target.observe_exit()
            target.mark_dead()
        self._table.forget_if_finished(target)

    def _ignored(self, proc: Proc, what: str) -> None:
        """Count a frame that is allowed but pointless; too many end the session."""
        proc.ignored_frames += 1
        if proc.ignored_frames > MAX_IGNORED_FRAMES:
            raise ProtocolError(f"over {MAX_IGNORED_FRAMES} {what}")

    async def _post(self, token: str, message: ShadowMessage) -> None:
        if self.messages is not None:
            await self.messages.post(token, message)

    def _messages_mark(self) -> int:
        """How many messages precede a tool call dispatched now (0: no stream to wait for)."""
        messages = self.messages
        return messages.mark() if messages is not None and not messages.closed else 0

    async def _refuse_tool_call(self, proc: Proc, call: ToolCall) -> None:
        proc.refused_calls += 1
        if proc.refused_calls > MAX_REFUSED_CALLS:
            raise ProtocolError(f"over {MAX_REFUSED_CALLS} refused tool calls")
        await self._post(proc.token, RefusedCall(call.name))
        reply = ToolFailed(call.call, "PermissionError", "PermissionError",
                           f"{call.name}(): a shadow process may not call tools")
        with contextlib.suppress(ReplProcessDied):
            await proc.send(reply)

    async def _run_tool_call(self, proc: Proc, call: ToolCall, messages_before: int) -> None:
        reply: ToolResult | ToolFailed | None = None
        try:
            with anyio.CancelScope() as scope:
                proc.tool_scopes.add(scope)
                try:
                    messages = self.messages
                    if messages is not None and messages_before:
                        await messages.wait_received(messages_before)  # they precede this call
                    if self._handler_takes_line:
                        value = await self._tool_handler(call.name, call.args,
                                                         dict(call.kwargs), line=call.line)
                    else:
                        value = await self._tool_handler(call.name, call.args, dict(call.kwargs))
                    reply = ToolResult(call.call, _plain_tool_value(call.name, value))
                except Exception as exc:
                    reply = ToolFailed(call.call, wire_exception_type(exc), type(exc).__name__,
                                       str(exc))
                finally:
                    proc.tool_scopes.discard(scope)
            if reply is not None:
                with contextlib.suppress(ReplProcessDied):
                    await proc.send(reply)
        finally:
            self._tool_slots.release()


def _check_arguments_on_receipt(frame: Any) -> None:
    """Bound a call's or launch's arguments before anything copies or hashes them."""
    if isinstance(frame, (ToolCall, Launch)):
        try:
            check_arguments(frame.name, frame.args, frame.kwargs)
        except Exception as exc:
            raise ProtocolError(f"arguments of {frame.name!r}: {exc}") from None


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
