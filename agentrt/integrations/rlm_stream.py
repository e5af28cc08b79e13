"""The root-stream hook: the RLM's root model streams into an agentrt environment.

The stock RLM asks its root model for whole responses and runs a response's ```` ```repl ````
blocks once it is complete. `root_stream` makes the root's completions stream for the length of
one ``RLM.completion``: while the RLM's thread waits for the root, every text delta is fed to the
environment (whose shadow interpreter starts the calls the code will make); the RLM still gets
the same whole response, with its usage, and runs it as before.

Streaming needs a client built on the ``openai`` package (rlms' ``openai``, ``vllm``,
``openrouter``, ``vercel`` and ``azure_openai`` backends): its ``chat.completions.create`` is
asked for a stream (usage included) on the RLM's thread only, so sub-model calls made through
the same client by other threads are untouched. With any other client the whole response is fed
at once when it arrives (speculation then overlaps only the block's own execution).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


class StreamTarget(Protocol):
    """What the hook feeds (an `AgentrtREPL`)."""

    def begin_stream(self) -> None: ...
    def feed(self, delta: str) -> None: ...
    def end_stream(self) -> None: ...


@dataclass
class _Feed:
    """Where the current root completion streams to, and whether the hooked client fed it."""

    environment: StreamTarget
    fed: bool = False


_feeding: contextvars.ContextVar[_Feed | None] = contextvars.ContextVar("agentrt_rlm_feeding",
                                                                        default=None)


@contextlib.contextmanager
def root_stream(lm_handler: Any, environment: StreamTarget) -> Iterator[None]:
    """Within the block, ``lm_handler.completion`` (the RLM's calls to its root) streams into
    ``environment``. ``lm_handler`` is the RLM's ``LMHandler`` for one completion."""

    def completion(prompt: Any, model: str | None = None) -> str:
        streams = _make_streaming(lm_handler.get_client(model))
        environment.begin_stream()
        feed = _Feed(environment) if streams else None
        token = _feeding.set(feed)
        try:
            text = original(prompt, model)
        finally:
            _feeding.reset(token)
        if not (feed is not None and feed.fed) and text:
            environment.feed(text)
        environment.end_stream()
        return text

    original = lm_handler.completion
    lm_handler.completion = completion
    try:
        yield
    finally:
        lm_handler.__dict__.pop("completion", None)


def _make_streaming(client: Any) -> bool:
    """Wrap the client's ``chat.completions.create`` (once); False if it has none."""
    completions = getattr(getattr(getattr(client, "client", None), "chat", None),
                          "completions", None)
    create = getattr(completions, "create", None)
    if create is None:
        return False
    if getattr(create, "agentrt_streaming", False):
        return True

    def streaming_create(*args: Any, **kwargs: Any) -> Any:
        feed = _feeding.get()
        if feed is None or kwargs.get("stream"):
            return create(*args, **kwargs)
        feed.fed = True
        return _streamed_completion(create, feed.environment.feed, args, kwargs)

    streaming_create.agentrt_streaming = True  # type: ignore[attr-defined]
    completions.create = streaming_create
    return True


def _streamed_completion(create: Callable[..., Any], feed: Callable[[str], None],
                         args: tuple, kwargs: dict) -> Any:
    """Ask for a stream, feed its text, and return what the non-streamed call would have."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice
    from openai.types.completion_usage import CompletionUsage

    stream = create(*args, **{**kwargs, "stream": True,
                              "stream_options": {"include_usage": True}})
    pieces: list[str] = []
    finish, usage, ident, model, created = None, None, "", kwargs.get("model", ""), 0
    try:
        for chunk in stream:
            ident, model, created = chunk.id or ident, chunk.model or model, chunk.created or created
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.index != 0:
                    continue
                text = choice.delta.content if choice.delta is not None else None
                if text:
                    pieces.append(text)
                    feed = _fed_safely(feed, text)
                if choice.finish_reason:
                    finish = choice.finish_reason
    finally:
        stream.close()
    if usage is None:
        log.warning("the root model's server sent no usage with its stream: token counts of "
                    "the RLM's root are 0 for this response")
        usage = CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
    message = ChatCompletionMessage.model_construct(role="assistant", content="".join(pieces))
    return ChatCompletion.model_construct(
        id=ident, object="chat.completion", created=created or int(time.time()), model=model,
        choices=[Choice.model_construct(index=0, finish_reason=finish or "stop",
                                        message=message, logprobs=None)],
        usage=usage)


def _fed_safely(feed: Callable[[str], None], text: str) -> Callable[[str], None]:
    """Feed ``text``; if the environment fails, stop feeding (the response itself goes on)."""
    try:
        feed(text)
    except Exception as exc:
        log.warning("the agentrt environment stopped taking the root's stream: %s", exc)
        return lambda _text: None
    return feed
