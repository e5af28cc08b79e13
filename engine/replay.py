"""`ReplayEngine`: streams scripted responses at a set token rate (deterministic tests and benchmarks).

Tokenisation: text is cut into pieces the way a byte-level BPE pre-tokeniser does on code — a run of
letters (with its leading space), a run of up to three digits, a run of punctuation, a run of
whitespace — which gives roughly one token per 3–4 characters of Python. Token ``i`` of a response
is released at ``first_token_s + i / tokens_per_second`` after the request starts (an absolute
schedule, so slow consumers don't make the stream drift).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio

from .base import BaseEngine, Delta, EngineError, EngineStreamError, Message, SamplingParams, Usage

_PIECE = re.compile(r" ?[A-Za-z_]+| ?\d{1,3}| ?[^\sA-Za-z_\d]+|\s+(?!\S)|\s+")


def split_tokens(text: str) -> list[str]:
    """Cut ``text`` into replay tokens; ``"".join(split_tokens(t)) == t`` always."""
    return _PIECE.findall(text)


Responder = Callable[[Sequence[Message]], str]


class ReplayEngine(BaseEngine):
    """Streams scripted responses, one per call, at ``tokens_per_second``.

    ``responses`` is either a sequence of strings (the i-th call to `stream` gets the i-th) or a
    callable ``(messages) -> str``. ``fail_at`` maps a call index to a character offset at which that
    stream dies with `EngineStreamError` (to test recovery from a broken stream).
    """

    name = "replay"

    def __init__(
        self,
        responses: Sequence[str] | Responder,
        tokens_per_second: float = 50.0,
        *,
        first_token_s: float = 0.0,
        fail_at: dict[int, int] | None = None,
    ) -> None:
        if tokens_per_second <= 0:
            raise ValueError(f"tokens_per_second must be > 0, got {tokens_per_second}")
        self._responses = responses
        self.tokens_per_second = float(tokens_per_second)
        self.first_token_s = float(first_token_s)
        self.fail_at = dict(fail_at or {})
        self.calls = 0
        self.remembered: list[str] = []

    def _response_for(self, index: int, messages: Sequence[Message]) -> str:
        if callable(self._responses):
            return self._responses(messages)
        if index >= len(self._responses):
            raise EngineError(
                f"ReplayEngine has {len(self._responses)} scripted responses; call {index + 1} has none"
            )
        return self._responses[index]

    def remember(self, text: str) -> None:
        self.remembered.append(text)

    async def stream(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> AsyncIterator[Delta]:
        params = params or SamplingParams()
        index = self.calls
        self.calls += 1
        text = self._response_for(index, messages)
        text, finish = _apply_limits(text, params)
        pieces = split_tokens(text)
        fail_at = self.fail_at.get(index)
        start = time.monotonic()
        emitted = 0
        prompt_tokens = sum(len(split_tokens(m.get("content", ""))) for m in messages)
        for i, piece in enumerate(pieces):
            due = start + self.first_token_s + i / self.tokens_per_second
            delay = due - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            if fail_at is not None and emitted + len(piece) > fail_at:
                raise EngineStreamError(
                    f"replay stream {index} died after {emitted} characters (scripted failure)"
                )
            emitted += len(piece)
            yield Delta(text=piece)
        yield Delta(
            text="",
            finish_reason=finish,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(pieces)),
        )


def _apply_limits(text: str, params: SamplingParams) -> tuple[str, str]:
    """Cut ``text`` at the first stop string and at ``max_tokens`` replay tokens."""
    finish = "stop"
    cut = min((i for i in (text.find(s) for s in params.stop if s) if i >= 0), default=-1)
    if cut >= 0:
        text = text[:cut]
    pieces = split_tokens(text)
    if len(pieces) > params.max_tokens:
        text = "".join(pieces[: params.max_tokens])
        finish = "length"
    return text, finish
