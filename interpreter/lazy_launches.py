"""Pipelined launches: tool calls sent as soon as their (possibly lazy) arguments are known."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .lazy_values import (
    RESOLVED,
    Abandoned,
    CallId,
    Lazy,
    LazyTable,
    _snapshot,
    _unfinished_calls,
    _WouldBlock,
    force_deep,
)

# ---------------------------------------------------------------------------------------------
# Pipelined launches


SendLaunch = Callable[[CallId, str, tuple, dict], None]


class _Pending:
    __slots__ = ("call_id", "tool", "args", "kwargs", "waiting")

    def __init__(self, call_id: CallId, tool: str, args: tuple, kwargs: dict, waiting: set) -> None:
        self.call_id = call_id
        self.tool = tool
        self.args = args
        self.kwargs = kwargs
        self.waiting = waiting


class PendingLaunches:
    """Launch tool calls as soon as their (possibly lazy) arguments are known.

    :meth:`request` returns a ``Lazy`` for the result at once. If every argument is ready the
    launch is sent right away (``send_launch(call_id, tool, args, kwargs)`` with concrete
    arguments); otherwise it waits, and is sent by whichever thread settles its last missing
    input. A launch whose inputs failed or were poisoned is poisoned itself (and so are the
    launches waiting on it). Launches are sent in the order they become ready, ties broken by
    registration order; ``send_launch`` is never called twice for one call id.
    """

    def __init__(
        self,
        table: LazyTable,
        send_launch: SendLaunch,
        make_call_id: Callable[[], CallId] | None = None,
    ) -> None:
        self.table = table
        self._send_launch = send_launch
        self._make_call_id = make_call_id or self._default_call_id
        self._counter = 0
        self._lock = threading.RLock()
        self._by_input: dict[CallId, list[_Pending]] = {}
        self._pending: dict[CallId, _Pending] = {}
        self._retry: list[_Pending] = []
        self._events: list[tuple[CallId, str]] = []
        self._draining = False
        self.sent: list[CallId] = []
        table.subscribe(self._on_settled)

    def _default_call_id(self) -> CallId:
        self._counter += 1
        return f"launch-{self._counter}"

    def request(self, tool: str, args: Iterable[Any] = (), kwargs: Mapping[str, Any] | None = None,
                call_id: CallId | None = None) -> Lazy:
        """Request a launch of ``tool`` (sent once its arguments are known; the runtime decides
        whether to launch it: `agentrt.ledger.Ledger.launch`) and return the ``Lazy`` for its
        result."""
        args = tuple(args)
        kwargs = dict(kwargs or {})
        with self._lock:
            if call_id is None:
                call_id = self._make_call_id()
            result = self.table.new_call(call_id)
            waiting_nodes, doomed = _unfinished_calls((args, kwargs))
            if doomed:
                self.table.poison(call_id, "an argument of this call is unavailable")
            else:
                entry = _Pending(call_id, tool, _snapshot(args), _snapshot(kwargs),
                                 {node.call_id for node in waiting_nodes})
                self._pending[call_id] = entry
                for input_id in entry.waiting:
                    self._by_input.setdefault(input_id, []).append(entry)
                if not entry.waiting:
                    self._try_send(entry)
            self._drain()
        return result

    def pending_count(self) -> int:
        """How many registered launches are still waiting for inputs."""
        with self._lock:
            return len(self._pending)

    def poll(self) -> None:
        """Retry launches whose computation was postponed (normally not needed)."""
        with self._lock:
            retry, self._retry = self._retry, []
            for entry in retry:
                if entry.call_id in self._pending:
                    self._try_send(entry)
            self._drain()

    # -- internals ---------------------------------------------------------------------------
    def _on_settled(self, call_id: CallId, state: str) -> None:
        with self._lock:
            self._events.append((call_id, state))
            self._drain()

    def _drain(self) -> None:
        """Process queued events; re-entrant settles (poison cascades) queue up, no recursion."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._events:
                call_id, state = self._events.pop(0)
                for entry in self._by_input.pop(call_id, []):
                    if entry.call_id not in self._pending:
                        continue
                    if state != RESOLVED:
                        del self._pending[entry.call_id]
                        self.table.poison(entry.call_id, f"input {call_id!r} is {state}")
                        continue
                    entry.waiting.discard(call_id)
                    if not entry.waiting:
                        self._try_send(entry)
                if self._retry:
                    retry, self._retry = self._retry, []
                    for entry in retry:
                        if entry.call_id in self._pending:
                            self._try_send(entry)
        finally:
            self._draining = False

    def _try_send(self, entry: _Pending) -> None:
        """Compute the arguments without blocking and send; postpone if that would block."""
        try:
            with self.table.nonblocking():
                args = force_deep(entry.args)
                kwargs = force_deep(entry.kwargs)
        except _WouldBlock:
            self._retry.append(entry)
            return
        except Abandoned as exc:
            del self._pending[entry.call_id]
            self.table.poison(entry.call_id, f"an argument could not be computed: {exc}")
            return
        del self._pending[entry.call_id]
        self.sent.append(entry.call_id)
        try:
            self._send_launch(entry.call_id, entry.tool, args, kwargs)
        except Exception as exc:
            self.sent.remove(entry.call_id)
            self.table.poison(entry.call_id, f"launch failed: {type(exc).__name__}: {exc}")


