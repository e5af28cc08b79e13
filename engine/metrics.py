"""Decoding metrics, per generation and aggregated per engine, and the batching engine's step
metrics.

Names follow the usual conventions: a *verify step* is one target forward that checks a draft
(or, with no drafter, produces one token). Each step yields the accepted draft tokens plus
one token from the target (a correction, or the bonus token when the whole draft was accepted),
so the mean acceptance length is ``tau = (accepted_tokens + verify_steps) / verify_steps``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeMetrics:
    """How one generation (or, merged, an engine's generations) was decoded: verify steps,
    drafted and accepted tokens per position, the time split, and the batching engine's
    per-request queueing and prefix-cache figures."""

    generated_tokens: int = 0
    verify_steps: int = 0
    drafts: int = 0
    """Verify steps that checked a non-empty draft."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """``accepted_per_position[i]``: drafts whose token ``i`` was accepted."""
    drafted_per_position: list[int] = field(default_factory=list)
    """``drafted_per_position[i]``: drafts that had a token ``i``."""
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    lossy: bool = False
    """True when a relaxed (inexact) acceptance rule was used."""
    queue_s: float = 0.0
    """Time from submission until the request first got KV blocks (batching engines)."""
    cached_tokens: int = 0
    """Prompt tokens whose keys/values came from the prefix cache instead of a prefill."""
    prefill_tokens: int = 0
    """Prompt tokens run through the model (recomputations after preemption included)."""
    preemptions: int = 0
    """Times the request gave its KV blocks back to more urgent ones and waited again."""

    @property
    def tau(self) -> float:
        """Mean tokens produced per verify step (accepted + the target's own token)."""
        if self.verify_steps == 0:
            return 0.0
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.wall_s - self.prefill_s
        return self.generated_tokens / decode_s if decode_s > 0 else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Acceptance rate of draft position i, given the draft reached position i."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    def record_step(self, drafted: int, accepted: int) -> None:
        """Account one verify step that checked ``drafted`` tokens and accepted ``accepted``."""
        self.verify_steps += 1
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            _grow(self.drafted_per_position, drafted)
            _grow(self.accepted_per_position, drafted)
            for i in range(drafted):
                self.drafted_per_position[i] += 1
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    def merge(self, other: "DecodeMetrics") -> None:
        """Add ``other`` into this one (for per-engine aggregates)."""
        for name in (
            "generated_tokens", "verify_steps", "drafts", "draft_tokens", "accepted_tokens",
            "wall_s", "prefill_s", "draft_s", "verify_s", "sample_s", "queue_s",
            "cached_tokens", "prefill_tokens", "preemptions",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
        ):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.lossy = self.lossy or other.lossy

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            tokens_per_s=self.tokens_per_s,
            position_acceptance=self.position_acceptance,
        )
        return d


@dataclass
class BatchMetrics:
    """How a batching engine's steps went: batch sizes over time, queueing, the prefix cache."""

    steps: int = 0
    rows: int = 0
    """Token rows run through the model, over all steps (prefill chunks and drafts included)."""
    sequences: int = 0
    """Sum over steps of the sequences in the step (``sequences / steps`` = mean batch size)."""
    max_batch: int = 0
    requests: int = 0
    """Requests admitted (first admissions only)."""
    queue_s: float = 0.0
    """Total time requests waited before their first admission."""
    prefill_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    """Cached blocks reused for other tokens."""
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    """``(seconds since the engine started, sequences, rows, prompt rows)`` of recent steps
    (the last 4096); ``rows - prompt rows`` are decode rows (last tokens and drafts)."""

    @property
    def mean_batch(self) -> float:
        return self.sequences / self.steps if self.steps else 0.0

    @property
    def mean_queue_s(self) -> float:
        return self.queue_s / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_batch=self.mean_batch, mean_queue_s=self.mean_queue_s)
        return d


def _grow(values: list[int], size: int) -> None:
    if len(values) < size:
        values.extend([0] * (size - len(values)))
