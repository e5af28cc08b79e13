"""The root of every error agentrt raises on its own account: ``except AgentrtError`` catches
an engine's, the REPL's, a tool's, the server's.

Each layer derives its errors from `AgentrtError` and, where callers rely on one, from the
builtin they used to be (``class ReplError(AgentrtError, RuntimeError)``), so existing
``except RuntimeError`` clauses keep working. This module imports nothing, so every layer may
use it (like ``agentrt.lazy_exports``) without the layers below ``agentrt`` depending on the
runtime.

Two kinds of exception are deliberately not errors and do not derive from it: interrupts,
which must pass ``except Exception`` (`agentrt.RunInterrupted`, a `KeyboardInterrupt`; the lazy
values' ``Abandoned``), and what the sandbox itself raises inside a cell (its admission and
syntax errors, held by identity by the sandbox's own policy).
"""

from __future__ import annotations

__all__ = ["AgentrtError"]


class AgentrtError(Exception):
    """Base class of every error agentrt raises on its own account (not of errors a tool's
    own function raises: those reach the caller unchanged)."""
