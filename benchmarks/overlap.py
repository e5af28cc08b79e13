"""The overlap limit: how fast a run could be if every tool call started the moment it could.

A call *could* start when (a) the text of its line has streamed and (b) its inputs are available,
i.e. the calls it depends on have finished. The limit replays the run on that schedule:

- generation of each turn takes what it took (the replay schedule is fixed), and a turn starts
  when the previous turn's blocks are done;
- call ``c`` starts at ``max(turn_start + text_time(c), finish(d) for d in deps(c))`` and lasts as
  long as it lasted in the sequential run; a block is done when its text has streamed and its
  calls have finished; a turn ends when its stream has ended and its blocks are done (or, for
  the turn that calls FINAL, when that block is done).

Inputs come from two traces of the same scripted run. The sequential trace gives each call's
line, block and duration and each line's streaming time. Dependencies come from the speculative
trace: the shadow reports, for every early launch, the early calls whose values flowed into it or
that it had to wait for; a claim maps early calls to the authoritative calls. A call that was never
launched early is taken to depend on every call before it (a conservative choice: it can only
make the limit later).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from agentrt.trace import Trace


@dataclass
class _Call:
    seq: int
    turn: int
    block: int
    lineno: int | None
    duration: float
    deps: set[int] | None = None
    """Authoritative call numbers this one needs; ``None`` = all earlier calls."""


@dataclass
class _Turn:
    line_times: dict[tuple[int, int], float] = field(default_factory=dict)
    """(block, line) -> seconds after turn start when that line's newline streamed."""
    block_close: dict[int, float] = field(default_factory=dict)
    stream_end: float = 0.0
    final_block: int | None = None


def _turns(trace: Trace) -> dict[int, _Turn]:
    turns: dict[int, _Turn] = defaultdict(_Turn)
    start: dict[int, float] = {}
    text: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for e in trace.events:
        d = e.data
        if e.kind == "turn_started":
            start[d["turn"]] = e.t
        elif e.kind == "delta":
            text[d["turn"]].append((e.t - start[d["turn"]], d["text"]))
        elif e.kind == "block_closed":
            turns[d["turn"]].block_close[d["block"]] = e.t - start[d["turn"]]
        elif e.kind == "exec_finished" and d.get("final"):
            turns[d["turn"]].final_block = d["block"]
    for turn, pieces in text.items():
        info = turns[turn]
        info.stream_end = pieces[-1][0] if pieces else 0.0
        _line_times(pieces, info)
    return turns


def _line_times(pieces: list[tuple[float, str]], info: _Turn) -> None:
    """Time at which each line of each fenced block finished streaming."""
    block, line, in_block = -1, 0, False
    current = ""
    for t, piece in pieces:
        for ch in piece:
            current += ch
            if ch != "\n":
                continue
            stripped = current.strip()
            if not in_block and stripped.startswith("```") and len(stripped) > 3:
                in_block, block, line = True, block + 1, 0
            elif in_block and stripped == "```":
                in_block = False
            elif in_block:
                line += 1
                info.line_times[(block, line)] = t
            current = ""


def _calls(seq_trace: Trace, spec_trace: Trace | None) -> list[_Call]:
    calls: list[_Call] = []
    started: dict[int, tuple] = {}
    for e in seq_trace.events:
        d = e.data
        if e.kind == "tool_started" and d.get("mode") == "sync":
            started[d["call_id"]] = (e.t, d.get("turn", 0), d.get("block", 0), d.get("lineno"))
        elif e.kind == "tool_finished" and d.get("mode") == "sync":
            t0, turn, block, lineno = started.pop(d["call_id"])
            calls.append(_Call(len(calls), turn, block, lineno, e.t - t0))
    if spec_trace is not None:
        early_to_seq: dict[int, int] = {}
        for e in spec_trace.events:
            if e.kind == "spec_claim" and e.data.get("early_id") is not None:
                early_to_seq[e.data["early_id"]] = e.data["seq"]
        for e in spec_trace.events:
            if e.kind == "spec_launch":
                seq = early_to_seq.get(e.data["early_id"])
                if seq is not None and seq < len(calls):
                    calls[seq].deps = {
                        early_to_seq[d] for d in e.data.get("deps", ()) if d in early_to_seq
                    }
    return calls


def overlap_limit(spec_trace: Trace | None, seq_trace: Trace) -> float:
    """The limit wall time (seconds) of the run the traces describe."""
    turns = _turns(seq_trace)
    calls = _calls(seq_trace, spec_trace)
    finish: dict[int, float] = {}
    by_turn: dict[int, list[_Call]] = defaultdict(list)
    for c in calls:
        by_turn[c.turn].append(c)
    first_turn = seq_trace.of("turn_started")
    t_start = first_turn[0].t if first_turn else 0.0  # start-up is the same in every mode
    for turn in sorted(turns):
        info = turns[turn]
        block_done: dict[int, float] = {}
        for c in by_turn.get(turn, []):
            text_t = info.line_times.get((c.block, c.lineno or 0))
            if text_t is None:
                text_t = info.block_close.get(c.block, info.stream_end)
            deps = c.deps if c.deps is not None else set(range(c.seq))
            start = max([t_start + text_t] + [finish[d] for d in deps if d in finish])
            finish[c.seq] = start + c.duration
            block_done[c.block] = max(block_done.get(c.block, 0.0), finish[c.seq])
        done = t_start
        for b, closed in sorted(info.block_close.items()):
            done = max(done, t_start + closed, block_done.get(b, 0.0))
            block_done[b] = done
        if info.final_block is not None:
            t_end = block_done.get(info.final_block, t_start + info.stream_end)
        else:
            t_end = max(done, t_start + info.stream_end)
        t_start = t_end
    return t_start


def generation_spans(trace: Trace) -> dict[int, tuple[float, float]]:
    """``{turn: (start, last delta)}``: when each turn's generation ran (seconds into the run)."""
    start: dict[int, float] = {}
    last: dict[int, float] = {}
    for e in trace.events:
        if e.kind == "turn_started":
            start[e.data["turn"]] = e.t
        elif e.kind == "delta":
            last[e.data["turn"]] = e.t
    return {turn: (t0, last.get(turn, t0)) for turn, t0 in start.items()}
