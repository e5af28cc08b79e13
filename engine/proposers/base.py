"""What every drafter speaks: a `Draft`, a `Proposer` (one per engine) and its per-request state."""

from __future__ import annotations

from collections.abc import Sequence
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
class ProposerState(Protocol):
    """A proposer's view of one request."""

    def extend(self, token_ids: Sequence[int]) -> None:
        """Tokens appended to the sequence (accepted output)."""
        ...

    def propose(self, k: int) -> Draft:
        """Up to ``k`` tokens continuing the current sequence."""
        ...

    def end(self) -> None:
        """The request finished."""
        ...


@runtime_checkable
class Proposer(Protocol):
    """A drafter; `begin` makes the per-request state, `remember` feeds a cross-request corpus."""

    name: str

    def begin(self, prompt_ids: Sequence[int]) -> ProposerState:
        """Start a request whose sequence so far is ``prompt_ids``."""
        ...

    def remember(self, token_ids: Sequence[int]) -> None:
        """Offer tokens likely to be repeated later (earlier code cells)."""
        ...
