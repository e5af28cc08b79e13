"""What every drafter speaks: a `Draft`, a `Drafter` (one per engine) and its per-request state."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is only needed by model drafters; keep this import cheap
    import torch


@dataclass
class Draft:
    """Tokens proposed to continue the sequence; empty when there is nothing to propose."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    """``[len(tokens), V]`` draft distribution (model drafters only); ``None`` = deterministic."""
    match_len: int = 0
    """For lookup drafters: how many tokens of context the proposal matched (0 = not a lookup).
    Longer matches are accepted more often; adaptive k keeps its estimates per match length."""


@runtime_checkable
class DrafterState(Protocol):
    """A drafter's view of one request."""

    def extend(self, token_ids: Sequence[int]) -> None:
        """Tokens appended to the sequence (accepted output)."""
        ...

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens continuing the current sequence."""
        ...

    def end(self) -> None:
        """The request finished."""
        ...


@dataclass(frozen=True)
class DraftSampling:
    """How a request samples, for drafters that sample their drafts (model drafters); lookup
    drafters ignore it."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens; `begin` makes the per-request state, `remember` feeds a
    cross-request corpus.

    What the engine needs to schedule drafts is part of the protocol: ``lookup`` and
    `draft_cost` (so the engine never asks which class a drafter is). Optional: ``features``,
    target layer indices whose input the engine then captures in its forward and hands to each
    request's state as ``state.add_features(start_position, rows)`` (prompt rows, then the last
    token and accepted drafts of every verify step); ``hybrid`` True, for a state that offers
    ``lookup_draft(k)`` and ``model_draft(k)`` and lets `draft_policy.choose_drafts` choose;
    ``acceptance_prior``, the acceptance adaptive k assumes of a model draft before it has seen
    any; a state's ``attach(request)``, for a state that drafts in the request's own KV blocks
    (the engine hands it the request when it makes the state); ``draft_many(states, ks)``, the
    model drafts of several requests at once (a step's batch)."""

    name: str
    lookup: bool
    """True: a proposal is a table lookup (microseconds) that reports `Draft.match_len`, so the
    engine sees the draft before choosing k. False: every drafted token costs a model forward,
    so k is chosen first, at `draft_cost` per token."""

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> DrafterState:
        """Start a request whose sequence so far is ``prompt_ids``, sampled as ``sampling``
        (None: greedy)."""
        ...

    def draft_cost(self, context: int = 64) -> float:
        """Seconds one drafted token costs for a sequence of ``context`` positions (0.0 for
        lookups; a drafter whose cost hardly depends on it may ignore it)."""
        ...

    def remember(self, token_ids: Sequence[int]) -> None:
        """Offer tokens likely to be repeated later (earlier code cells)."""
        ...

    def reset(self) -> None:
        """Forget everything kept across requests (outputs, remembered text, cached tokens):
        afterwards the drafter proposes as a fresh one of the same configuration would."""
        ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def best_time(step: Callable[[], object], repeats: int = 5) -> float:
    """The shortest of ``repeats`` timed calls of ``step``, in seconds (a draft step's cost)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best
