"""Fixtures shared by the whole suite. The test tree mirrors the source tree (tests/agentrt,
tests/interpreter, tests/tools, tests/engine, tests/kernels, tests/benchmarks); this folder is
on ``sys.path`` so that helpers such as ``random_models`` import by name."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Every async test runs on asyncio (the runtime's REPL needs it)."""
    return "asyncio"

