"""`ForcedEngine`: scripted replies streamed through the native engine by teacher forcing.

Each call to `stream` takes the next scripted reply and runs it as an ordinary request of the
given `NativeEngine` (same scheduler, batching, prefix cache, priorities, KV cache, drafter and
adaptive k), whose prompt is the real chat, except that at every verify step the target's token
at each position is the script's instead of the model's choice: a draft token is accepted iff it
equals the scripted token there, and the correction or bonus token is the next scripted token.
The script is the tokenizer's encoding of the reply followed by the end-of-turn token, so the
step a model would spend producing end of sequence is paid too. Every step is a real forward at
the real context length, so the time and the acceptance length τ are what the engine would take
had the model written that text: the benchmark of a realistic program that a small model cannot
write itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from .base import BaseEngine, Delta, EngineError, Message, SamplingParams
from .metrics import DecodeMetrics

if TYPE_CHECKING:  # the native engine needs torch; keep this import cheap
    from .native import NativeEngine


class ForcedEngine(BaseEngine):
    """Streams ``responses`` in order, one per `stream` call, through ``engine`` by teacher forcing.

    The streamed text equals the scripted reply exactly, cut like any generation by
    ``params.max_tokens`` (finish ``"length"``) and ``params.stop``; otherwise it ends with
    ``"stop"`` after the script. Sampling parameters other than those and ``priority`` have no
    effect (the script decides every token). Usage and `DecodeMetrics` are the native engine's, and
    count in its `NativeEngine.metrics`. A call past the last response raises `EngineError`.

    ``engine`` stays the caller's: `aclose` leaves it open (it may serve other runs; clear what
    they leave behind with `NativeEngine.reset`). Under `Agent`, pass a ``sub_engine`` (e.g.
    ``engine`` itself): by default the agent's ``llm_query`` calls go to its main engine and
    would take scripted responses too.
    """

    name = "forced"

    def __init__(self, engine: NativeEngine, responses: Sequence[str]) -> None:
        if isinstance(responses, str):
            raise TypeError("responses must be a sequence of replies, not one string")
        self.engine = engine
        self.responses: tuple[str, ...] = tuple(responses)
        self.calls = 0
        """`stream` calls so far (the index of the next response)."""

    async def stream(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> AsyncIterator[Delta]:
        """Stream the next scripted reply as the native engine's answer to ``messages``."""
        index = self.calls
        self.calls += 1
        if index >= len(self.responses):
            raise EngineError(
                f"ForcedEngine has {len(self.responses)} scripted responses; call {index + 1} has none"
            )
        deltas = self.engine.stream(messages, params, forced_text=self.responses[index])
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    def remember(self, text: str) -> None:
        """Offer ``text`` to the native engine's drafter, as a live run would."""
        self.engine.remember(text)

    def metrics(self) -> DecodeMetrics:
        """The native engine's metrics (every request it served, forced or not)."""
        return self.engine.metrics()
