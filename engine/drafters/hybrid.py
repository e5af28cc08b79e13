"""`hybrid`: per step the suffix lookup's draft or a model drafter's (the learned head, or the
target's int8 twin), whichever is expected to pay more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Draft, Drafter, DrafterDefaults, DrafterState, DraftSampling, DraftSlots
from .suffix import SuffixDrafter

if TYPE_CHECKING:
    import torch


class HybridDrafter(DrafterDefaults):
    """Per step, the suffix lookup's draft or ``model``'s: `drafting.choose_drafts` compares
    the expected tokens per second of each (the lookup's acceptance by match length, the
    model's with its measured cost per token). Without adaptive k, the lookup drafts when it
    matched at least `min_match` tokens. ``name``: ``"hybrid"`` with the head, else
    ``"hybrid-" + model.name``. What the model drafter declares (features, acceptance prior,
    writes to the target's cache) holds for the hybrid."""

    lookup = False
    hybrid = True

    def __init__(self, model: Drafter, suffix: SuffixDrafter | None = None, min_match: int = 4):
        self.model = model
        self.suffix = suffix or SuffixDrafter()
        self.min_match = min_match
        self.features = model.features
        self.acceptance_prior = model.acceptance_prior
        self.writes_target_cache = model.writes_target_cache
        self.name = "hybrid" if model.name == "eagle" else f"hybrid-{model.name}"

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> HybridState:
        return HybridState(self, self.suffix.begin(prompt_ids, sampling),
                           self.model.begin(prompt_ids, sampling))

    def draft_cost(self, context: int = 64) -> float:
        """The model drafter's cost per drafted token (lookups cost nothing)."""
        return self.model.draft_cost(context)

    def draft_many(self, states: Sequence[HybridState], ks: Sequence[int],
                   slots: Sequence[DraftSlots | None]) -> list[Draft]:
        """The model drafter's drafts of several requests."""
        return self.model.draft_many([s.model for s in states], ks, slots)

    def remember(self, token_ids: Sequence[int]) -> None:
        self.suffix.remember(token_ids)

    def reset(self) -> None:
        self.suffix.reset()
        self.model.reset()


class HybridState:
    """One request's lookup and model states, fed together."""

    def __init__(self, drafter: HybridDrafter, lookup: DrafterState, model: DrafterState):
        self.drafter, self.lookup, self.model = drafter, lookup, model
        self.min_match = drafter.min_match

    def extend(self, token_ids: Sequence[int]) -> None:
        self.lookup.extend(token_ids)
        self.model.extend(token_ids)

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        self.model.add_features(start, rows)

    def lookup_draft(self, k: int) -> Draft:
        """The suffix lookup's proposal (with its match length)."""
        return self.lookup.draft(k)

    def model_draft(self, k: int) -> Draft:
        """The model drafter's proposal (a drafter that writes the target's cache drafts only
        through `HybridDrafter.draft_many`)."""
        return self.model.draft(k)

    def draft(self, k: int) -> Draft:
        """The lookup's draft when it matched at least ``min_match`` tokens, else the model's."""
        found = self.lookup.draft(k)
        if found.tokens and found.match_len >= self.min_match:
            return found
        return self.model.draft(k)

    def end(self) -> None:
        self.lookup.end()
        self.model.end()
