"""Drafting with the target's own int8 twin, in the request's own KV blocks.

`Transformer.int8_twin` is the target in int8 precision (llama.cpp's arithmetic class): it
picks the exact target's next token almost every time, at well under half its step cost. Unlike
a separate draft model it keeps no cache of its own: it reads the keys and values the target
wrote for the committed positions and writes its own at the positions it drafts, in the
request's blocks (a scratch block of its own where the request has none yet). The verify
forward that follows writes every one of those positions again before any row reads them, so
nothing the twin wrote reaches an output. No prompt prefill, and nothing to catch up on after a
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from agentrt.kernels import probs_from_logits, sample

from ..llama import SeqRows, Transformer
from .base import Draft, DraftSampling, best_time

if TYPE_CHECKING:
    from ..kv_cache import KVPool


class DecodingRequest(Protocol):
    """What the twin reads of a request (`engine.sequence.RequestState` has it)."""

    tokens: list[int]
    computed: int
    """Positions whose keys and values the target has written."""
    blocks: list[int]


class TwinDrafter:
    """Drafts with ``twin`` (the target's `Transformer.int8_twin`) over the engine's ``pool``.

    Greedy requests get the twin's argmax; sampled ones sample its distribution with the
    request's temperature / top-k / top-p and report it as ``Draft.probs``."""

    name = "twin"
    lookup = False
    acceptance_prior = 0.95
    """What adaptive k assumes of a drafted token before it has seen any: int8 picks the exact
    target's next token at ~96% of positions (docs/engine.md), the twin's drafts were accepted
    at 98-99% on the benchmark prompts."""

    COST_CONTEXTS = (64, 512)
    """The sequence lengths `draft_cost` is measured at (a line through the two)."""

    def __init__(self, twin: Transformer, pool: KVPool) -> None:
        self.model = twin
        self.pool = pool
        scratch = pool.allocate()
        if scratch is None:
            raise ValueError("drafter='twin' needs one KV block of its own; the cache has none left")
        self.scratch = scratch
        """A block the twin writes drafts into where the request has no block yet."""
        self._cost: tuple[tuple[int, float], tuple[int, float]] | None = None

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> TwinState:
        """Start a request; it drafts once `TwinState.attach` gave it the request."""
        return TwinState(self, sampling or DraftSampling())

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

    def draft_many(self, states: Sequence[TwinState], ks: Sequence[int]) -> list[Draft]:
        """The drafts of several requests (up to ``ks[i]`` tokens for ``states[i]``), one
        batched twin forward per draft position: the same tokens as drafting each alone (a
        row's result never depends on the rows beside it), for about the time of one. A
        request drafts nothing while it is not decoding or where its block at the draft
        position is shared; the scratch block serves the first request whose drafts run past
        its blocks, the others stop at the end of theirs."""
        plans = [None] * len(states)
        scratch_free = True
        pool, size = self.pool, self.pool.block_size
        for i, (state, k) in enumerate(zip(states, ks)):
            r = state.request
            if r is None or k <= 0 or r.computed != len(r.tokens) - 1:
                continue
            pos = r.computed
            first = pos // size
            table = list(r.blocks[:first + 1])
            if len(table) > first and not pool.exclusive(table[first]):
                continue
            if scratch_free and (len(table) <= first or (pos + k - 1) // size > first):
                table.append(self.scratch)
                scratch_free = False
            k = min(k, len(table) * size - pos)
            if k > 0:  # (first position, block table, tokens to draft)
                plans[i] = (pos, torch.tensor(table, dtype=torch.int32), k)
        tokens: list[list[int]] = [[state.request.tokens[-1]] if plan else []
                                   for state, plan in zip(states, plans)]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        depth = max((plan[2] for plan in plans if plan is not None), default=0)
        with torch.inference_mode():
            for d in range(depth):
                live = [i for i, plan in enumerate(plans) if plan is not None and plan[2] > d]
                rows = [SeqRows(plans[i][0] + d, 1, plans[i][1]) for i in live]
                logits = self.model(torch.tensor([tokens[i][-1] for i in live]), rows, pool)
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
    """One request's drafts: the twin run from the request's last token in its own blocks."""

    def __init__(self, drafter: TwinDrafter, sampling: DraftSampling) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.request: DecodingRequest | None = None

    def attach(self, request: DecodingRequest) -> None:
        """The request whose tokens, position and blocks the drafts read (the engine calls
        this when it gives the request its state)."""
        self.request = request

    def extend(self, token_ids: Sequence[int]) -> None:
        """Nothing to do: the request's own tokens and blocks are read at each draft."""
        return None

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens after the request's last one (none while it is not decoding, or
        where its block at the draft position is shared with another request)."""
        return self.drafter.draft_many([self], [k])[0]

    def end(self) -> None:
        self.request = None
