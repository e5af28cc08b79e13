"""The REPL: a pool of sandboxed Python sessions in worker processes (anyio; runs under asyncio).

:class:`Repl` holds one persistent namespace, run cell by cell with fork-per-cell rollback;
:class:`ReplSession` is a handle on one namespace (the REPL's own or a copy-on-write fork).

Modules: ``limits`` (ReplLimits), ``results`` (cell results and errors), ``processes`` (the
process table), ``process_tree`` (pidfds, tree kills), ``service`` (the socket service:
connections and frame dispatch), ``messages`` (the stream of forked sessions' messages),
``transport`` (requests to worker processes: commands, cells, forks, kills), ``session``
(Repl, ReplSession).

Example::

    async def handler(name, args, kwargs):
        return {"search": search}[name](*args, **kwargs)

    async with Repl(handler, {"search": "search(query: str) -> list[str]"}) as repl:
        await repl.set_variable("context", text)
        result = await repl.execute("hits = search('x')\\nprint(len(hits))")
"""

from .limits import ReplLimits
from .messages import ReplMessages, SessionMessage
from .results import CellResult, FinalAnswer, ReplError, ReplProcessDied, VariableSummary
from .service import ToolHandler
from .session import Repl, ReplSession

__all__ = [
    "CellResult", "FinalAnswer", "Repl", "ReplError", "ReplLimits", "ReplMessages",
    "ReplProcessDied", "ReplSession", "SessionMessage", "ToolHandler", "VariableSummary",
]
