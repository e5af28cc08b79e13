"""Drafting with the target's own int8 twin, in the request's own KV blocks.

`Transformer.int8_twin` is the target in int8 precision (llama.cpp's arithmetic class): it
picks the exact target's next token almost every time, at well under half its step cost. Unlike
a separate draft model it keeps no cache of its own: it reads the keys and values the target
wrote for the committed positions and writes its own at the positions it drafts, the
`DraftSlots` the step plan reserved in the request's blocks for the rows it verifies. The verify
forward writes every one of those positions again before any row reads them, so nothing the
twin wrote reaches an output. No prompt prefill, and nothing to catch up on after a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from agentrt.kernels import probs_from_logits, sample

from ..llama import SeqRows, Transformer
from .base import Draft, DrafterDefaults, DraftSampling, DraftSlots, best_time

if TYPE_CHECKING:
    from ..kv_cache import KVPool


class TwinDrafter(DrafterDefaults):
    """Drafts with ``twin`` (the target's `Transformer.int8_twin`) in the slots a step reserves
    in ``pool`` (the target's).

    Greedy requests get the twin's argmax; sampled ones sample its distribution with the
    request's temperature / top-k / top-p and report it as ``Draft.probs``."""

    name = "twin"
    lookup = False
    writes_target_cache = True
    acceptance_prior = 0.95
    """What adaptive k assumes of a drafted token before it has seen any: int8 picks the exact
    target's next token at ~96% of positions (docs/engine.md, "int8 precision"), the twin's
    drafts were accepted at 95-99% on the benchmark prompts (docs/engine-results.md)."""

    COST_CONTEXTS = (64, 512)
    """The sequence lengths `draft_cost` is measured at (a line through the two)."""

    def __init__(self, twin: Transformer, pool: KVPool) -> None:
        self.model = twin
        self.pool = pool
        self._cost: tuple[tuple[int, float], tuple[int, float]] | None = None

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> TwinState:
        """Start a request (its drafts start from its last token)."""
        return TwinState(prompt_ids[-1] if prompt_ids else None, sampling or DraftSampling())

    def draft_cost(self, context: int = 64) -> float:
        """Seconds of one drafted token for a sequence of ``context`` positions: a one-row
        forward of the twin, measured once after each of `COST_CONTEXTS` positions (best of 5,
        on a pool of its own) and taken as linear in the context (its attention reads every
        position's keys and values, a larger share of its step than of the exact target's)."""
        if self._cost is None:
            short, long = (min(c, self.model.max_seq_len - 1) for c in self.COST_CONTEXTS)
            blocks = long // 64 + 1
            pool = self.model.new_pool(blocks, 64)
            table = torch.arange(blocks, dtype=torch.int32)

            def one_row(at: int) -> float:
                return best_time(lambda: int(self.model(
                    torch.zeros(1, dtype=torch.long), [SeqRows(at, 1, table)], pool)[0].argmax()))

            with torch.inference_mode():
                self.model(torch.zeros(long, dtype=torch.long), [SeqRows(0, long, table)], pool,
                           torch.tensor([long - 1]))
                self._cost = ((short, one_row(short)), (long, one_row(long)))
        (short, at_short), (long, at_long) = self._cost
        growth = max(at_long - at_short, 0.0) / max(long - short, 1)
        return at_short + growth * max(context - short, 0)

    def draft_many(self, states: Sequence[TwinState], ks: Sequence[int],
                   slots: Sequence[DraftSlots | None]) -> list[Draft]:
        """The drafts of several requests (up to ``ks[i]`` tokens for ``states[i]``, at most
        ``slots[i].room``; none without slots), one batched twin forward per draft position:
        the same tokens as drafting each alone (a row's result never depends on the rows beside
        it), for about the time of one."""
        plans = [(slot, min(k, slot.room)) if slot is not None and state.last is not None
                 else (None, 0) for state, k, slot in zip(states, ks, slots)]
        tokens: list[list[int]] = [[state.last] if k > 0 else [] for state, (_, k) in zip(states, plans)]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        depth = max((k for _, k in plans), default=0)
        with torch.inference_mode():
            for d in range(depth):
                live = [i for i, (_, k) in enumerate(plans) if k > d]
                rows = [SeqRows(plans[i][0].start + d, 1, plans[i][0].blocks) for i in live]
                logits = self.model(torch.tensor([tokens[i][-1] for i in live]), rows, self.pool)
                for row, i in enumerate(live):
                    s = states[i].sampling
                    if s.temperature > 0:
                        p = probs_from_logits(logits[row], s.temperature, s.top_k, s.top_p)
                        tokens[i].append(int(sample(p[None], torch.rand(1, generator=s.generator))[0]))
                        probs[i].append(p)
                    else:
                        tokens[i].append(int(logits[row].argmax()))
        return [Draft(t[1:], torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def remember(self, token_ids: Sequence[int]) -> None:
        """Ignored: the twin has no corpus."""
        return None

    def reset(self) -> None:
        """Nothing is kept across requests."""
        return None


class TwinState:
    """One request's last token and sampling: the twin drafts from there, in the step's slots."""

    def __init__(self, last: int | None, sampling: DraftSampling) -> None:
        self.last = last
        self.sampling = sampling

    def extend(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            self.last = int(token_ids[-1])

    def draft(self, k: int) -> Draft:
        """Nothing: the twin drafts only into the slots a step gives `TwinDrafter.draft_many`."""
        return Draft([])

    def end(self) -> None:
        return None
