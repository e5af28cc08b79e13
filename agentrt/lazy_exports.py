"""Lazy exports for a package (PEP 562): a name is imported from its module on first use.

Every package of agentrt exports its public names this way, so that importing one (the sandbox
worker imports ``agentrt.interpreter``) does not load the others' dependencies (anyio, pydantic,
torch). This module imports only the standard library, so every layer may use it::

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"Repl": ".repl", ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``, whose public name ``name`` lives in
    the module ``exports[name]`` (absolute, or relative to ``package`` when it starts with a
    dot)."""
    table = MappingProxyType(dict(exports))

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted({*table, *vars(sys.modules[package])})

    return sorted(table), __getattr__, __dir__


__all__ = ["lazy_exports"]
