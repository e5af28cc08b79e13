"""Everything model code can reach in the sandbox, walked: nothing real leaves the first wall.

The walk (``sandbox_crawler.py``) runs inside a real worker, with the builtins, module facades
and guards model code gets, and follows attributes, calls without arguments, container items and
the results of builtins and module functions called with typical arguments, four levels deep.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrt.interpreter import Repl, ReplLimits

pytestmark = pytest.mark.anyio

SANDBOX_OBJECTS = """
import dataclasses, enum, typing

class Box:
    def __init__(self, items):
        self.items = items

    def total(self):
        return len(self.items)

@dataclasses.dataclass
class Point:
    x: int
    y: int = 0

class Color(enum.Enum):
    RED = 1

def numbers():
    yield 1

box = Box([1, 2])
point = Point(1)
stream = numbers()

def helper(value):
    return value

try:
    1 / 0
except ZeroDivisionError as caught:
    failure = caught
"""


async def echo_tool(name: str, args: tuple, kwargs: dict):
    return list(args)


async def test_the_walk_reaches_nothing_real(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    limits = ReplLimits(cpu_s=120, wall_s=600, memory_mb=2048)
    async with Repl(echo_tool, {"echo": "echo(*args)"}, limits) as repl:
        await repl.extend("sandbox_crawler:install")
        assert (await repl.execute(SANDBOX_OBJECTS)).ok
        walked = await repl.execute("report = crawl(4)")
        assert walked.ok, walked.error
        violations, visited = await repl.get_variable("report")
    assert visited > 3000  # the walk really covers the builtins and every module facade
    assert violations == [], "\n".join(violations)
