"""One request inside the native engine's batch: its tokens, KV blocks, sampling and output state.

A `RequestState` is the unit the scheduler moves between *waiting* and *running*. Its tokens are
the prompt followed by every accepted output token; ``computed`` counts the leading tokens whose
keys and values sit in its blocks. A step feeds ``tokens[computed:]`` (a prefill chunk, or the
last token plus a draft) and, when that reaches the last known token, samples what follows.
Being preempted only drops its blocks (``computed = 0``): the next admission recomputes them
(mostly from the prefix cache), with the same results.

A *forced* request carries a script (``RequestState.forced``): its verify steps take the script's
tokens as the target's (`verify.forced_verify`) instead of reading them from the logits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from .base import Message, SamplingParams
from .drafters.base import DrafterState
from .metrics import DecodeMetrics
from .tokenizer import ChatTokenizer, StopStringMatcher
from .verify import Uniforms

log = logging.getLogger(__name__)


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
    """A scripted reply to teacher-force instead of the model's choices (see
    `verify.forced_verify`)."""


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


class RequestState:
    """The engine-side state of one request (see the module docstring)."""

    def __init__(self, job: Job, prompt: list[int], arrival: int, uniforms: Uniforms,
                 out: OutputText, metrics: DecodeMetrics):
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
        self.state: DrafterState | None = None
        """The drafter's per-request state (None: no drafter, or not admitted yet)."""
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

    def end_drafting(self) -> None:
        """Tell the drafter the request is over (a drafter's bookkeeping never fails it)."""
        if self.state is not None:
            try:
                self.state.end()
            except Exception:
                log.exception("drafter state failed to end")
