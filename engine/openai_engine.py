"""`OpenAIEngine`: any OpenAI-compatible streaming server (vLLM, SGLang, hosted APIs) over HTTP.

One `stream` call is one ``POST /v1/chat/completions`` (or ``/v1/completions``) with
``stream: true``; server-sent events are turned into `Delta` objects as they arrive.

Failure policy:

- connection errors, HTTP 5xx / 429 / 408 and streams that die *before any text was emitted* are
  retried ``max_retries`` times with exponential backoff (``backoff * 2**attempt``, capped at
  ``max_backoff``, or the server's ``Retry-After`` when it is shorter);
- once text has been emitted nothing is retried (that would duplicate output): a dropped
  connection, a stalled stream or an error event becomes `EngineStreamError`;
- other 4xx answers become `EngineHTTPError` with the server's own message, at once;
- a read timeout (``timeout``: the longest silence allowed between two chunks) before any text is
  an `EngineError` naming the timeout; it is not retried (the server is alive, just slow);
- every event is checked against the shape of a streaming chunk (``choices`` a list of objects,
  text a string, ``usage`` counts non-negative integers, ...): one that is not is an
  `EngineStreamError` naming the URL, what is wrong and the event (truncated); a ``data`` line
  without a payload is skipped;
- two deadlines end streams that send bytes but make no progress: ``progress_timeout`` bounds
  the wait for the next complete event (keep-alive comments and partial lines don't count: a
  trickle of bytes or an endless run of keep-alives is cut), ``total_timeout`` the whole
  generation, retries included. Either ends the stream with an `EngineStreamError`, not retried.

Speculative-decoding metrics (see `agentrt.engine.drafter_config`), when the server is vLLM:

- exact per request when the server runs with ``--per-request-spec-decode-metrics summary`` (or
  ``detailed``): vLLM then sends ``metrics.speculative_decoding`` with the usage chunk;
- otherwise from its ``/metrics`` counters, read before and after each generation: the difference
  is that generation's `DecodeMetrics`, exact only when no other request runs on the server at the
  same time (with concurrent traffic, the numbers are the server's over that window).

Servers without vLLM's ``/metrics`` (SGLang, hosted APIs) give ``metrics=None``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import httpx

from agentrt.errors import AgentrtError

from .base import BaseEngine, Delta, EngineError, EngineStreamError, Message, SamplingParams, Usage
from .metrics import DecodeMetrics
from .drafter_config import DecodeCounters, counters_from_prometheus, decode_metrics_from_request

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses retried before the first token (5xx of a busy or restarting server, 429, 408)."""

PromptBuilder = Callable[[Sequence[Message]], str]
_T = TypeVar("_T")


class EngineHTTPError(EngineError):
    """The server answered with an HTTP error status (``status_code``, the server's ``message``)."""

    def __init__(self, url: str, status_code: int, message: str) -> None:
        super().__init__(f"{url} answered HTTP {status_code}: {message}")
        self.url = url
        self.status_code = status_code
        self.message = message


def last_user_message(messages: Sequence[Message]) -> str:
    """The default completions prompt: the content of the last user message, verbatim."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return message.get("content", "")
    raise EngineError("api='completions' needs a user message to use as the prompt")


class _Retry(AgentrtError):
    """Internal: this attempt failed before any text was emitted and may be retried."""

    def __init__(self, error: EngineError, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


@dataclass
class _Progress:
    """What one `stream` call has emitted so far (shared by its attempts)."""

    text_chars: int = 0
    text_chunks: int = 0
    first_text_at: float | None = None
    last_text_at: float | None = None
    spec_summary: dict[str, Any] | None = None
    """vLLM's per-request ``metrics.speculative_decoding``, when the server sends it."""
    deadline: float = math.inf
    """When the whole generation must have ended (``time.monotonic()``; ``total_timeout``)."""


