"""Drafting with a learned head (`engine.eagle.DraftHead`).

The head reads the target's features, so the engine captures them in its forward (the layers in
`EagleDrafter.features`) and hands each request's rows to its state (`EagleState.add_features`):
every prompt position, and after a verify step the last token and the accepted drafts. The head
keeps its own keys and values per request (`HeadCache`); drafting k tokens extends them
temporarily and rolls back, and the target's features of the accepted tokens replace the head's
own guesses at the next step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from agentrt.kernels import probs_from_logits, sample

from ..eagle.head import DraftHead, HeadCache
from .base import Draft, DrafterDefaults, DraftSampling, best_time, common_prefix


class EagleDrafter(DrafterDefaults):
    """Drafts chains of tokens with a trained head over ``embed`` (the target's embedding).

    Greedy requests get the head's argmax; sampled ones sample the head's distribution (over
    its draft vocabulary, mapped to target ids; other tokens have probability 0) and report it
    as ``Draft.probs`` for rejection sampling."""

    name = "eagle"
    lookup = False

    def __init__(self, head: DraftHead, embed: torch.Tensor,
                 weights_dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.head = copy.deepcopy(head).eval()
        """A copy of ``head``, its matrices in ``weights_dtype`` for drafting (None: as given)."""
        if weights_dtype is not None:
            self.head.prepare_drafting(weights_dtype)
        self.embed = embed
        self.features: tuple[int, ...] = tuple(head.config.aux_layers)
        """The target layers whose input the engine captures for this drafter."""
        self.target_ids = head.target_ids()
        self._cost: float | None = None
        self.kept: list[tuple[list[int], HeadCache]] = []
        """The head caches of the last `KEEP` finished requests, with their tokens."""

    KEEP = 8

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> EagleState:
        """Start a request; its head cache starts with what a finished request computed for
        the longest prefix they share (as the target's prefix cache skips those positions)."""
        state = EagleState(self, prompt_ids, sampling or DraftSampling())
        best, best_end = None, 0
        for tokens, cache in self.kept:
            end = min(cache.end, common_prefix(tokens, state.tokens) - 1)  # the pair at p reads the token at p + 1
            if end > max(best_end, cache.start):
                best, best_end = cache, end
        if best is not None:
            state.cache = best.copy_until(best_end)
        return state

    def keep(self, tokens: list[int], cache: HeadCache) -> None:
        """Remember a finished request's head cache (the oldest of `KEEP` is dropped)."""
        self.kept.append((tokens, cache))
        del self.kept[:-self.KEEP]

    def draft_cost(self, context: int = 64) -> float:
        """Seconds of one drafted token (one head step after 64 positions, best of 5; the
        head's own cache is short, so ``context`` is not used)."""
        if self._cost is None:
            c = self.head.config
            with torch.inference_mode():
                cache = HeadCache.empty(c, 128)
                h = torch.zeros(64, c.hidden_size)
                self.head.extend(cache, h, h)

                def step() -> None:
                    cache.length = 64
                    with one_thread():
                        out = self.head.extend(cache, h[:1], self.embed[:1].float())
                        int(self.head.logits(out).argmax())

                self._cost = best_time(step)
        return self._cost

    def remember(self, token_ids: Sequence[int]) -> None:
        """Ignored: the head has no corpus."""
        return None

    def reset(self) -> None:
        """Forget the kept head caches."""
        self.kept.clear()


class EagleState:
    """One request's head: its cache, the target features not yet run, its last output."""

    def __init__(self, drafter: EagleDrafter, prompt_ids: Sequence[int], sampling: DraftSampling):
        self.drafter = drafter
        self.sampling = sampling
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.cache = HeadCache.empty(drafter.head.config)
        self.pending: list[torch.Tensor] = []
        """Target feature rows for positions ``cache.end ..`` not run through the head yet."""
        self.last_out: torch.Tensor | None = None
        """The head's output at position ``cache.end - 1`` (predicts the token after the last)."""

    def extend(self, token_ids: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in token_ids)

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        """The target's features ``rows[n, 3 * hidden]`` at positions ``start ..``. Positions
        already seen are skipped (a preempted request recomputes them); a gap (a prompt prefix
        served from the KV cache) restarts the head's cache at ``start``."""
        expected = self.cache.end + sum(p.shape[0] for p in self.pending)
        if start > expected:
            self.cache.restart(start)
            self.pending.clear()
            self.last_out = None
        elif start < expected:
            rows = rows[expected - start:]
        if rows.shape[0]:
            self.pending.append(rows)

    def _catch_up(self) -> bool:
        """Run the pending features whose next token is known; True when the head's last
        output is at the position before the last token (ready to draft)."""
        if self.pending:
            feats = torch.cat(self.pending)
            n = min(feats.shape[0], len(self.tokens) - 1 - self.cache.end)
            if n > 0:
                head = self.drafter.head
                nxt = torch.tensor(self.tokens[self.cache.end + 1:self.cache.end + 1 + n])
                e = F.embedding(nxt, self.drafter.embed).float()
                out = head.extend(self.cache, head.fuse(feats[:n]), e)
                self.last_out = out[-1:]
                feats = feats[n:]
            self.pending = [feats] if feats.shape[0] else []
        return self.last_out is not None and self.cache.end == len(self.tokens) - 1

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens from the head (none until its features reach the last token)."""
        if k <= 0 or not self._catch_up():
            return Draft([])
        with one_thread():  # one-row steps: waking a second thread costs more than it saves
            return self._draft(k)

    def _draft(self, k: int) -> Draft:
        head, s = self.drafter.head, self.sampling
        target_ids = self.drafter.target_ids
        keep = self.cache.length
        out, tokens, probs = self.last_out, [], []
        try:
            for i in range(k):
                logits = head.logits(out)[0]
                if s.temperature > 0:
                    full = torch.full((head.config.target_vocab_size,), float("-inf"))
                    full[target_ids] = logits
                    p = probs_from_logits(full, s.temperature, s.top_k, s.top_p)
                    token = int(sample(p[None], torch.rand(1, generator=s.generator))[0])
                    probs.append(p)
                else:
                    token = int(target_ids[int(logits.argmax())])
                tokens.append(token)
                if i + 1 < k:
                    e = F.embedding(torch.tensor([token]), self.drafter.embed).float()
                    out = head.extend(self.cache, out, e)
        finally:
            self.cache.length = keep
        return Draft(tokens, torch.stack(probs) if probs else None)

    def end(self) -> None:
        """Offer the head cache to later requests with the same prefix."""
        if self.cache.length:
            self.drafter.keep(self.tokens, self.cache)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops on one thread inside (restoring the setting after)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
