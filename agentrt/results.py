"""What a run returns: `RunResult`, its per-turn records and statistics; `RunInterrupted`."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .trace import Trace

RunStatus = Literal["final", "max_turns", "error", "interrupted"]


@dataclass
class BlockRecord:
    """One executed code block."""

    code: str
    stdout: str = ""
    error: str | None = None
    started_s: float = 0.0
    finished_s: float = 0.0


@dataclass
class TurnRecord:
    """One model response and what its code did."""

    index: int
    response: str = ""
    blocks: list[BlockRecord] = field(default_factory=list)
    observation: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    started_s: float = 0.0
    finished_s: float = 0.0

    @property
    def code(self) -> str:
        return "\n\n".join(b.code for b in self.blocks)

    @property
    def output(self) -> str:
        return "".join(b.stdout for b in self.blocks)

    @property
    def error(self) -> str | None:
        errors = [b.error for b in self.blocks if b.error]
        return errors[-1] if errors else None


@dataclass
class RunStats:
    """Counters of one run. The speculation counters stay 0 with speculation off."""

    tool_calls: Counter = field(default_factory=Counter)
    """Tool invocations per tool name (early and authoritative alike)."""
    launched: int = 0
    """Early (speculative) tool calls started; ``launched == hits + wasted + retracted``."""
    hits: int = 0
    """Authoritative calls served by an early call."""
    misses: int = 0
    """Authoritative calls of speculatable tools that found no early call (or whose arguments
    were too large to launch early)."""
    wasted: int = 0
    """Early calls never claimed although the program made that call in their block (it was
    served by another early call, or ran before the early one could serve it)."""
    retracted: int = 0
    """Early calls never claimed because the program never made that call in their block (a
    guess from a half-written statement, a branch not taken)."""
    hidden_s: float = 0.0
    """Tool time that ran before the authoritative run asked for it, summed over the hits (each:
    from the early call's start to its end or to the claim, whichever came first)."""
    shadow_tool_calls_refused: int = 0
    """Real tool calls that arrived from a shadow process and were refused (always 0 unless
    a shadow escaped its launch logic)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tool_calls"] = dict(self.tool_calls)
        return d


@dataclass
class RunResult:
    """The outcome of `Agent.run`."""

    answer: Any
    status: RunStatus
    turns: list[TurnRecord]
    stats: RunStats
    wall_s: float
    trace: Trace
    error: str | None = None
    """Why the run stopped, when ``status`` is ``"error"`` or ``"interrupted"``: where it failed
    (``"turn 1, engine 'openai'"``, ``"turn 0, block 2, sandbox"``, ...), the exception's type and
    message."""
    namespace: dict[str, str] | None = None
    """The REPL's final variables (``"type: repr"``), with ``Agent(capture_namespace=True)``."""
    exception: BaseException | None = None
    """The exception behind ``error`` (with its traceback), when there is one."""

    @property
    def ok(self) -> bool:
        return self.status == "final"

    def to_dict(self) -> dict[str, Any]:
        """Everything but ``exception``, as plain data (``error`` describes it)."""
        return {
            "answer": self.answer,
            "status": self.status,
            "error": self.error,
            "wall_s": self.wall_s,
            "namespace": self.namespace,
            "stats": self.stats.to_dict(),
            "turns": [asdict(t) for t in self.turns],
            "trace": self.trace.to_dict(),
        }


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped `Agent.run_sync`; ``result`` is the run up to then (``status ==
    "interrupted"``, its turns and its trace, which ends with ``run_error`` and ``run_finished``)."""

    def __init__(self, result: RunResult) -> None:
        super().__init__("the run was interrupted (Ctrl-C); the run so far is in .result")
        self.result = result
