"""The agent's built-in speculatable tools: the RLM convention ``llm_query`` / ``llm_query_batched``.

They live with the agent (not in ``tools/``) because they are backed by an engine.
"""

from __future__ import annotations

import math
from typing import Any

import anyio

from agentrt.engine.base import Engine, SamplingParams, complete

from agentrt.tools import Tool


def make_llm_tools(
    engine: Engine,
    params: SamplingParams | None = None,
    max_concurrency: int | None = None,
) -> list[Tool]:
    """Return ``[llm_query, llm_query_batched]`` backed by ``engine``.

    Each prompt is sent as one user message and answered with ``params``. ``max_concurrency``
    bounds the generations these two tools run at once, together (a batch counts one per prompt).
    Both tools are marked ``speculate=True, pure=True``: asking the model a question has no side
    effects and reads no state, so they may start before an earlier effectful call.
    They have no tool timeout (``math.inf``): a generation is bounded by its engine (``max_tokens``,
    the OpenAI engine's deadlines) and the cell's wall-clock limit.
    """
    limiter: anyio.CapacityLimiter | None = None

    async def ask(prompt: str) -> str:
        nonlocal limiter
        if max_concurrency is not None and limiter is None:
            limiter = anyio.CapacityLimiter(max_concurrency)
        messages = [{"role": "user", "content": prompt}]
        if limiter is None:
            return (await complete(engine, messages, params)).text
        async with limiter:
            return (await complete(engine, messages, params)).text

    async def llm_query(prompt: str) -> str:
        """Ask the language model one question; return its reply."""
        return await ask(prompt)

    async def llm_query_batched(prompts: list[str]) -> list[str]:
        """Ask the language model several independent questions at once; replies come back in
        the order of the prompts."""
        replies: list[Any] = [None] * len(prompts)

        async def answer(index: int, prompt: str) -> None:
            replies[index] = await ask(prompt)

        try:
            async with anyio.create_task_group() as group:
                for index, prompt in enumerate(prompts):
                    group.start_soon(answer, index, prompt)
        except BaseExceptionGroup as failures:
            raise _first_leaf(failures) from None
        return replies

    return [
        Tool(llm_query, speculate=True, pure=True, timeout=math.inf,
             max_concurrency=max_concurrency),
        Tool(llm_query_batched, speculate=True, pure=True, timeout=math.inf),
    ]


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a task group's failure (a failing prompt cancels its siblings)."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
