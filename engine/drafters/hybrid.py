"""`hybrid`: per step the suffix lookup's draft or a model drafter's (the learned head, or the
target's int8 twin), whichever is expected to pay more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Draft, Drafter, DrafterState, DraftSampling
from .suffix import SuffixDrafter

if TYPE_CHECKING:
    import torch


class HybridDrafter:
    """Per step, the suffix lookup's draft or ``model``'s: `draft_policy.choose_drafts` compares
    the expected tokens per second of each (the lookup's acceptance by match length, the
    model's with its measured cost per token). Without adaptive k, the lookup drafts when it
    matched at least `min_match` tokens. ``name``: ``"hybrid"`` with the head, else
    ``"hybrid-" + model.name``."""

    lookup = False
    hybrid = True

    def __init__(self, model: Drafter, suffix: SuffixDrafter | None = None, min_match: int = 4):
        self.model = model
        self.suffix = suffix or SuffixDrafter()
        self.features: tuple[int, ...] = tuple(getattr(model, "features", ()))
        """The target layers the model drafter reads (the head's; none for the twin)."""
        self.min_match = min_match
        self.acceptance_prior: float | None = getattr(model, "acceptance_prior", None)
        """The model drafter's (see `TwinDrafter.acceptance_prior`)."""
        self.name = "hybrid" if model.name == "eagle" else f"hybrid-{model.name}"

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> HybridState:
        return HybridState(self, self.suffix.begin(prompt_ids, sampling),
                           self.model.begin(prompt_ids, sampling))

    def draft_cost(self, context: int = 64) -> float:
        """The model drafter's cost per drafted token (lookups cost nothing)."""
        return self.model.draft_cost(context)

    def draft_many(self, states: Sequence[HybridState], ks: Sequence[int]) -> list[Draft]:
        """The model drafter's drafts of several requests (batched where it can batch them)."""
        many = getattr(self.model, "draft_many", None)
        if many is not None:
            return many([s.model for s in states], ks)
        return [s.model.draft(k) for s, k in zip(states, ks)]

    def remember(self, token_ids: Sequence[int]) -> None:
        self.suffix.remember(token_ids)

    def reset(self) -> None:
        self.suffix.reset()
        self.model.reset()


class HybridState:
    """One request's lookup and model states, fed together."""

    def __init__(self, drafter: HybridDrafter, lookup: DrafterState, model: DrafterState):
        self.drafter, self.lookup, self.model = drafter, lookup, model

    def extend(self, token_ids: Sequence[int]) -> None:
        self.lookup.extend(token_ids)
        self.model.extend(token_ids)

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        self.model.add_features(start, rows)

    def attach(self, request: object) -> None:
        """Hand the request to a model state that drafts in its KV blocks (the twin's)."""
        attach = getattr(self.model, "attach", None)
        if attach is not None:
            attach(request)

    def lookup_draft(self, k: int) -> Draft:
        """The suffix lookup's proposal (with its match length)."""
        return self.lookup.draft(k)

    def model_draft(self, k: int) -> Draft:
        """The model drafter's proposal."""
        return self.model.draft(k)

    def draft(self, k: int) -> Draft:
        """The lookup's draft when it matched at least ``min_match`` tokens, else the model's."""
        found = self.lookup.draft(k)
        if found.tokens and found.match_len >= self.drafter.min_match:
            return found
        return self.model.draft(k)

    def end(self) -> None:
        self.lookup.end()
        self.model.end()
