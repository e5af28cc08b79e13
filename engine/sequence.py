"""One request inside the native engine's batch: its tokens, KV blocks, sampling and output state.

A `RequestState` is the unit the scheduler moves between *waiting* and *running*. Its tokens are
the prompt followed by every accepted output token; ``computed`` counts the leading tokens whose
keys and values sit in its blocks. A step feeds ``tokens[computed:]`` (a prefill chunk, or the
last token plus a draft) and, when that reaches the last known token, samples what follows.
Being preempted only drops its blocks (``computed = 0``): the next admission recomputes them
(mostly from the prefix cache), with the same results.

A *forced* request carries a script (``RequestState.forced``): its verify steps take the script's
tokens as the target's (`forced_verify`) instead of reading them from the logits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from .base import Message, SamplingParams
from .metrics import SpecMetrics
from .tokenizer import ChatTokenizer, StopStringMatcher


@dataclass
class Job:
    """A request as submitted to the engine's worker."""

    messages: list[Message]
    params: SamplingParams
    emit: Callable[[object], bool]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    prompt_ids: list[int] | None = None
    """The prompt's token ids when the caller has already rendered them (None: the worker
    renders ``messages``)."""
    forced_text: str | None = None
    """A scripted reply to teacher-force instead of the model's choices (see `forced_verify`)."""


class OutputText:
    """Turns accepted tokens into text deltas; applies EOS, stop strings and max_tokens."""

    def __init__(self, tokenizer: ChatTokenizer, params: SamplingParams):
        self.detok = tokenizer.detokenizer()
        self.stop = StopStringMatcher(params.stop)
        self.eos = tokenizer.eos_token_ids
        self.max_tokens = params.max_tokens
        self.token_ids: list[int] = []
        self.hit_eos = False

    def add(self, tokens: Seq[int]) -> tuple[str, list[int], str | None]:
        """``(text, token_ids, finish_reason)`` for the next accepted tokens."""
        parts: list[str] = []
        ids: list[int] = []
        for token in tokens:
            if token in self.eos:
                self.hit_eos = True
                return "".join(parts) + self._tail(), ids, "stop"
            ids.append(token)
            self.token_ids.append(token)
            text, stopped = self.stop.push(self.detok.push([token]))
            parts.append(text)
            if stopped:
                return "".join(parts), ids, "stop"
            if len(self.token_ids) >= self.max_tokens:
                return "".join(parts) + self._tail(), ids, "length"
        return "".join(parts), ids, None

    def finish(self) -> str:
        """Text still held back when generation ends for another reason (max_seq_len)."""
        return self._tail()

    def _tail(self) -> str:
        text, stopped = self.stop.push(self.detok.flush())
        return text if stopped else text + self.stop.flush()


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


class RequestState:
    """The engine-side state of one request (see the module docstring)."""

    def __init__(self, job: Job, prompt: list[int], arrival: int, uniforms: Uniforms,
                 out: OutputText, metrics: SpecMetrics):
        self.job = job
        self.params = job.params
        self.priority = job.params.priority
        self.arrival = arrival
        self.prompt_len = len(prompt)
        self.tokens: list[int] = list(prompt)
        self.computed = 0
        self.blocks: list[int] = []
        self.chain = 0
        """Content id of the last indexed block of this sequence (`KVPool.register`)."""
        self.indexed = 0
        """Leading blocks already in the prefix index."""
        self.uniforms = uniforms
        self.out = out
        self.metrics = metrics
        self.state = None
        """The proposer's per-request state (None: no speculation)."""
        self.forced: list[int] | None = None
        """The scripted output tokens, ending with the end-of-turn token (None: not forced)."""
        self.admitted_at: float | None = None

    @property
    def produced(self) -> int:
        """Output tokens so far (the index of the next one)."""
        return len(self.tokens) - self.prompt_len

    @property
    def decoding(self) -> bool:
        """All tokens but the last have keys and values: the next step decodes."""
        return self.computed == len(self.tokens) - 1

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then arrival."""
        return (self.priority, self.arrival)

    def block_table(self) -> torch.Tensor:
        """The block table as the forward takes it (int32)."""
        return torch.tensor(self.blocks, dtype=torch.int32)


def forced_verify(drafted: Seq[int], script: Seq[int], at: int) -> tuple[int, int]:
    """``(accepted, next_token)`` when the target's token at output position ``at + i`` is
    ``script[at + i]``: draft token i is accepted iff it and the draft tokens before it equal the
    script there, and the next token is the script's token after the accepted ones. Past its end
    the script reads as its last token (the end of turn, where the stream stops anyway)."""
    last = len(script) - 1
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == script[min(at + accepted, last)]:
        accepted += 1
    return accepted, script[min(at + accepted, last)]