class OpenAIEngine(BaseEngine):
    """Streams from an OpenAI-compatible server.

    ``base_url`` is the server root or its ``/v1`` root (``http://127.0.0.1:8000`` or
    ``http://127.0.0.1:8000/v1``). ``api="chat"`` sends the messages (the server applies the
    model's chat template); ``api="completions"`` sends ``prompt_builder(messages)`` as a raw
    prompt, by default the last user message verbatim, with no template. ``timeout`` is the read
    timeout (longest silence between chunks), ``connect_timeout`` the TCP connect timeout,
    ``progress_timeout`` the longest wait for the next complete event (the minimum progress a
    stream must make: one event per ``progress_timeout`` seconds), ``total_timeout`` the longest
    a whole generation may take, retries included (None turns either off).
    ``extra_body`` is merged into every request body last (vLLM extras such as
    ``repetition_penalty``). ``server_metrics``: read vLLM's ``/metrics`` around each generation
    (True), never (False), or only when the server turns out to be vLLM (None, the default).

    An engine belongs to the event loop that first uses it; `aclose` releases its connections.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        api: Literal["chat", "completions"] = "chat",
        *,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        progress_timeout: float | None = 120.0,
        total_timeout: float | None = 900.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        extra_body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        prompt_builder: PromptBuilder = last_user_message,
        server_metrics: bool | None = None,
    ) -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be > 0")
        for name, value in (("progress_timeout", progress_timeout),
                            ("total_timeout", total_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        root = base_url.rstrip("/")
        if root.endswith("/v1"):
            root = root[: -len("/v1")]
        self.server_url = root
        self.api_url = f"{root}/v1/chat/completions" if api == "chat" else f"{root}/v1/completions"
        self.metrics_url = f"{root}/metrics"
        self.model = model
        self.api = api
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.progress_timeout = None if progress_timeout is None else float(progress_timeout)
        self.total_timeout = None if total_timeout is None else float(total_timeout)
        self.max_retries = max_retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.extra_body = dict(extra_body or {})
        self.prompt_builder = prompt_builder
        self._headers = {"Accept": "text/event-stream", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._track_metrics = server_metrics
        self._per_request_metrics = False
        self._client: httpx.AsyncClient | None = None
        self._totals: DecodeMetrics | None = None
        self.attempts = 0
        """HTTP requests made by `stream` so far, retries included."""

    # ------------------------------------------------------------------ public API

    async def stream(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> AsyncIterator[Delta]:
        """Stream the reply to ``messages``; the last delta has finish_reason, usage, metrics."""
        params = params or SamplingParams()
        body = self.request_body(messages, params)
        start = time.monotonic()
        progress = _Progress(deadline=math.inf if self.total_timeout is None
                             else start + self.total_timeout)
        before = await self._counters_if_tracked()
        final: Delta | None = None
        for attempt in range(self.max_retries + 1):
            try:
                async with contextlib.aclosing(self._attempt(body, progress)) as deltas:
                    async for delta in deltas:
                        if delta.finish_reason is not None:
                            final = delta
                        else:
                            yield delta
                break
            except _Retry as retry:
                delay = self._delay(attempt, retry.retry_after)
                if attempt == self.max_retries or time.monotonic() + delay >= progress.deadline:
                    error = retry.error
                    error.args = (f"{error} (gave up after {attempt + 1} attempts)",)
                    raise error from error.__cause__
                await anyio.sleep(delay)
        assert final is not None and final.usage is not None
        final.metrics = await self._generation_metrics(before, final.usage, start, progress)
        yield final

    def request_body(self, messages: Sequence[Message], params: SamplingParams) -> dict[str, Any]:
        """The JSON body sent for ``messages`` and ``params`` (exposed for inspection and tests)."""
        body: dict[str, Any] = {"model": self.model}
        if self.api == "chat":
            body["messages"] = [dict(m) for m in messages]
        else:
            body["prompt"] = self.prompt_builder(messages)
        body.update(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
        )
        if params.top_k > 0:
            body["top_k"] = params.top_k  # vLLM / SGLang extension, not sent when unused
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        body.update(self.extra_body)
        return body

    async def decode_metrics(self) -> DecodeMetrics | None:
        """The server's cumulative speculative-decoding metrics (all requests since it started).

        None when the server exposes no vLLM metrics.
        """
        counters = await self.server_counters()
        return counters.to_decode_metrics() if counters is not None else None

    async def server_counters(self) -> DecodeCounters | None:
        """One reading of a vLLM server's ``/metrics`` counters, or None when there are none."""
        client = self._http()
        response = None
        with anyio.move_on_after(self.timeout):  # a trickling /metrics must not hold anything up
            try:
                response = await client.get(self.metrics_url, headers={"Accept": "text/plain"})
            except httpx.HTTPError:
                return None
        if response is None:
            return None
        if response.status_code != 200 or "vllm:" not in response.text:
            return None
        return counters_from_prometheus(response.text)

    def metrics(self) -> DecodeMetrics | None:
        """Per-generation metrics of this engine's generations, summed (None if never measured)."""
        return self._totals

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # ------------------------------------------------------------------ one HTTP attempt

    async def _attempt(self, body: dict[str, Any], progress: _Progress) -> AsyncIterator[Delta]:
        """One POST: yields text deltas, then a final delta; raises `_Retry` while retry is safe."""
        client = self._http()
        self.attempts += 1
        finish: str | None = None
        usage: Usage | None = None
        done = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                response = await self._in_time(progress, stack.enter_async_context(
                    client.stream("POST", self.api_url, json=body)))
                if response.status_code >= 400:
                    await self._in_time(progress, response.aread())
                    error = EngineHTTPError(
                        self.api_url, response.status_code, _error_message(response)
                    )
                    if response.status_code in RETRYABLE_STATUS:
                        raise _Retry(error, _retry_after(response))
                    raise error
                events = await stack.enter_async_context(
                    contextlib.aclosing(_sse_data(response.aiter_lines())))
                while (data := await self._next_event(events, progress)) is not None:
                    if not data.strip():
                        continue  # a `data` line without a payload: nothing to read
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    chunk = self._decode(data, progress)
                    usage = _usage(chunk) or usage
                    progress.spec_summary = _spec_summary(chunk) or progress.spec_summary
                    for choice in chunk.get("choices") or ():
                        text = _choice_text(choice)
                        if text:
                            now = time.monotonic()
                            if progress.first_text_at is None:
                                progress.first_text_at = now
                            progress.last_text_at = now
                            progress.text_chars += len(text)
                            progress.text_chunks += 1
                            yield Delta(text=text)
                        finish = choice.get("finish_reason") or finish
        except httpx.ReadTimeout as exc:
            if progress.text_chars:
                reason = f"no data for {self.timeout:g} s (read timeout)"
                raise self._broken(progress, reason) from exc
            raise EngineError(
                f"{self.api_url}: no response within {self.timeout:g} s (read timeout)"
            ) from exc
        except httpx.HTTPError as exc:  # refused or dropped connection, protocol or decoding error
            if progress.text_chars:
                raise self._broken(progress, _describe(exc)) from exc
            error = EngineError(f"cannot reach {self.api_url}: {_describe(exc)}")
            error.__cause__ = exc
            raise _Retry(error) from exc
        if finish is None and not done:
            if progress.text_chars:
                raise self._broken(progress, "the stream ended without a finish_reason")
            raise _Retry(EngineError(f"{self.api_url}: the stream ended before any output"))
        if usage is None:
            usage = Usage(prompt_tokens=0, completion_tokens=progress.text_chunks)
        yield Delta(text="", finish_reason=finish or "stop", usage=usage)

    async def _in_time(self, progress: _Progress, awaitable: Awaitable[_T]) -> _T:
        """``await awaitable`` before the generation's deadline (``total_timeout``)."""
        with anyio.move_on_after(progress.deadline - time.monotonic()):
            return await awaitable
        raise self._too_slow(progress, "total")

    async def _next_event(self, events: AsyncIterator[str], progress: _Progress) -> str | None:
        """The next event's data (None at the end), within ``progress_timeout`` and the deadline."""
        now = time.monotonic()
        wait = math.inf if self.progress_timeout is None else self.progress_timeout
        with anyio.move_on_after(min(wait, progress.deadline - now)):
            return await anext(events, None)
        raise self._too_slow(progress, "total" if now + wait > progress.deadline else "progress")

    def _too_slow(self, progress: _Progress, which: Literal["total", "progress"]) -> EngineStreamError:
        if which == "total":
            reason = (f"the generation did not finish within {self.total_timeout:g} s "
                      "(total_timeout)")
        else:
            reason = (f"no complete event for {self.progress_timeout:g} s (progress_timeout): "
                      "the server sent only keep-alives or partial data")
        if progress.text_chars:
            return self._broken(progress, reason)
        return EngineStreamError(f"{self.api_url}: {reason}")

    def _decode(self, data: str, progress: _Progress) -> dict[str, Any]:
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            message = f"unparseable event from {self.api_url}: {data[:200]!r}"
            if progress.text_chars:
                raise self._broken(progress, message) from None
            raise EngineError(message) from None
        if isinstance(chunk, dict) and ("error" in chunk or chunk.get("object") == "error"):
            message = _message_of(chunk) or data[:300]
            if progress.text_chars:
                raise self._broken(progress, f"server error event: {message}")
            raise EngineError(f"{self.api_url} sent an error event: {message}")
        problem = _chunk_problem(chunk)
        if problem is not None:
            reason = f"malformed chunk ({problem}): {data[:200]!r}"
            if progress.text_chars:
                raise self._broken(progress, reason)
            raise EngineStreamError(f"{self.api_url} sent a {reason}")
        return chunk

    def _broken(self, progress: _Progress, reason: str) -> EngineStreamError:
        return EngineStreamError(
            f"{self.api_url}: stream broke after {progress.text_chars} characters: {reason} "
            "(not retried: output was already emitted)"
        )

    # ------------------------------------------------------------------ helpers

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                headers=self._headers,
                timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
            )
        return self._client

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        delay = min(self.backoff * (2**attempt), self.max_backoff)
        if retry_after is not None:
            delay = min(max(retry_after, 0.0), self.max_backoff)
        return delay

    async def _counters_if_tracked(self) -> DecodeCounters | None:
        if self._track_metrics is False or self._per_request_metrics:
            return None
        counters = await self.server_counters()
        if self._track_metrics is None:
            self._track_metrics = counters is not None
        return counters

    async def _generation_metrics(
        self, before: DecodeCounters | None, usage: Usage, start: float, progress: _Progress
    ) -> DecodeMetrics | None:
        if progress.spec_summary is not None:
            # Exact for this request (server run with --per-request-spec-decode-metrics).
            self._per_request_metrics = True
            metrics = decode_metrics_from_request(progress.spec_summary, usage.completion_tokens)
        elif before is not None:
            metrics = await self._counter_difference(before, usage)
            if metrics is None:
                return None
        else:
            return None
        end = progress.last_text_at or time.monotonic()
        metrics.wall_s = end - start
        metrics.prefill_s = (progress.first_text_at or end) - start
        if self._totals is None:
            self._totals = DecodeMetrics()
        self._totals.merge(metrics)
        return metrics

    async def _counter_difference(self, before: DecodeCounters, usage: Usage) -> DecodeMetrics | None:
        # vLLM updates its counters just after it sends the last chunk; wait until they cover us.
        delta = None
        for _ in range(20):
            after = await self.server_counters()
            if after is None:
                return None
            delta = after - before
            if delta.generation_tokens >= usage.completion_tokens:
                break
            await anyio.sleep(0.05)
        assert delta is not None
        return delta.to_decode_metrics(generated_tokens=usage.completion_tokens)


