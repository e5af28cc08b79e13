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


class FeatureState(DrafterState, Protocol):
    """The state of a drafter with `Drafter.features`: it reads the target's features."""

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        """The target's captured features at positions ``start ..`` (prompt rows, then the last
        token and the accepted drafts of every verify step)."""
        ...


class HybridState(DrafterState, Protocol):
    """The state of a drafter with `Drafter.hybrid`: a lookup and a model drafter side by side,
    between which `drafting.choose_drafts` chooses per step."""

    min_match: int
    """With a fixed draft length, the lookup drafts when it matched at least this many tokens
    (else the model)."""

    def lookup_draft(self, k: int) -> Draft:
        """The lookup's proposal (with its match length)."""
        ...

    def model_draft(self, k: int) -> Draft:
        """The model drafter's proposal."""
        ...


@dataclass(frozen=True)
class DraftSlots:
    """Where a drafter that writes the target's KV cache (`Drafter.writes_target_cache`) may
    put one request's drafts this step: positions ``start .. start + room - 1`` of the block
    table ``blocks``, which the step's verify forward writes again before any row reads them.
    The committed positions before ``start`` hold the target's keys and values."""

    start: int
    """The position of the request's last token (the first drafted token's input)."""
    blocks: torch.Tensor
    """The request's block table (int32), holding at least ``start + room`` positions."""
    room: int
    """The most tokens it may draft."""


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

    What the engine needs to schedule and feed a drafter is declared here, so the engine never
    asks which class a drafter is: ``lookup``, ``hybrid``, ``features``, ``acceptance_prior``,
    ``writes_target_cache``, `draft_cost` and `draft_many`. `DrafterDefaults` gives the usual
    values of all but ``name``, ``lookup``, `begin` and `draft_cost`."""

    name: str
    lookup: bool
    """True: a proposal is a table lookup (microseconds) that reports `Draft.match_len`, so the
    engine sees the draft before choosing k. False: every drafted token costs a model forward,
    so k is chosen first, at `draft_cost` per token, and the drafts run through `draft_many`."""
    hybrid: bool
    """True: the states are `HybridState` (a lookup and a model drafter), and
    `drafting.choose_drafts` picks one of the two per request and step."""
    features: tuple[int, ...]
    """Target layer indices whose input the engine captures in its forward and hands to each
    request's state (a `FeatureState`); empty: none."""
    acceptance_prior: float | None
    """The acceptance adaptive k assumes of a model draft before it has seen any (None: its
    default)."""
    writes_target_cache: bool
    """True: model drafts write keys and values in the request's own KV blocks, at the
    `DraftSlots` the step reserved for them (`draft_many` gets them)."""

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> DrafterState:
        """Start a request whose sequence so far is ``prompt_ids``, sampled as ``sampling``
        (None: greedy)."""
        ...

    def draft_cost(self, context: int = 64) -> float:
        """Seconds one drafted token costs for a sequence of ``context`` positions (0.0 for
        lookups; a drafter whose cost hardly depends on it may ignore it)."""
        ...

    def draft_many(self, states: Sequence[DrafterState], ks: Sequence[int],
                   slots: Sequence[DraftSlots | None]) -> list[Draft]:
        """The model drafts of a step's requests: up to ``ks[i]`` tokens for ``states[i]``, in
        ``slots[i]`` where the drafter writes the target's cache (None elsewhere)."""
        ...

    def remember(self, token_ids: Sequence[int]) -> None:
        """Offer tokens likely to be repeated later (earlier code cells)."""
        ...

    def reset(self) -> None:
        """Forget everything kept across requests (outputs, remembered text, cached tokens):
        afterwards the drafter proposes as a fresh one of the same configuration would. A
        drafter that cannot raises `NotImplementedError`."""
        ...


class DrafterDefaults:
    """The usual answers to `Drafter`'s declarations, for a drafter to inherit: no captured
    features, no acceptance prior, no hybrid states, no writes to the target's cache, each
    state drafting alone in `draft_many`, no corpus, and no `reset` (it raises)."""

    hybrid = False
    features: tuple[int, ...] = ()
    acceptance_prior: float | None = None
    writes_target_cache = False

    def draft_many(self, states: Sequence[DrafterState], ks: Sequence[int],
                   slots: Sequence[DraftSlots | None]) -> list[Draft]:
        """Each state's own `DrafterState.draft`."""
        return [state.draft(k) for state, k in zip(states, ks)]

    def remember(self, token_ids: Sequence[int]) -> None:
        """Ignored: no corpus."""
        return None

    def reset(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot forget its cross-request state")


def missing_members(drafter: object) -> list[str]:
    """The `Drafter` members ``drafter`` lacks (empty for a drafter)."""
    members = ("name", "lookup", "hybrid", "features", "acceptance_prior", "writes_target_cache",
               "begin", "draft_cost", "draft_many", "remember", "reset")
    return [name for name in members if not hasattr(drafter, name)]


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
