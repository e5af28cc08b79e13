"""Exports of a run's trace, read from its typed events: Chrome trace-event JSON (Perfetto,
chrome://tracing) and the timeline's spans (what the benchmarks' plots draw)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .events import (
    BlockClosedEvent,
    BlockOpenedEvent,
    DeltaEvent,
    ExecFinished,
    ExecStarted,
    RunError,
    RunFinished,
    RunStarted,
    SpecCancel,
    SpecClaim,
    SpecEffect,
    SpecLaunch,
    SpecPeek,
    SpecRefused,
    ToolFinished,
    ToolStarted,
    TurnFinished,
    TurnStarted,
)

if TYPE_CHECKING:
    from .trace import Event, Trace

SUB_MODEL_TOOLS = frozenset({"llm_query", "llm_query_batched"})
"""Tools whose calls are drawn in the sub-model lanes rather than with the other tool calls."""

_PID = 1
_FIXED_LANES = {"run": 1, "root model": 2, "root tokens": 3, "shadow": 4, "code blocks": 5,
                "block execution": 6}
_SHADOW_TYPES = (SpecPeek, SpecLaunch, SpecClaim, SpecCancel, SpecEffect, SpecRefused)


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
    calls: dict[str, list[tuple[float, float | None, dict[str, Any]]]] = {
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
        match event.payload:
            case RunStarted():
                open_spans["run",] = event
            case RunFinished():
                span("run", "run", open_spans.pop(("run",), event), event)
            case TurnStarted(turn=turn):
                open_spans["turn", turn] = event
                chars = 0
            case TurnFinished(turn=turn):
                span("root model", f"turn {turn + 1}", open_spans.pop(("turn", turn), event),
                     event)
            case DeltaEvent(chars=count):
                instant("root tokens", "delta", event)
                chars += count
                out.append({"name": "root chars", "ph": "C", "ts": _us(event.t), "pid": _PID,
                            "tid": lanes["root tokens"], "args": {"chars": chars}})
            case BlockOpenedEvent(turn=turn, block=block):
                open_spans["block", turn, block] = event
            case BlockClosedEvent(turn=turn, block=block):
                start = open_spans.pop(("block", turn, block), event)
                span("code blocks", _block_label(turn, block), start, event)
            case ExecStarted(turn=turn, block=block):
                open_spans["exec", turn, block] = event
            case ExecFinished(turn=turn, block=block):
                start = open_spans.pop(("exec", turn, block), event)
                span("block execution", _block_label(turn, block), start, event)
            case ToolStarted(mode=mode, call_id=call_id):
                open_spans["tool", mode, call_id] = event
            case ToolFinished(mode=mode, call_id=call_id, tool=tool):
                started = open_spans.pop(("tool", mode, call_id), None)
                if started is not None:
                    calls[_call_lane(tool, mode)].append(
                        (started.t, event.t, {**started.data, **event.data}))
            case SpecPeek() | SpecLaunch() | SpecClaim() | SpecCancel() | SpecEffect() \
                    | SpecRefused():
                instant("shadow", _shadow_label(event.payload), event)
            case RunError():
                instant("run", "error", event)
    for key, start in open_spans.items():  # cut short: close at the end of the trace
        payload = start.payload
        if isinstance(payload, ToolStarted):
            calls[_call_lane(payload.tool, payload.mode)].append((start.t, None, start.data))
        elif isinstance(payload, RunStarted):
            span("run", "run", start, None)
        elif isinstance(payload, TurnStarted):
            span("root model", f"turn {payload.turn + 1}", start, None)
        elif isinstance(payload, BlockOpenedEvent):
            span("code blocks", _block_label(payload.turn, payload.block), start, None)
        elif isinstance(payload, ExecStarted):
            span("block execution", _block_label(payload.turn, payload.block), start, None)
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


@dataclass(frozen=True)
class Span:
    """One bar of the timeline: ``label`` from ``start`` to ``end`` (seconds into the run)."""

    lane: Literal["generation", "sync call", "early call", "execution"]
    label: str
    """``t<turn>`` for a generation, the tool for a call, ``t<turn>b<block>`` for a block."""
    start: float
    end: float


def timeline(trace: Trace) -> list[Span]:
    """The run's timeline: each turn's generation (its start to its last delta) first, then the
    tool calls (authoritative or early) and block executions, in the order they ended."""
    spans = [Span("generation", f"t{turn}", start, stop)
             for turn, (start, stop) in _generations(trace).items()]
    started: dict[tuple, float] = {}
    for event in trace.events:
        match event.payload:
            case ToolStarted(mode=mode, call_id=call_id):
                started[mode, call_id] = event.t
            case ToolFinished(mode=mode, call_id=call_id, tool=tool) \
                    if (mode, call_id) in started:
                lane = "early call" if mode == "early" else "sync call"
                spans.append(Span(lane, tool, started.pop((mode, call_id)), event.t))
            case ExecStarted(turn=turn, block=block):
                started["exec", turn, block] = event.t
            case ExecFinished(turn=turn, block=block):
                start = started.pop(("exec", turn, block), event.t)
                spans.append(Span("execution", f"t{turn}b{block}", start, event.t))
    return spans


def _generations(trace: Trace) -> dict[int, tuple[float, float]]:
    """``{turn: (start, last delta)}``."""
    start: dict[int, float] = {}
    last: dict[int, float] = {}
    for event in trace.events:
        match event.payload:
            case TurnStarted(turn=turn):
                start[turn] = event.t
            case DeltaEvent(turn=turn):
                last[turn] = event.t
    return {turn: (t0, last.get(turn, t0)) for turn, t0 in start.items()}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    """Event data as JSON-safe values (what json cannot write becomes its repr)."""
    return json.loads(json.dumps(data, default=repr))


def _block_label(turn: int, block: int) -> str:
    return f"turn {turn + 1} block {block + 1}"


def _call_lane(tool: str, mode: str) -> str:
    if tool in SUB_MODEL_TOOLS:
        return "sub-model"
    return "early calls" if mode == "early" else "tool calls"


def _shadow_label(payload: Any) -> str:
    match payload:
        case SpecPeek(lines=lines):
            return f"shadow run ({lines} lines)"
        case SpecLaunch(tool=tool, early_id=early_id):
            return f"launch {tool} #{early_id}"
        case SpecClaim(tool=tool, early_id=early_id):
            return f"claim {tool} ({'miss' if early_id is None else 'hit'})"
        case SpecCancel(early_id=early_id, reason=reason):
            return f"cancel #{early_id} ({reason})"
        case SpecEffect():
            return "effect barrier"
    return f"refused {payload.tool}"


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
