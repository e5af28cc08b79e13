"""Verification: which drafted tokens a request keeps, and the token that follows them.

Per request, the target's logits over ``[last token, *draft]`` decide:

* temperature 0: `greedy_verify` (accept while the draft equals the target argmax);
* temperature > 0, deterministic drafts (n-gram, suffix): the target samples every position
  from pre-drawn uniforms indexed by *output position* (`Uniforms`), and the draft is accepted
  while it matches those samples. That accepts token x with probability p(x), exactly like
  rejection sampling against a one-hot draft, and makes a seeded run produce the same text with
  or without drafts, whatever k was;
* temperature > 0 with draft probabilities (draft model) or ``acceptance_threshold < 1``:
  `stochastic_verify` (rejection sampling; the threshold rule is lossy and reported so);
* a forced request (teacher forcing): the script is the target (`forced_verify`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentrt.kernels import greedy_verify, probs_from_logits, sample, stochastic_verify

from .base import SamplingParams
from .drafters.base import Draft


class Uniforms:
    """Pre-drawn uniforms indexed by output position (so seeded runs do not depend on k).

    Each stream is drawn in fixed blocks from its own generator, so ``residual[i]`` depends only
    on the seed and i, never on how many were drawn.
    """

    BLOCK = 64

    def __init__(self, seed: int, size: int, device: torch.device):
        self.residual = self._draw(seed, size).to(device)
        self.accept = self._draw(seed ^ 0x9E3779B97F4A7C15, size).to(device)
        self.draft_generator = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)

    @classmethod
    def _draw(cls, seed: int, size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        blocks = -(-size // cls.BLOCK)
        return torch.cat([torch.rand(cls.BLOCK, generator=gen) for _ in range(blocks)])


def verify(drafted: list[int], draft: Draft, logits: torch.Tensor, params: SamplingParams,
           uniforms: Uniforms, at: int, acceptance_threshold: float = 1.0) -> tuple[int, int]:
    """``(accepted, next_token)`` for ``drafted`` against the target's ``logits[1, k+1, V]``,
    the request's output position being ``at`` (see the module docstring for the rules)."""
    k = len(drafted)
    draft_ids = torch.tensor([drafted], dtype=torch.long, device=logits.device)
    if params.temperature == 0:
        accepted, token = greedy_verify(draft_ids, logits)
        return int(accepted[0]), int(token[0])
    probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
    exact_match = draft.probs is None and acceptance_threshold == 1.0
    if exact_match or k == 0:
        samples = sample(probs[0], uniforms.residual[at:at + k + 1]).tolist()
        accepted = 0
        while accepted < k and samples[accepted] == drafted[accepted]:
            accepted += 1
        return accepted, samples[accepted]
    draft_probs = None if draft.probs is None else draft.probs[None, :k].to(probs.device)
    accepted, token = stochastic_verify(
        draft_ids, draft_probs, probs, uniforms.accept[None, at:at + k],
        uniforms.residual[at:at + 1], acceptance_threshold)
    return int(accepted[0]), int(token[0])


def forced_verify(drafted: Sequence[int], script: Sequence[int], at: int) -> tuple[int, int]:
    """``(accepted, next_token)`` when the target's token at output position ``at + i`` is
    ``script[at + i]``: draft token i is accepted iff it and the draft tokens before it equal the
    script there, and the next token is the script's token after the accepted ones. Past its end
    the script reads as its last token (the end of turn, where the stream stops anyway)."""
    last = len(script) - 1
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == script[min(at + accepted, last)]:
        accepted += 1
    return accepted, script[min(at + accepted, last)]
