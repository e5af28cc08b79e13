"""The shadow's side of effect scopes, driven through the typed protocol: which calls a shadow
launches after an effectful call it may not run, and how far it goes."""

from __future__ import annotations

import anyio
import pytest

from agentrt.interpreter.frames import Launch, Shadow, ShadowDone
from agentrt.interpreter.repl import Repl, ReplLimits
from agentrt.interpreter.shadow_worker import MAX_SHADOW_EFFECTS

TOOLS = {"save": "save(x)", "score": "score(x)", "balance": "balance()", "weather": "weather()"}
SPECULATABLE = ("balance", "score", "weather")
READS = (("balance", ("accounts",)), ("score", ()), ("weather", ("weather",)))


async def shadow_messages(code: str, writes: tuple) -> list:
    """Every message of a shadow of ``code`` up to its `ShadowDone`."""

    async def no_calls(name: str, args: tuple, kwargs: dict) -> None:
        raise AssertionError(f"a shadow called {name} for real")

    async with Repl(no_calls, TOOLS, ReplLimits(cpu_s=5, wall_s=30)) as repl:
        messages = repl.messages()
        shadow = await repl.fork_shadow()
        await shadow.post(Shadow(((0, 1, code),), SPECULATABLE, 2.0, READS, writes))
        received = []
        with anyio.fail_after(20):
            while not received or not isinstance(received[-1], ShadowDone):
                token, message = await messages.receive()
                assert token == shadow.token
                received.append(message)
        await shadow.kill(wait=False)
        messages.close()
    return received


def launched(messages: list) -> list[str]:
    return [m.name for m in messages if isinstance(m, Launch)]


@pytest.mark.anyio
@pytest.mark.parametrize("writes, expected", [
    ((("save", ("notes",)),), ["score", "balance", "weather"]),  # writes a scope nobody reads
    ((("save", ("accounts",)),), ["score", "weather"]),  # balance reads what save writes
    ((), ["score"]),  # an undeclared effect writes every scope: only the pure call crosses
])
async def test_after_an_effect_the_shadow_launches_only_calls_it_cannot_observe(writes, expected):
    code = "n = save(1)\na = score(2)\nb = balance()\nc = weather()\nd = score(n)\n"
    messages = await shadow_messages(code, writes)
    assert launched(messages) == expected  # score(n) needs the effect's result: never launched
    assert messages[-1].effects == 1


@pytest.mark.anyio
async def test_a_runaway_loop_of_effects_stops_the_shadow_quickly():
    # stopped by the count, not by its CPU limit (which kills it before it reports ShadowDone)
    code = "while True:\n    save(1)\na = score(2)\n"
    messages = await shadow_messages(code, (("save", ("notes",)),))
    assert launched(messages) == []  # nothing after the stop
    assert messages[-1].effects == MAX_SHADOW_EFFECTS
