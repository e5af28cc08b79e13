"""`AgentrtREPL`: an environment of the RLM library (``rlms``) backed by agentrt's sandboxed REPL.

The RLM drives an environment synchronously (``execute_code(code) -> REPLResult``). This one
keeps an event loop in a thread of its own (an anyio blocking portal) holding agentrt's `Repl`
(sandboxed worker processes in the OS jail) and, with ``speculation`` on, agentrt's `Speculator`.
Each root response and each cell run whole is a `Turn` (`agentrt.turn`), the protocol the
`Agent` loop runs too; this environment only adapts it: the RLM runs fenced ```` ```repl ````
blocks (`RLM_BLOCKS`), a cell's result goes back as a ``REPLResult``, and the sub-calls a cell
took are logged in it.

Tool speculation comes in two ways:

* **while the root model streams** (the streaming hook of `agentrt.integrations.rlm`): the hook
  calls `begin_stream`, `feed` for every text delta and `end_stream`; the shadow interpreter runs
  the ```` ```repl ```` blocks as they stream and starts ``llm_query`` calls (and other
  speculatable tools) early. When the RLM then executes a block whose code is the next streamed
  block, the block's calls claim those early calls;
* **when a block arrives whole** (no hook, or code that was not streamed): the block is given to
  the shadow as it starts executing, so the calls it will make go out together (the lazy fan-out).

Answers are the same as without speculation (agentrt's contract); the RLM's own log
(``REPLResult.rlm_calls``) marks each sub-call served by an early call (`EarlyCompletion`).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
from rlm.core.types import REPLResult, RLMChatCompletion
from rlm.environments.base_env import NonIsolatedEnv, extract_tool_value, validate_custom_tools

from agentrt.interpreter.repl import CellResult, Repl, ReplError, ReplLimits, VariableSummary
from agentrt.ledger import SpeculationBudget
from agentrt.program_calls import ProgramCalls
from agentrt.results import RunStats
from agentrt.speculation import NoSpeculation, Speculator
from agentrt.tools import ToolRegistry
from agentrt.trace import Trace
from agentrt.turn import Block, BlockSelection, CellFailed, Turn

from .rlm_namespace import ANSWER_TYPE_NAME
from .rlm_tools import NAMES as SUB_CALLS
from .rlm_tools import SubCalls, custom_tool, plain_value

NAMESPACE_HOOK = "agentrt.integrations.rlm_namespace:install"
_LOOP_THREAD = "agentrt-rlm-loop"
RLM_BLOCKS = BlockSelection(languages=frozenset({"repl"}), unterminated=False)
"""The blocks the RLM runs: fenced ```repl blocks (speculation also sees one the response
ended inside)."""
_SIMPLE_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list,
                 "dict": dict, "tuple": tuple, ANSWER_TYPE_NAME: dict}


@dataclass
class _StreamedTurn:
    """The current turn, and the ```repl blocks of its response that the RLM may run."""

    turn: Turn
    closed: list[str] = field(default_factory=list)
    """Code of each closed (fenced) ```repl block, in order."""
    executed: int = 0
    streaming: bool = True


@dataclass
class _Cell:
    """One cell's result and the namespace after it."""

    result: CellResult
    summary: dict[str, VariableSummary]

    @property
    def error(self) -> str | None:
        return self.result.error

    @property
    def final(self) -> Any:
        return self.result.final


class AgentrtREPL(NonIsolatedEnv):
    """The RLM environment ``"agentrt"``: rlms' local REPL surface, in agentrt's sandbox.

    The arguments before ``speculation`` are the ones the RLM passes to every environment (see
    ``rlm.environments.local_repl.LocalREPL``). Through ``RLM(environment_kwargs={...})``:

    * ``speculation`` (default True): run the shadow interpreter and start speculatable calls
      early; off, the REPL runs every call when the code reaches it;
    * ``repl_limits``: agentrt's `ReplLimits` (CPU / wall-clock / memory per cell, the OS jail);
    * ``speculation_budget``: `SpeculationBudget` for early calls;
    * ``trace`` / ``stats``: a `Trace` and `RunStats` to record into (share them to read a run's
      timeline and counters after ``RLM.completion``); ``on_event`` is called with each event.

    Custom tools: a callable becomes an agentrt tool (an agentrt `Tool` keeps its own
    ``speculate`` flag; a plain function is never run early); any other value becomes a variable.
    Values crossing into the sandbox (contexts, variables, tool arguments and results) must be plain
    data.
    """

    def __init__(
        self,
        lm_handler_address: tuple[str, int] | None = None,
        context_payload: dict | list | str | None = None,
        setup_code: str | None = None,
        persistent: bool = False,
        depth: int = 1,
        subcall_fn: Callable[[str, str | None], RLMChatCompletion] | None = None,
        custom_tools: dict[str, Any] | None = None,
        custom_sub_tools: dict[str, Any] | None = None,
        compaction: bool = False,
        max_concurrent_subcalls: int = 4,
        *,
        speculation: bool = True,
        repl_limits: ReplLimits | None = None,
        speculation_budget: SpeculationBudget | None = None,
        trace: Trace | None = None,
        stats: RunStats | None = None,
        on_event: Callable[[Any], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(persistent=persistent, depth=depth,
                         max_concurrent_subcalls=max_concurrent_subcalls, **kwargs)
        self.lm_handler_address = lm_handler_address
        self.subcall_fn = subcall_fn
        self.custom_tools = custom_tools or {}
        self.custom_sub_tools = custom_sub_tools if custom_sub_tools is not None else self.custom_tools
        validate_custom_tools(self.custom_tools)
        self.compaction = compaction
        self.speculation = speculation
        self.trace = trace if trace is not None else Trace(on_event)
        self.stats = stats if stats is not None else RunStats()
        self._limits = repl_limits or ReplLimits()
        self._budget = speculation_budget or SpeculationBudget()
        self._registry = ToolRegistry()
        self._pending_variables: dict[str, Any] = {}
        """Variables bound before the sandbox has started."""
        self._context_count = 0
        self._history_count = 0
        self._compaction_history: list[Any] = []
        self._subcalls = SubCalls(self, self.trace.now)
        self._cell_calls: list[RLMChatCompletion] = []
        self._calls = ProgramCalls(self._registry, self.trace, self.stats, self._take)
        """The cells' tool calls, and the speculator (a `NoSpeculation` when off)."""
        self._turn = -1
        self._streamed: _StreamedTurn | None = None
        self._repl: Repl | None = None
        self._ready: anyio.Event
        self._stop: anyio.Event
        self._start_error: Exception | None = None
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._closed = False
        for tool in self._subcalls.tools.values():
            self._registry.register(tool)
        for name, entry in self.custom_tools.items():
            tool = custom_tool(name, entry)
            if tool is None:
                self._pending_variables[name] = plain_value(name, extract_tool_value(entry))
            else:
                self._registry.register(tool)
        self.setup()
        if context_payload is not None:
            self.load_context(context_payload)
        if setup_code:
            self.execute_code(setup_code)

    # -- the rlms environment interface --------------------------------------------------------

    def setup(self) -> None:
        """Start the event loop thread and, in the background, the sandbox (its start overlaps
        the root model's first response; the first cell waits for it)."""
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio", name=_LOOP_THREAD)
        self._portal = self._portal_cm.__enter__()
        try:
            self._ready, self._stop = self._portal.call(lambda: (anyio.Event(), anyio.Event()))
            self._portal.start_task_soon(self._hold)
        except BaseException:
            self._close_portal()
            raise
        if self.compaction:
            self._set_variable("history", self._compaction_history)

    def load_context(self, context_payload: dict | list | str) -> None:
        """Bind the payload as ``context_0`` and ``context``."""
        self.add_context(context_payload, 0)

    def add_context(self, context_payload: dict | list | str,
                    context_index: int | None = None) -> int:
        """Bind ``context_<index>`` (and ``context`` for index 0); dicts and lists go through
        JSON, as in rlms' local REPL. Returns the index used."""
        value = context_payload if isinstance(context_payload, str) \
            else json.loads(json.dumps(context_payload))
        index = self._bind_versioned("context", value, context_index, self._context_count)
        self._context_count = max(self._context_count, index + 1)
        return index

    def get_context_count(self) -> int:
        return self._context_count

    def add_history(self, message_history: list[dict[str, Any]],
                    history_index: int | None = None) -> int:
        """Bind a copy of a conversation as ``history_<index>`` (and ``history`` for index 0)."""
        index = self._bind_versioned("history", copy.deepcopy(message_history), history_index,
                                     self._history_count)
        self._history_count = max(self._history_count, index + 1)
        return index

    def get_history_count(self) -> int:
        return self._history_count

    def update_handler_address(self, address: tuple[str, int]) -> None:
        """The RLM's LM handler moved (a new completion of a persistent RLM)."""
        self.lm_handler_address = address

    def append_compaction_entry(self, entry: list[dict[str, Any]] | dict[str, Any]) -> None:
        """Append a trajectory segment or summary to ``history`` (compaction mode)."""
        if self.compaction:
            self._compaction_history.append(copy.deepcopy(entry))
            self._set_variable("history", self._compaction_history)

    def execute_code(self, code: str) -> REPLResult:
        """Run one cell; its printed output, error, variables, sub-calls and final answer."""
        self._check_open()
        return self._portal.call(self._execute, code)

    def cleanup(self) -> None:
        """Stop the sandbox and the event loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._portal is None:
            return
        try:
            self._portal.call(self._stop.set)
        finally:
            self._close_portal()  # waits for the sandbox to close

    def __enter__(self) -> AgentrtREPL:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.cleanup()
        return False

    def __del__(self) -> None:
        if threading.current_thread().name == _LOOP_THREAD:
            return  # the loop cannot wait for itself; it owns the sandbox until it ends
        with contextlib.suppress(Exception):
            self.cleanup()

    # -- the streaming side (called by the root-stream hook, from the RLM's thread) ------------

    def begin_stream(self) -> None:
        """The root model starts a response: a new turn for the speculator."""
        self._check_open()
        self._portal.call(self._begin_stream)

    def feed(self, delta: str) -> None:
        """Text the root model streamed."""
        self._check_open()
        self._portal.call(self._feed, delta)

    def end_stream(self) -> None:
        """The response is complete (its blocks are executed next)."""
        self._check_open()
        self._portal.call(self._end_stream)

    # -- event loop side -----------------------------------------------------------------------

    async def _hold(self) -> None:
        """Start the sandbox, then own it and the speculator (their task groups) until
        `cleanup`. A start failure is kept for the first cell to raise."""
        signatures = {t.name: t.signature_line() for t in self._registry}
        async with contextlib.AsyncExitStack() as stack:
            repl = Repl(self._calls.call, signatures, limits=self._limits)
            stack.push_async_callback(repl.aclose)
            if self.speculation:  # shadows wait for `_ready`
                self._calls.speculator = await stack.enter_async_context(Speculator(
                    repl, self._registry, self._budget, self.trace, self.stats,
                    ready=self._ready))
            try:
                await repl.start()
                await repl.extend(NAMESPACE_HOOK)
                while self._pending_variables:
                    name = next(iter(self._pending_variables))
                    await repl.set_variable(name, self._pending_variables.pop(name))
            except Exception as exc:
                self._start_error, self._calls.speculator = exc, NoSpeculation()
                self._ready.set()
                return
            self._repl = repl
            self._ready.set()
            await self._stop.wait()
            await self._end_turn()

    async def _started(self) -> Repl:
        """The sandbox, once started; its start error, raised, if it did not start."""
        await self._ready.wait()
        if self._repl is None:
            raise ReplError(f"the agentrt sandbox did not start: {self._start_error}")
        return self._repl

    def _close_portal(self) -> None:
        cm, self._portal_cm, self._portal = self._portal_cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def _check_open(self) -> None:
        if self._closed or self._portal is None:
            raise RuntimeError("this agentrt environment was cleaned up")

    def _bind_versioned(self, base: str, value: Any, index: int | None, count: int) -> int:
        """Bind ``<base>_<index>`` (the next index when None), and ``<base>`` for index 0."""
        index = count if index is None else index
        self._set_variable(f"{base}_{index}", value)
        if index == 0:
            self._set_variable(base, value)
        return index

    def _set_variable(self, name: str, value: Any) -> None:
        self._portal.call(self._bind, name, plain_value(name, value))

    async def _bind(self, name: str, value: Any) -> None:
        if self._ready.is_set():
            await (await self._started()).set_variable(name, value)
        else:  # bound by `_hold` once the sandbox has started
            self._pending_variables[name] = value

    async def _begin_turn(self, streaming: bool) -> _StreamedTurn:
        await self._end_turn()
        self._turn += 1
        closed: list[str] = []
        turn = Turn(self._turn, self._calls, lambda block: closed.append(block.code), RLM_BLOCKS)
        self._streamed = streamed = _StreamedTurn(turn, closed, streaming=streaming)
        turn.start()
        return streamed

    async def _end_turn(self) -> None:
        streamed, self._streamed = self._streamed, None
        if streamed is None:
            return
        await streamed.turn.end_speculation()
        self._subcalls.forget()  # results of early calls nobody claimed
        streamed.turn.finished()

    async def _begin_stream(self) -> None:
        await self._begin_turn(streaming=True)

    def _feed(self, delta: str) -> None:
        streamed = self._streamed
        if streamed is not None and streamed.streaming:
            streamed.turn.feed(delta)

    def _end_stream(self) -> None:
        streamed = self._streamed
        if streamed is not None and streamed.streaming:
            streamed.streaming = False
            streamed.turn.finish()

    async def _block_for(self, code: str) -> tuple[Turn, Block]:
        """The block of ``code``: the next streamed block when it is that code, else the only
        block of a new turn (given to the shadow whole)."""
        streamed = self._streamed
        if streamed is not None and not streamed.streaming \
                and streamed.executed < len(streamed.closed) \
                and streamed.closed[streamed.executed].strip() == code.strip():
            streamed.executed += 1
            return streamed.turn, Block(streamed.executed - 1, code)
        streamed = await self._begin_turn(streaming=False)
        if self.speculation:
            streamed.turn.feed(f"```repl\n{code}\n```\n", delta=False)
            streamed.turn.finish()
        streamed.executed = 1
        return streamed.turn, Block(0, code)

    async def _execute(self, code: str) -> REPLResult:
        started = time.perf_counter()
        repl = await self._started()
        turn, block = await self._block_for(code)
        self._cell_calls = []

        async def run(code: str) -> _Cell:
            try:
                result = await repl.execute(code)
                if self.compaction and result.error is None:  # rlms rebinds it after every cell
                    await repl.set_variable("history", self._compaction_history)
                return _Cell(result, await repl.namespace_summary())
            except ReplError as exc:
                raise CellFailed(f"ReplError: {exc}") from exc

        try:
            cell = await turn.execute(block, run)
        except CellFailed as failed:
            return REPLResult("", f"\n{failed}", {}, time.perf_counter() - started)
        result = cell.result
        final = None if result.final is None else str(result.final.value)
        return REPLResult(
            stdout=result.stdout,
            stderr="" if result.error is None else f"\n{result.error}",
            locals={name: _preview(v) for name, v in cell.summary.items()},
            execution_time=time.perf_counter() - started,
            rlm_calls=list(self._cell_calls),
            final_answer=final,
        )

    def _take(self, name: str, args: tuple, kwargs: dict, value: Any,
              claimed_s: float | None) -> None:
        """A cell's call returned ``value``: its sub-call completions join the cell's log."""
        if name in SUB_CALLS:
            self._cell_calls += self._subcalls.take(name, args, kwargs, value, claimed_s)


def _preview(summary: VariableSummary) -> Any:
    """A variable as ``REPLResult.locals`` shows it. The namespace lives in the sandbox, so this is
    its short repr: parsed back into a value of its type for the plain types (the value itself
    when the repr is complete), a stand-in of the same type that prints as the repr for a
    shortened list, dict or tuple, and an opaque stand-in for anything else."""
    kind = _SIMPLE_TYPES.get(summary.type_name)
    if kind is None:
        return _Opaque(summary.repr)
    with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = ast.literal_eval(summary.repr)
        if isinstance(value, kind):
            return value
    shortened = _SHORTENED.get(kind)
    if shortened is None:
        return _Opaque(summary.repr)
    stand_in = shortened()
    stand_in.text = summary.repr
    return stand_in


class _Opaque:
    """A sandbox variable shown by its short repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _ShortRepr:
    text = ""

    def __repr__(self) -> str:
        return self.text


_SHORTENED = {kind: type(f"Shortened{kind.__name__.title()}", (_ShortRepr, kind), {})
              for kind in (list, dict, tuple)}
