"""`ForcedSubModel`: the simulated sub-model's answers, teacher-forced through a native engine.

Each ``llm_query`` prompt becomes an ordinary request of a `NativeEngine` (the root's own, in the
runner: see docs/oolong.md), so its prompt is really prefilled, batched with the requests beside
it and served from the prefix cache where it shares a prefix with earlier ones. Its answer is the
text the simulated deployment would reply (`server.Oracle.reply`, the same function and seeded
errors), streamed by teacher forcing: one real forward per verify step, drafts from the engine's
drafter accepted iff they match the answer. The answers, hence the program's results and score,
are the simulated sub-model's exactly; the time and τ are the engine's.

The engine's metrics count every request it serves; `tally` holds one sub-model's sub-calls (those
that finished) and ``shared`` every forced sub-call on the engine, whichever run made it, so the
runner can tell the root's counters from the sub-calls' even when several runs share the engine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from agentrt.engine.base import (BaseEngine, Delta, EngineError, Message, SamplingParams,
                                 check_messages)
from agentrt.engine.metrics import DecodeMetrics

from .server import Oracle

_SHARED_LOCK = threading.Lock()


def snapshot(shared: DecodeMetrics) -> DecodeMetrics:
    """A copy of a ``shared`` tally, taken under its lock."""
    with _SHARED_LOCK:
        copy = DecodeMetrics()
        copy.merge(shared)
        return copy


if TYPE_CHECKING:  # the native engine needs torch; keep this import cheap
    from agentrt.engine.native import NativeEngine


class ForcedSubModel(BaseEngine):
    """Answers each prompt with ``oracle.reply(prompt)``, forced through ``engine``.

    The prompt is the messages' contents joined by newlines, as the simulated server reads a
    request. ``engine`` stays the caller's: `aclose` leaves it open.
    """

    name = "forced-sub"

    def __init__(self, engine: NativeEngine, oracle: Oracle,
                 shared: DecodeMetrics | None = None) -> None:
        self.engine = engine
        self.oracle = oracle
        self.shared = shared
        """Where every forced sub-call on ``engine`` is merged too (read it with `snapshot`)."""
        self.tally = DecodeMetrics()
        """The finished sub-calls' metrics, merged (prompt, prefill and cached tokens included)."""
        self.calls = 0
        """Sub-calls that finished."""
        self.prompt_tokens = 0
        """Their prompts' tokens (prefilled or from the prefix cache)."""
        self._lock = threading.Lock()

    async def stream(self, messages: Sequence[Message],
                     params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """Stream the oracle's answer to ``messages`` as the native engine's reply."""
        prompt = "\n".join(m["content"] for m in check_messages(messages))
        answer = self.oracle.reply(prompt)
        deltas = self.engine.stream(messages, params, forced_text=answer)
        streamed = []
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                streamed.append(delta.text)
                if delta.finish_reason is not None:
                    self._count(delta)
                    if "".join(streamed) != answer:  # cut at max_tokens or the context's end
                        raise EngineError(
                            f"forced sub-call ended ({delta.finish_reason}) before the simulated "
                            f"answer's end: {len(''.join(streamed))} of {len(answer)} characters")
                yield delta

    def _count(self, last: Delta) -> None:
        with self._lock:
            self.calls += 1
            if last.usage is not None:
                self.prompt_tokens += last.usage.prompt_tokens
            if last.metrics is not None:
                self.tally.merge(last.metrics)
        if last.metrics is not None and self.shared is not None:
            with _SHARED_LOCK:
                self.shared.merge(last.metrics)

    def counters(self) -> dict[str, float | int | None]:
        """The sub-calls so far: calls, prompt / prefilled / cached tokens, answer tokens, verify
        steps, drafted and accepted tokens, τ and the summed request time."""
        with self._lock:
            m = self.tally
            return {"calls": self.calls, "prompt_tokens": self.prompt_tokens,
                    "prefill_tokens": m.prefill_tokens, "cached_tokens": m.cached_tokens,
                    "generated_tokens": m.generated_tokens, "verify_steps": m.verify_steps,
                    "draft_tokens": m.draft_tokens, "accepted_tokens": m.accepted_tokens,
                    "tau": m.tau if m.verify_steps else None, "wall_s": m.wall_s,
                    "preemptions": m.preemptions}

    def metrics(self) -> DecodeMetrics:
        """The sub-calls' metrics (not the whole engine's)."""
        with self._lock:
            snapshot = DecodeMetrics()
            snapshot.merge(self.tally)
            return snapshot
