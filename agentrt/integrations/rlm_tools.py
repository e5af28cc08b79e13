"""The RLM's sub-call functions and custom tools, as agentrt tools.

`SubCalls` makes ``llm_query``, ``llm_query_batched``, ``rlm_query`` and ``rlm_query_batched``
agentrt tools that do what rlms' local REPL does: the same requests through the RLM's LM handler
(or its recursion callback), the same ``"Error: ..."`` replies instead of exceptions. An
invocation runs early (speculative) or when the code reaches it; either way the
`RLMChatCompletion`\\ s behind its value are kept until a cell takes that value (`SubCalls.take`),
so that the cell's ``REPLResult.rlm_calls`` lists them as rlms would, early ones as
`EarlyCompletion`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from rlm.core.comms_utils import LMRequest, send_lm_request, send_lm_request_batched
from rlm.core.types import RLMChatCompletion
from rlm.environments.base_env import extract_tool_value

from agentrt.interpreter.protocol import NotPlainDataError, to_plain
from agentrt.tools import Tool
from agentrt.tools.scopes import ALL_SCOPES

NAMES = ("llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched")


class EarlyCompletion(RLMChatCompletion):
    """A sub-call the authoritative run took from an early (speculative) call.

    Its ``to_dict`` (what ``RLMLogger`` writes) adds ``"agentrt": {"early": true, "started_s",
    "finished_s", "claimed_s", "hidden_s"}``, seconds on the environment's trace clock; ``hidden_s``
    is the part of the call that ran before the code asked for it.
    """

    agentrt: dict[str, Any]

    @classmethod
    def of(cls, completion: RLMChatCompletion, timing: dict[str, Any]) -> EarlyCompletion:
        early = cls(**{name: getattr(completion, name) for name in completion.__dataclass_fields__})
        early.agentrt = {"early": True, **timing}
        return early

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "agentrt": self.agentrt}


class SubCallSettings(Protocol):
    """What the sub-call tools read, at call time, from their environment."""

    lm_handler_address: tuple[str, int] | None
    depth: int
    subcall_fn: Callable[[str, str | None], RLMChatCompletion] | None
    max_concurrent_subcalls: int


@dataclass
class _Finished:
    """One finished invocation: its value and the completions behind it."""

    value: Any
    completions: list[RLMChatCompletion]
    started_s: float
    finished_s: float


class SubCalls:
    """The four sub-call tools of one environment, and the completions of their invocations."""

    def __init__(self, settings: SubCallSettings, clock: Callable[[], float]) -> None:
        self._settings = settings
        self._clock = clock
        self._finished: dict[str, list[_Finished]] = {}
        self._lock = threading.Lock()
        recursive = settings.subcall_fn is not None
        self.tools = {t.name: t for t in (  # without recursion, rlm_query is a plain completion
            Tool(self._llm_query, name="llm_query", speculate=True, pure=True),
            Tool(self._llm_query_batched, name="llm_query_batched", speculate=True, pure=True),
            Tool(self._rlm_query, name="rlm_query", speculate=not recursive),
            Tool(self._rlm_query_batched, name="rlm_query_batched", speculate=not recursive))}

    def take(self, name: str, args: tuple, kwargs: dict, value: Any,
             claimed_s: float | None) -> list[RLMChatCompletion]:
        """The completions behind ``value``, returned by a call of tool ``name`` (an early
        call claimed at ``claimed_s``, or None for a call made when the code reached it)."""
        try:
            key = self.tools[name].call_key(args, kwargs)
        except Exception:
            return []
        with self._lock:
            entries = self._finished.get(key, [])
            entry = next((e for e in entries if e.value == value), entries[0] if entries else None)
            if entry is None:
                return []
            entries.remove(entry)
        if claimed_s is None:
            return list(entry.completions)
        timing = {"started_s": entry.started_s, "finished_s": entry.finished_s,
                  "claimed_s": claimed_s,
                  "hidden_s": max(0.0, min(entry.finished_s, claimed_s) - entry.started_s)}
        return [EarlyCompletion.of(c, timing) for c in entry.completions]

    def forget(self) -> None:
        """Drop what no cell took (early calls never claimed)."""
        with self._lock:
            self._finished.clear()

    # -- the tools (run in worker threads) ------------------------------------------------------

    def _llm_query(self, prompt: Any, model: str | None = None) -> str:
        """A single sub-LLM completion (no REPL, no recursion)."""
        return self._keep("llm_query", (prompt, model), self._ask(prompt, model))

    def _llm_query_batched(self, prompts: list[Any], model: str | None = None) -> list[str]:
        """Several sub-LLM completions at once; replies in the order of the prompts."""
        return self._keep("llm_query_batched", (prompts, model),
                          self._ask_batched(prompts, model))

    def _rlm_query(self, prompt: Any, model: str | None = None) -> str:
        """A recursive RLM sub-call (a plain sub-LLM completion without recursion)."""
        return self._keep("rlm_query", (prompt, model), self._recurse(prompt, model))

    def _rlm_query_batched(self, prompts: list[Any], model: str | None = None) -> list[str]:
        """Several recursive RLM sub-calls at once."""
        return self._keep("rlm_query_batched", (prompts, model),
                          self._recurse_batched(prompts, model))

    def _keep(self, name: str, args: tuple, outcome: tuple[Any, list, float]) -> Any:
        value, completions, started = outcome
        try:
            key = self.tools[name].call_key(args, {})
        except Exception:  # arguments with no canonical form: no cell can match this value
            return value
        with self._lock:
            self._finished.setdefault(key, []).append(
                _Finished(value, completions, started, self._clock()))
        return value

    def _ask(self, prompt: Any, model: str | None) -> tuple[str, list, float]:
        started, settings = self._clock(), self._settings
        if not settings.lm_handler_address:
            return "Error: No LM handler configured", [], started
        try:
            response = send_lm_request(settings.lm_handler_address,
                                       LMRequest(prompt=prompt, model=model, depth=settings.depth))
        except Exception as exc:
            return f"Error: LM query failed - {exc}", [], started
        if not response.success:
            return f"Error: {response.error}", [], started
        return response.chat_completion.response, [response.chat_completion], started

    def _ask_batched(self, prompts: list[Any], model: str | None) -> tuple[list[str], list, float]:
        started, settings = self._clock(), self._settings
        if not settings.lm_handler_address:
            return ["Error: No LM handler configured"] * len(prompts), [], started
        try:
            responses = send_lm_request_batched(settings.lm_handler_address, prompts,
                                                model=model, depth=settings.depth)
        except Exception as exc:
            return [f"Error: LM query failed - {exc}"] * len(prompts), [], started
        replies, completions = [], []
        for response in responses:
            if response.success:
                completions.append(response.chat_completion)
                replies.append(response.chat_completion.response)
            else:
                replies.append(f"Error: {response.error}")
        return replies, completions, started

    def _recurse(self, prompt: Any, model: str | None) -> tuple[str, list, float]:
        subcall = self._settings.subcall_fn
        if subcall is None:
            return self._ask(prompt, model)
        started = self._clock()
        try:
            completion = subcall(prompt, model)
        except Exception as exc:
            return f"Error: RLM query failed - {exc}", [], started
        return completion.response, [completion], started

    def _recurse_batched(self, prompts: list[Any],
                         model: str | None) -> tuple[list[str], list, float]:
        if self._settings.subcall_fn is None:
            return self._ask_batched(prompts, model)
        started = self._clock()
        workers = max(1, min(self._settings.max_concurrent_subcalls, len(prompts)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            outcomes = list(pool.map(lambda p: self._recurse(p, model), prompts))
        return ([reply for reply, _, _ in outcomes],
                [c for _, calls, _ in outcomes for c in calls], started)


def custom_tool(name: str, entry: Any) -> Tool | None:
    """The agentrt tool for an rlms custom tool entry; None when the entry is a value.

    An agentrt `Tool` keeps its ``speculate`` flag (a copy is made: its concurrency limiter
    belongs to one event loop); a plain function is never run early.
    """
    value = extract_tool_value(entry)
    if not callable(value):
        return None
    description = entry.get("description") if isinstance(entry, dict) else None
    try:
        if isinstance(value, Tool):
            return Tool(value.func, name=name, speculate=value.speculate, timeout=value.timeout,
                        max_concurrency=value.max_concurrency,
                        description=description or value.description, **_declared_scopes(value))
        return Tool(value, name=name, description=description)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"custom tool {name!r} cannot be an agentrt tool: {exc}") from None


def _declared_scopes(tool: Tool) -> dict[str, Any]:
    """The effect-scope arguments ``tool`` was declared with (none where it took the default)."""
    if tool.pure:
        return {"pure": True}
    if tool.speculate:
        return {} if tool.reads == ALL_SCOPES else {"reads": tool.reads}
    return {} if tool.writes == ALL_SCOPES else {"writes": tool.writes}


def plain_value(name: str, value: Any) -> Any:
    """``value`` as plain data for the sandbox; a TypeError naming ``name`` otherwise."""
    try:
        return to_plain(value)
    except NotPlainDataError as exc:
        raise TypeError(f"the agentrt environment cannot bind {name!r}: {exc} (only plain data "
                        "-- str, numbers, lists, dicts ... -- enters its sandbox)") from None
