"""Draft-model drafting: a smaller causal LM with the target's tokenizer proposes k tokens.

The draft model runs on the same forward and KV cache kind as the target: one sequence, one
block table (`SequenceCache`). Which tokens that cache holds is tracked as a list
(`ModelDrafter.cached`), so rolling back rejected draft tokens, or reusing the common prefix of
the previous request, is a matter of comparing token lists: nothing is recomputed that is
still valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentrt.kernels import probs_from_logits, sample

from ..llama import SequenceCache, Transformer, synchronize
from .base import Draft, DrafterDefaults, DraftSampling, best_time


class ModelDrafter(DrafterDefaults):
    """Drafts with a small model (e.g. ``Transformer.truncated(n)``: a layer-skip drafter).

    Greedy by default (deterministic drafts, ``Draft.probs is None``); call `begin` with a
    temperature > 0 to sample drafts from the draft model's own distribution, with the same
    temperature / top-k / top-p as the target, and get ``Draft.probs`` for rejection sampling.
    The model keeps one sequence cache for all requests (`cached`).
    """

    name = "draft"
    lookup = False

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.cache = SequenceCache(model)
        self.cached: list[int] = []
        """Tokens whose keys/values sit in the cache, at positions 0..len-1."""
        self._cost: float | None = None

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> "ModelDraftState":
        """Start a request; ``sampling`` applies to this request's drafts (None: greedy)."""
        s = sampling or DraftSampling()
        return ModelDraftState(self, prompt_ids, s.temperature, s.top_k, s.top_p, s.generator)

    def draft_cost(self, context: int = 64) -> float:
        """Seconds of one single-token forward of the draft model (best of 5, measured once at
        a short context, whatever ``context``; its cache is left for the next request to
        refill)."""
        if self._cost is None:
            device = self.model.device
            with torch.inference_mode():
                self.cache(torch.zeros(1, 64, dtype=torch.long, device=device), 0, "last")
                token = torch.zeros(1, 1, dtype=torch.long, device=device)
                self._cost = best_time(lambda: (self.cache(token, 64, "last"), synchronize(device)))
            self.cached.clear()
        return self._cost

    def remember(self, token_ids: Sequence[int]) -> None:
        """Ignored: a draft model has no corpus."""
        return None

    def reset(self) -> None:
        """Forget which tokens the draft model's cache holds (the next request recomputes its
        whole prompt); the measured draft cost stays."""
        self.cached.clear()


class ModelDraftState:
    """One request's view of the draft model."""

    def __init__(self, drafter: ModelDrafter, prompt_ids: Sequence[int], temperature: float,
                 top_k: int, top_p: float, generator: torch.Generator | None) -> None:
        self.drafter = drafter
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = generator
        _truncate_to_common_prefix(drafter.cached, self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens; cache entries of rejected draft tokens become invalid."""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in token_ids)
        cached = self.drafter.cached
        if len(cached) > start:
            _truncate_to_common_prefix(cached, self.tokens, start)

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens from the draft model (fewer near its max_seq_len)."""
        k = min(k, self.drafter.cache.max_len - len(self.tokens))
        if k <= 0 or not self.tokens:
            return Draft([])
        cached = self.drafter.cached
        if len(cached) >= len(self.tokens):  # need the logits after the last token: re-feed it
            del cached[len(self.tokens) - 1:]
        device = self.drafter.model.device
        pending = self.tokens[len(cached):]
        logits = self._forward(pending)
        out: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if self.temperature > 0:
                p = probs_from_logits(logits, self.temperature, self.top_k, self.top_p)
                u = torch.rand(1, generator=self.generator).to(device)
                token = int(sample(p[None], u)[0])
                probs.append(p)
            else:
                token = int(logits.argmax())
            out.append(token)
            if i + 1 < k:
                logits = self._forward([token])
        return Draft(out, torch.stack(probs) if probs else None)

    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        cached = self.drafter.cached
        tokens = torch.tensor([token_ids], dtype=torch.long, device=self.drafter.model.device)
        logits = self.drafter.cache(tokens, len(cached), "last")[0, -1]
        cached.extend(token_ids)
        return logits

    def end(self) -> None:
        """Nothing to learn; the cache stays for prefix reuse by the next request."""
        return None


def _truncate_to_common_prefix(cached: list[int], tokens: Sequence[int], start: int = 0) -> None:
    """Cut ``cached`` to its common prefix with ``tokens`` (both agree before ``start``)."""
    limit = min(len(cached), len(tokens))
    i = start
    while i < limit and cached[i] == tokens[i]:
        i += 1
    del cached[i:]
