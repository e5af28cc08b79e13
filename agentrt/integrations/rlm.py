"""The RLM library (``rlms``, ``pip install 'agentrt[rlm]'``) on agentrt: ``environment="agentrt"``.

::

    import agentrt.integrations.rlm          # registers the environment "agentrt"
    from rlm import RLM

    rlm = RLM(backend="openai",
              backend_kwargs={"model_name": "my-model", "base_url": "http://localhost:8000/v1"},
              environment="agentrt")
    print(rlm.completion(context, root_prompt="How many ...?").response)

The RLM then runs its root model's code in agentrt's sandbox (`AgentrtREPL`: RestrictedPython in
worker processes inside the OS jail, with time and memory limits) instead of ``exec`` in its own
process, and agentrt's shadow interpreter starts ``llm_query`` calls while the root is still
streaming the code that makes them. Answers are the ones the RLM's ``"local"`` environment gives.

rlms has no registry of environments (``get_environment`` is a fixed chain of names), so
`register` (run on import; idempotent; `unregister` undoes it) wraps four names of the installed
rlms:

* ``rlm.environments.get_environment`` and the name ``rlm.core.rlm`` imported from it: the name
  ``"agentrt"`` gives an `AgentrtREPL`, every other name what it gave before;
* ``RLM._spawn_completion_context``: while the RLM sets up a completion, the environment gets the
  RLM's recursion callback (``max_depth > 1``) and compaction flag as rlms gives them to
  ``"local"``; during the completion the root model streams into the environment
  (`agentrt.integrations.rlm_stream`);
* ``RLM._validate_persistent_environment_support``: ``persistent=True`` is accepted for
  ``"agentrt"``.

Early calls show in the RLM's log: each sub-call of ``REPLResult.rlm_calls`` served by an early
call is an `EarlyCompletion`, whose ``to_dict`` (``RLMLogger``'s JSON) carries
``"agentrt": {"early": true, "hidden_s": ...}``; pass ``environment_kwargs={"trace": Trace()}``
to keep agentrt's event timeline of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterator
from importlib import metadata
from typing import Any

try:
    import rlm.core.rlm as _rlm_core
    import rlm.environments as _rlm_envs
    from rlm.environments import local_repl as _local_repl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("agentrt.integrations.rlm needs the RLM library: "
                      "pip install 'agentrt[rlm]' (the PyPI package rlms)") from exc

if not hasattr(_local_repl, "_AnswerDict"):  # pragma: no cover - older rlms
    raise ImportError(f"agentrt.integrations.rlm supports rlms >= 0.1.3 (the `answer` dict "
                      f"protocol); installed: rlms {metadata.version('rlms')}")

from .rlm_env import AgentrtREPL
from .rlm_stream import root_stream
from .rlm_tools import EarlyCompletion

ENVIRONMENT = "agentrt"
"""The environment name to pass as ``RLM(environment=...)``."""

# rlms' own functions, taken before any patch (this module is imported once).
_ORIGINAL_GET_ENVIRONMENT = _rlm_envs.get_environment
_ORIGINAL_SPAWN = _rlm_core.RLM._spawn_completion_context
_ORIGINAL_VALIDATE = _rlm_core.RLM._validate_persistent_environment_support
_spawning: contextvars.ContextVar[Any] = contextvars.ContextVar("agentrt_rlm_spawning",
                                                                 default=None)


def register() -> None:
    """Make ``RLM(environment="agentrt")`` use `AgentrtREPL` (idempotent)."""
    RLM = _rlm_core.RLM
    _rlm_envs.get_environment = _get_environment
    _rlm_core.get_environment = _get_environment
    RLM._spawn_completion_context = _spawn_completion_context
    RLM._validate_persistent_environment_support = _validate_persistence


def unregister() -> None:
    """Undo `register`."""
    RLM = _rlm_core.RLM
    _rlm_envs.get_environment = _ORIGINAL_GET_ENVIRONMENT
    _rlm_core.get_environment = _ORIGINAL_GET_ENVIRONMENT
    RLM._spawn_completion_context = _ORIGINAL_SPAWN
    RLM._validate_persistent_environment_support = _ORIGINAL_VALIDATE


def _get_environment(environment: str, environment_kwargs: dict[str, Any]) -> Any:
    if environment != ENVIRONMENT:
        return _ORIGINAL_GET_ENVIRONMENT(environment, environment_kwargs)
    kwargs = dict(environment_kwargs)
    owner = _spawning.get()
    if owner is not None:  # what rlms hands its own "local" environment
        if owner.max_depth > 1:
            kwargs.setdefault("subcall_fn", owner._subcall)
        if owner.compaction:
            kwargs.setdefault("compaction", True)
    return AgentrtREPL(**kwargs)


@contextlib.contextmanager
def _spawn_completion_context(self: Any, prompt: Any) -> Iterator[tuple[Any, Any]]:
    with contextlib.ExitStack() as stack:
        token = _spawning.set(self)
        try:
            lm_handler, environment = stack.enter_context(_ORIGINAL_SPAWN(self, prompt))
        finally:
            _spawning.reset(token)
        stack.callback(_close_async_clients, lm_handler)
        if isinstance(environment, AgentrtREPL):
            stack.enter_context(root_stream(lm_handler, environment))
        yield lm_handler, environment


def _close_async_clients(lm_handler: Any) -> None:
    """Close the ``AsyncOpenAI`` clients rlms makes and leaves open. Collected later, each would
    schedule its own close on whichever event loop runs then (the REPL's), which fails and logs
    "Task exception was never retrieved"."""
    try:
        asyncio.get_running_loop()
        return  # called from async code: leave them to rlms
    except RuntimeError:
        pass
    handlers = [lm_handler.default_client, lm_handler.other_backend_client,
                *lm_handler.clients.values()]
    for client in {id(c): c for c in handlers if c is not None}.values():
        async_client = getattr(client, "async_client", None)
        if async_client is not None and not async_client.is_closed():
            with contextlib.suppress(Exception):  # its connections may belong to a closed loop
                asyncio.run(async_client.close())


def _validate_persistence(self: Any) -> None:
    if self.environment_type != ENVIRONMENT:
        _ORIGINAL_VALIDATE(self)


register()

__all__ = ["AgentrtREPL", "ENVIRONMENT", "EarlyCompletion", "register", "unregister"]
