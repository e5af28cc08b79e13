"""The RLM library's REPL conventions, inside agentrt's sandbox worker process.

`install` is a worker extension hook (``Repl.extend("agentrt.integrations.rlm_namespace:install")``);
it runs in the process holding the namespace, so it must stay light (no RLM import). It gives the
namespace the surface of the ``rlms`` local REPL (version 0.1.3 and later):

* ``answer`` is a dict ``{"content": "", "ready": False}``. Setting ``answer["ready"]`` to a true
  value records ``str(answer["content"])`` as the cell's final answer (the last one recorded in a
  cell wins). A plain dict bound to ``answer`` with a true ``"ready"`` counts as well, and is
  wrapped again after the cell.
* ``SHOW_VARS()`` returns ``"Available variables: {name: type, ...}"`` (it prints nothing).
* ``FINAL`` and ``FINAL_VAR`` are not defined: the RLM ends a run through ``answer``.
* After a cell that ran to its end, a binding of a tool or helper name made by the cell is dropped
  and ``context`` / ``history`` are bound to ``context_0`` / ``history_0`` again. A cell that raised
  leaves the namespace's bindings as they were before it (objects it changed stay changed): the
  rlms local REPL keeps no assignment of a failed cell either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentrt.interpreter.sandbox import CellOutcome, Sandbox, type_name

ANSWER_TYPE_NAME = "RlmAnswer"
"""The type name of ``answer`` in namespace summaries (it is a dict)."""
_NO_VARIABLES = "No variables created yet. Use ```repl``` blocks to create variables."


class RlmAnswer(dict):
    """The ``answer`` dict: flipping ``"ready"`` to a true value records the content."""

    def __init__(self, record: Callable[[str], None]) -> None:
        super().__init__(content="", ready=False)
        self._record = record

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if key == "ready" and value:
            try:
                self._record(str(self.get("content", "")))
            except Exception:  # an unprintable content records nothing, as in rlms
                pass


RlmAnswer.__name__ = RlmAnswer.__qualname__ = ANSWER_TYPE_NAME


def _undefined(name: str) -> Callable[..., Any]:
    def undefined(*args: Any, **kwargs: Any) -> Any:
        raise NameError(f"name '{name}' is not defined")

    undefined.__name__ = undefined.__qualname__ = name
    return undefined


def install(sandbox: Sandbox, channel: Any) -> None:
    """Give ``sandbox`` the rlms REPL conventions (see the module docstring)."""
    record_final = sandbox.builtin("FINAL")  # the sandbox's own recorder, kept before hiding it
    namespace = sandbox.namespace
    scaffold = frozenset(sandbox.tool_names()) | {"SHOW_VARS"}

    def new_answer() -> RlmAnswer:
        return RlmAnswer(record_final)

    def show_vars() -> str:
        available = {name: type_name(value) for name, value in namespace.items()
                     if not name.startswith("_") and name != "answer"}
        return f"Available variables: {available}" if available else _NO_VARIABLES

    def restore_scaffold(outcome: CellOutcome) -> None:
        for name in scaffold & namespace.keys():
            del namespace[name]
        for alias in ("context", "history"):
            if f"{alias}_0" in namespace:
                namespace[alias] = namespace[f"{alias}_0"]
        current = namespace.get("answer")
        if isinstance(current, RlmAnswer):
            return
        replacement = new_answer()
        if isinstance(current, dict):
            dict.update(replacement, current)
            try:
                if current.get("ready") and outcome.final is None:
                    text = str(current.get("content", ""))
                    outcome.final = {"value": text, "is_repr": False, "variable": None}
            except Exception:
                pass
        namespace["answer"] = replacement

    run_cell = sandbox.execute

    def execute(source: str, name: str = "cell") -> CellOutcome:
        before = dict(namespace)
        outcome = run_cell(source, name)
        if outcome.error is not None:
            namespace.clear()
            namespace.update(before)
        else:
            restore_scaffold(outcome)
        return outcome

    namespace["answer"] = new_answer()
    sandbox.install_builtin("SHOW_VARS", show_vars)
    for name in ("FINAL", "FINAL_VAR"):
        sandbox.install_builtin(name, _undefined(name))
    sandbox.execute = execute  # type: ignore[method-assign]
