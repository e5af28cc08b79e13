"""The run timeline: timestamped events, one list per run, exportable as JSON.

Event kinds (``data`` fields in brackets):

- ``run_started`` [task], ``run_finished`` [status, answer], ``run_error`` [error]
- ``turn_started`` [turn], ``turn_finished`` [turn, finish_reason, completion_tokens]
- ``delta`` [turn, chars, text] — one per engine delta
- ``block_opened`` [turn, block], ``statement_closed`` [turn, block, stmt, lineno],
  ``block_closed`` [turn, block, chars, unterminated]
- ``exec_started`` / ``exec_finished`` [turn, block, error, final]
- ``tool_started`` / ``tool_finished`` [call_id, tool, mode, error] — ``mode`` is ``"sync"``
  for a call made by the authoritative run, ``"early"`` for a speculative launch
- speculation events (``spec_*``) are documented in ``agentrt.speculation``.

`chrome_trace` / `save_chrome_trace` export a trace as Chrome trace-event JSON, which Perfetto
(ui.perfetto.dev) and chrome://tracing open: one lane per kind of work, see `chrome_trace`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Event:
    t: float
    """Seconds since the run started."""
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


class Trace:
    """An append-only list of `Event`, timed from the trace's creation.

    ``listener``, if given, is called with every event as it is emitted (live displays).
    """

    def __init__(self, listener: Callable[[Event], None] | None = None) -> None:
        self._t0 = time.monotonic()
        self.events: list[Event] = []
        self.listener = listener

    def now(self) -> float:
        return time.monotonic() - self._t0

    def emit(self, kind: str, **data: Any) -> Event:
        event = Event(self.now(), kind, data)
        self.events.append(event)
        if self.listener is not None:
            self.listener(event)
        return event

    def of(self, *kinds: str) -> list[Event]:
        """The events of the given kinds, in order."""
        return [e for e in self.events if e.kind in kinds]

    def to_dict(self) -> dict[str, Any]:
        return {"events": [asdict(e) for e in self.events]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=repr)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(indent=1))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        """The trace `to_dict` wrote (e.g. read back from a saved JSON file)."""
        trace = cls()
        trace.events = [Event(e["t"], e["kind"], dict(e.get("data") or {})) for e in data["events"]]
        return trace

    def to_chrome(self, name: str = "agentrt run") -> dict[str, Any]:
        """This trace as Chrome trace-event JSON (see `chrome_trace`)."""
        return chrome_trace(self, name)

    def __len__(self) -> int:
        return len(self.events)


# -- Chrome trace-event export ---------------------------------------------------------------

SUB_MODEL_TOOLS = frozenset({"llm_query", "llm_query_batched"})
"""Tools whose calls are drawn in the sub-model lanes rather than with the other tool calls."""

_PID = 1
_FIXED_LANES = {"run": 1, "root model": 2, "root tokens": 3, "shadow": 4, "code blocks": 5,
                "block execution": 6}
_SHADOW_KINDS = ("spec_peek", "spec_launch", "spec_claim", "spec_cancel", "spec_effect",
                 "spec_refused")


def chrome_trace(trace: Trace, name: str = "agentrt run") -> dict[str, Any]:
    """Export ``trace`` as Chrome trace-event JSON (a dict; ``json.dump`` it).

    One process (``name``) with one lane (thread) per kind of work: ``run``; ``root model``
    (one span per turn); ``root tokens`` (an instant per streamed delta, with its text);
    ``shadow`` (shadow runs, launches, claims, cancels and effects of tool speculation);
    ``code blocks`` (a block from its opening fence to its closing one); ``block execution``;
    ``early calls``, ``tool calls`` and ``sub-model`` (``llm_query`` calls, early or not), each
    split into as many numbered lanes as calls overlap. Spans are complete events (``ph: X``),
    times are microseconds since the run started; a span still open when the trace ends is
    closed at its last event and marked ``unfinished``.
    """
    events = trace.events
    end = events[-1].t if events else 0.0
    out: list[dict[str, Any]] = []
    lanes = dict(_FIXED_LANES)
    open_spans: dict[tuple, Event] = {}
    calls: dict[str, list[tuple[float, float, dict[str, Any]]]] = {
        "early calls": [], "tool calls": [], "sub-model": []}

    def span(lane: str, label: str, start: Event, stop: Event | None, **args: Any) -> None:
        finish = end if stop is None else stop.t
        if stop is None:
            args["unfinished"] = True
        out.append({"name": label, "cat": lane, "ph": "X", "ts": _us(start.t),
                    "dur": _us(finish - start.t), "pid": _PID, "tid": lanes[lane],
                    "args": _plain({**start.data, **(stop.data if stop else {}), **args})})

    def instant(lane: str, label: str, event: Event) -> None:
        out.append({"name": label, "cat": lane, "ph": "i", "s": "t", "ts": _us(event.t),
                    "pid": _PID, "tid": lanes[lane], "args": _plain(event.data)})

    chars = 0
    for event in events:
        kind, data = event.kind, event.data
        if kind == "run_started":
            open_spans["run",] = event
        elif kind == "run_finished":
            span("run", "run", open_spans.pop(("run",), event), event)
        elif kind == "turn_started":
            open_spans["turn", data.get("turn")] = event
            chars = 0
        elif kind == "turn_finished":
            start = open_spans.pop(("turn", data.get("turn")), event)
            span("root model", f"turn {data.get('turn', 0) + 1}", start, event)
        elif kind == "delta":
            instant("root tokens", "delta", event)
            chars += data.get("chars", 0)
            out.append({"name": "root chars", "ph": "C", "ts": _us(event.t), "pid": _PID,
                        "tid": lanes["root tokens"], "args": {"chars": chars}})
        elif kind == "block_opened":
            open_spans["block", data.get("turn"), data.get("block")] = event
        elif kind == "block_closed":
            start = open_spans.pop(("block", data.get("turn"), data.get("block")), event)
            span("code blocks", _block_label(data), start, event)
        elif kind == "exec_started":
            open_spans["exec", data.get("turn"), data.get("block")] = event
        elif kind == "exec_finished":
            start = open_spans.pop(("exec", data.get("turn"), data.get("block")), event)
            span("block execution", _block_label(data), start, event)
        elif kind == "tool_started":
            open_spans["tool", data.get("mode"), data.get("call_id")] = event
        elif kind == "tool_finished":
            start = open_spans.pop(("tool", data.get("mode"), data.get("call_id")), None)
            if start is not None:
                calls[_call_lane(data)].append((start.t, event.t, {**start.data, **data}))
        elif kind in _SHADOW_KINDS:
            instant("shadow", _shadow_label(event), event)
        elif kind == "run_error":
            instant("run", "error", event)
    for key, start in open_spans.items():  # cut short: close at the end of the trace
        if key[0] == "tool":
            calls[_call_lane(start.data)].append((start.t, None, dict(start.data)))
        elif key[0] == "run":
            span("run", "run", start, None)
        elif key[0] == "turn":
            span("root model", f"turn {start.data.get('turn', 0) + 1}", start, None)
        else:
            lane = "code blocks" if key[0] == "block" else "block execution"
            span(lane, _block_label(start.data), start, None)
    for group, spans in calls.items():
        for index, (start_t, stop_t, args) in _pack(spans):
            lane = f"{group} #{index + 1}"
            lanes.setdefault(lane, len(lanes) + 1)
            if stop_t is None:
                args["unfinished"] = True
            label = str(args.get("tool", "tool"))
            if group == "sub-model" and args.get("mode") == "early":
                label += " (early)"
            out.append({"name": label, "cat": group, "ph": "X", "ts": _us(start_t),
                        "dur": _us((end if stop_t is None else stop_t) - start_t), "pid": _PID,
                        "tid": lanes[lane], "args": _plain(args)})
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": _PID, "tid": 0, "args": {"name": name}}]
    for lane, tid in lanes.items():
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": _PID, "tid": tid,
                     "args": {"name": lane}})
        meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": _PID, "tid": tid,
                     "args": {"sort_index": tid}})
    out.sort(key=lambda e: e["ts"])
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def save_chrome_trace(trace: Trace, path: str | Path, name: str = "agentrt run") -> Path:
    """Write `chrome_trace` of ``trace`` to ``path`` (open it in Perfetto or chrome://tracing)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(trace, name)))
    return path


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    """Event data as JSON-safe values (what json cannot write becomes its repr)."""
    return json.loads(json.dumps(data, default=repr))


def _block_label(data: dict[str, Any]) -> str:
    return f"turn {data.get('turn', 0) + 1} block {data.get('block', 0) + 1}"


def _call_lane(data: dict[str, Any]) -> str:
    if data.get("tool") in SUB_MODEL_TOOLS:
        return "sub-model"
    return "early calls" if data.get("mode") == "early" else "tool calls"


def _shadow_label(event: Event) -> str:
    data = event.data
    if event.kind == "spec_peek":
        return f"shadow run ({data.get('lines', 0)} lines)"
    if event.kind == "spec_launch":
        return f"launch {data.get('tool')} #{data.get('early_id')}"
    if event.kind == "spec_claim":
        hit = data.get("early_id") is not None
        return f"claim {data.get('tool')} ({'hit' if hit else 'miss'})"
    if event.kind == "spec_cancel":
        return f"cancel #{data.get('early_id')} ({data.get('reason')})"
    if event.kind == "spec_effect":
        return "effect barrier"
    return f"refused {data.get('tool')}"


def _pack(spans: list[tuple[float, float | None, dict[str, Any]]]
          ) -> list[tuple[int, tuple[float, float | None, dict[str, Any]]]]:
    """Give each span the first lane free at its start, so spans in one lane never overlap."""
    ends: list[float] = []
    placed = []
    for item in sorted(spans, key=lambda s: s[0]):
        start, stop = item[0], item[1]
        lane = next((i for i, free in enumerate(ends) if free <= start), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = float("inf") if stop is None else stop
        placed.append((lane, item))
    return placed