# ---------------------------------------------------------------------- SSE and JSON shapes


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` payloads of a server-sent event stream (multi-line data joined by newlines)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field_name, _, value = line.partition(":")
        if field_name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _chunk_problem(chunk: Any) -> str | None:
    """What is wrong with a streaming chunk's shape (None when nothing is)."""
    if not isinstance(chunk, dict):
        return f"an event must be a JSON object, got {_type_of(chunk)}"
    choices = chunk.get("choices")
    if choices is not None and not isinstance(choices, list):
        return f"'choices' must be a list, got {_type_of(choices)}"
    for i, choice in enumerate(choices or ()):
        if not isinstance(choice, dict):
            return f"choices[{i}] must be an object, got {_type_of(choice)}"
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            return f"choices[{i}].delta must be an object, got {_type_of(delta)}"
        for where, value in ((f"choices[{i}].delta.content", (delta or {}).get("content")),
                             (f"choices[{i}].text", choice.get("text")),
                             (f"choices[{i}].finish_reason", choice.get("finish_reason"))):
            if value is not None and not isinstance(value, str):
                return f"{where} must be a string, got {_type_of(value)}"
    usage = chunk.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return f"'usage' must be an object, got {_type_of(usage)}"
        for key in ("prompt_tokens", "completion_tokens"):
            if not _is_count(usage.get(key)):
                return f"usage.{key} must be a non-negative integer, got {usage.get(key)!r:.50}"
    for key, value in (_spec_summary(chunk) or {}).items():
        counts = value if key in ("acceptance_histogram", "per_step_drafted") else [value]
        if key in _SUMMARY_FIELDS and not (isinstance(counts, list)
                                           and all(_is_count(c) for c in counts)):
            return (f"metrics.speculative_decoding.{key} must hold non-negative integers, "
                    f"got {value!r:.50}")
    return None


_SUMMARY_FIELDS = frozenset({"acceptance_histogram", "per_step_drafted", "num_spec_steps",
                             "num_accepted_draft_tokens", "num_spec_tokens", "num_draft_tokens"})
"""Fields of vLLM's per-request summary that `decode_metrics_from_request` reads."""


def _is_count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _type_of(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _choice_text(choice: dict[str, Any]) -> str:

    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def _usage(chunk: dict[str, Any]) -> Usage | None:
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return None
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
    )


def _spec_summary(chunk: dict[str, Any]) -> dict[str, Any] | None:
    metrics = chunk.get("metrics")
    if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
        return metrics["speculative_decoding"]
    return None


def _message_of(payload: Any) -> str | None:
    """The human message in an OpenAI / vLLM / FastAPI error body."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if payload.get(key):
                value = payload[key]
                return value if isinstance(value, str) else json.dumps(value)
    return None


def _error_message(response: httpx.Response) -> str:
    try:
        message = _message_of(response.json())
    except (json.JSONDecodeError, UnicodeDecodeError):
        message = None
    if message:
        return message
    text = response.text.strip()
    return text[:500] if text else response.reason_phrase or "no message"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _describe(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
