"""A scripted OpenAI-compatible server on loopback: a root model and a sub-model, both paced.

``POST /v1/chat/completions`` (streaming and not) and ``GET /v1/models``:

* model ``root_model``: the reply is ``root(messages)`` -- by default the scripted response whose
  index is the number of assistant messages in the request (so an agent loop gets response 0,
  then 1, ... and every run of the same script gets the same replies). Its tokens
  (`agentrt.engine.replay.split_tokens`) come at ``tokens_per_second``; a non-streamed reply
  arrives whole after the same time, so streamed and whole replies take equally long. A response
  may be a list of text parts and `WaitForSubCalls` marks: a stream stops there until the
  sub-model has received that many requests since the root request started (early calls made
  while the root streams), or ``timeout_s`` passes; the wait is recorded in ``waits``;
* any other model: the sub-model, ``sub(prompt)`` after ``sub_latency_s`` (the prompt is the
  request's message contents joined by newlines).

Usage is reported (chunk with ``stream_options.include_usage``, or the ``usage`` field). The HTTP
side is `benchmarks.openai_stub.StubServer`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrt.engine.replay import split_tokens

from .openai_stub import BadRequest, Request, Response, StubServer

ROOT_MODEL = "scripted-root"
SUB_MODEL = "scripted-sub"


@dataclass(frozen=True)
class WaitForSubCalls:
    """In a streamed root response: pause until ``count`` sub-model requests have arrived since
    the root request started (at most ``timeout_s``)."""

    count: int = 1
    timeout_s: float = 30.0


Part = str | WaitForSubCalls
Script = str | Sequence[Part]


@dataclass
class Wait:
    """What happened at one `WaitForSubCalls` mark."""

    wanted: int
    arrived: int
    waited_s: float

    @property
    def satisfied(self) -> bool:
        return self.arrived >= self.wanted


def _echo(prompt: str) -> str:
    return f"reply to: {prompt[:60]}"


class ScriptedServer(StubServer):
    """``with ScriptedServer(responses) as server:`` -- ``server.base_url`` is the ``/v1`` URL."""

    def __init__(self, responses: Sequence[Script] = (), sub: Callable[[str], str] = _echo,
                 tokens_per_second: float = 200.0, sub_latency_s: float = 0.2,
                 root: Callable[[list[dict[str, Any]]], Script] | None = None,
                 root_model: str = ROOT_MODEL) -> None:
        super().__init__(model=None, models=[root_model, SUB_MODEL])
        self.responses = responses
        self.sub = sub
        self.tokens_per_second = tokens_per_second
        self.sub_latency_s = sub_latency_s
        self.root = root
        self.root_model = root_model
        self.waits: list[Wait] = []
        self.sub_prompts: list[str] = []
        self.root_requests = 0
        self._cond = threading.Condition()

    # -- replies -------------------------------------------------------------------------------

    def script_for(self, messages: list[dict[str, Any]]) -> list[Part]:
        """The root's reply to ``messages`` as parts."""
        if self.root is not None:
            script = self.root(messages)
        else:
            turn = sum(1 for m in messages if m.get("role") == "assistant")
            if turn >= len(self.responses):
                raise LookupError(f"the script has {len(self.responses)} responses; "
                                  f"turn {turn} has none")
            script = self.responses[turn]
        return [script] if isinstance(script, str) else list(script)

    def sub_reply(self, prompt: str) -> str:
        with self._cond:
            self.sub_prompts.append(prompt)
            self._cond.notify_all()
        time.sleep(self.sub_latency_s)
        return self.sub(prompt)

    def play_root(self, parts: list[Part], emit: Callable[[str], None] | None) -> tuple[str, int]:
        """Pace the root's reply: ``emit`` each token (None: whole, after the same time)."""
        with self._cond:
            self.root_requests += 1
            subs_before = len(self.sub_prompts)
        start, released, text = time.monotonic(), 0, []
        for part in parts:
            if isinstance(part, WaitForSubCalls):
                if emit is not None:
                    waited = self._wait_for_subs(subs_before + part.count, part.timeout_s)
                    start += waited  # the pause does not count against the token schedule
                continue
            for piece in split_tokens(part):
                due = start + released / self.tokens_per_second
                released += 1
                if emit is not None:
                    time.sleep(max(0.0, due - time.monotonic()))
                    emit(piece)
                text.append(piece)
        if emit is None:
            time.sleep(max(0.0, start + released / self.tokens_per_second - time.monotonic()))
        return "".join(text), released

    def _wait_for_subs(self, wanted: int, timeout_s: float) -> float:
        started = time.monotonic()
        with self._cond:
            self._cond.wait_for(lambda: len(self.sub_prompts) >= wanted, timeout_s)
            arrived = len(self.sub_prompts)
        waited = time.monotonic() - started
        self.waits.append(Wait(wanted, arrived, waited))
        return waited

    def respond(self, request: Request, response: Response) -> None:
        """The root's paced script or the sub-model's reply, streamed or whole."""
        messages = request.messages()
        prompt = request.prompt()
        prompt_tokens = len(split_tokens(prompt))
        is_root = request.model == self.root_model
        if is_root:
            try:
                parts = self.script_for(messages)
            except LookupError as exc:
                raise BadRequest(str(exc)) from exc
        if request.stream:
            response.open_stream()
            if is_root:
                _, tokens = self.play_root(parts, response.piece)
            else:
                text = self.sub_reply(prompt)
                response.piece(text)
                tokens = len(split_tokens(text))
            response.finish("stop")
            if request.include_usage:
                response.usage(prompt_tokens, tokens)
            response.close_stream()
            return
        if is_root:
            text, tokens = self.play_root(parts, None)
        else:
            text = self.sub_reply(prompt)
            tokens = len(split_tokens(text))
        response.complete(text, "stop", prompt_tokens, tokens)
