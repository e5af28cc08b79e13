"""Self-distillation data for a draft head: the target's own replies and its hidden states.

`generate_samples` has the target answer every training prompt (greedy, or sampled for a share
of them) on the batched native engine, which records, as it runs the prompt and each reply
token, the target's residual stream entering the head's three feature layers (a
`FeatureRecorder` in the drafter's place; no token is drafted). On the CPU kernels each row's
result depends only on its own sequence, so these are exactly the features of one prefill pass
over prompt + reply (`record_features`, which the tests compare them with).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import SamplingParams
from ..drafters.base import Draft, DrafterDefaults, DraftSampling
from ..llama import SeqRows, Transformer
from .training_prompts import Messages


@dataclass
class Sample:
    """One training sequence (prompt + reply)."""

    tokens: Tensor
    """``[L]`` token ids (the reply ends with the end-of-turn token when it stopped)."""
    features: Tensor
    """``[L - 1, 3 * hidden]`` bfloat16: the target's residual stream entering the feature
    layers at every position but the last."""
    labels: Tensor
    """``[L]``: the target's token after each position (its reply), -1 inside the prompt."""
    prompt_len: int


class FeatureRecorder(DrafterDefaults):
    """Takes a drafter's place in a `NativeEngine` to record the features of ``layers`` of
    every request (`recording`); it never drafts."""

    name = "record"
    lookup = False

    def __init__(self, layers: Sequence[int]):
        self.features = tuple(layers)
        self.recordings: dict[tuple[int, ...], _Recording] = {}

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> _Recording:
        state = _Recording(prompt_ids)
        self.recordings[tuple(prompt_ids)] = state
        return state

    def draft_cost(self, context: int = 64) -> float:
        return 0.0

    def remember(self, token_ids: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        self.recordings.clear()

    def sample(self, prompt_ids: Sequence[int]) -> Sample:
        """The finished request with this prompt as a `Sample` (and forget it)."""
        state = self.recordings.pop(tuple(prompt_ids))
        tokens = torch.tensor(state.tokens)
        features = torch.cat(state.rows)[:len(state.tokens) - 1]
        if features.shape[0] != len(state.tokens) - 1:
            raise RuntimeError(f"recorded {features.shape[0]} feature rows for "
                               f"{len(state.tokens)} tokens")
        labels = torch.full_like(tokens, -1)
        p = len(prompt_ids)
        labels[p - 1:-1] = tokens[p:]
        return Sample(tokens, features, labels, p)


class _Recording:
    def __init__(self, prompt_ids: Sequence[int]):
        self.tokens = [int(t) for t in prompt_ids]
        self.rows: list[Tensor] = []
        self.next = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in token_ids)

    def add_features(self, start: int, rows: Tensor) -> None:
        if start > self.next:
            raise RuntimeError(f"features from position {start}, expected {self.next} (the "
                               "recording engine must run without a prefix cache)")
        rows = rows[self.next - start:]
        self.rows.append(rows.to(torch.bfloat16))
        self.next += rows.shape[0]

    def draft(self, k: int) -> Draft:
        return Draft([])

    def end(self) -> None:
        return None


def generate_samples(engine, recorder: FeatureRecorder, prompts: Sequence[Messages],
                     max_tokens: int, sampled_share: float, seed: int,
                     on_done: Callable[[int, Sample], None], skip: set[int] = frozenset(),
                     temperature: float = 0.8) -> None:
    """Run every prompt not in ``skip`` on ``engine`` (a `NativeEngine` whose drafter is
    ``recorder``, without prefix cache; all at once: it batches them), greedy except every
    prompt whose index falls in the ``sampled_share`` (sampled at ``temperature``, seeded);
    calls ``on_done(index, sample)`` as each finishes (on the caller's thread)."""
    every = round(1 / sampled_share) if sampled_share > 0 else 0

    async def one(i: int, messages: Messages) -> None:
        sampled = every > 0 and i % every == every - 1
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature if sampled else 0.0,
                                seed=seed + i)
        async for _ in engine.stream(messages, params):
            pass
        on_done(i, recorder.sample(engine.tokenizer.encode_chat(messages)))

    async def run() -> None:
        await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts) if i not in skip))

    asyncio.run(run())


def record_features(model: Transformer, tokens: Sequence[int], layers: Sequence[int],
                    chunk: int = 512) -> tuple[Tensor, Tensor]:
    """``(features[L, len(layers) * hidden] bfloat16, argmax labels[L])`` of one sequence, from
    prefill passes of at most ``chunk`` tokens."""
    n = len(tokens)
    block = 64
    pool = model.new_pool(-(-n // block), block)
    table = torch.arange(pool.num_blocks, dtype=torch.int32)
    ids = torch.tensor(list(tokens), dtype=torch.long)
    feats, labels = [], []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            part = ids[start:start + chunk]
            logits, f = model(part, [SeqRows(start, part.numel(), table)], pool, capture=layers)
            feats.append(f.to(torch.bfloat16))
            labels.append(logits.argmax(-1))
    return torch.cat(feats), torch.cat(labels)


def draft_vocabulary(samples: Sequence[Sample], coverage: float, minimum: int = 256) -> list[int]:
    """The most frequent label tokens covering ``coverage`` of all labels (at least
    ``minimum`` tokens when that many occur), as sorted target ids."""
    labels = torch.cat([s.labels for s in samples])
    counts = torch.bincount(labels[labels >= 0])
    order = torch.argsort(counts, descending=True, stable=True)
    ordered = counts[order]
    total = int(ordered.sum())
    cum = torch.cumsum(ordered, 0)
    size = int((cum < coverage * total).sum()) + 1
    size = max(size, min(minimum, int((ordered > 0).sum())))
    return sorted(order[:size].tolist())
