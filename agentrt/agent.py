"""`Agent`: the RLM-style loop — stream a response, run its code blocks, feed back what they printed."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio

from agentrt.engine.base import Engine, EngineError, Message, SamplingParams
from agentrt.interpreter.repl import Repl, ReplError, ReplLimits
from agentrt.interpreter.protocol import to_plain
from agentrt.interpreter.segmenter import BlockClosed, BlockOpened, CodeStream, StatementClosed
from agentrt.tools import Tool, ToolRegistry

from . import prompts
from .ledger import SpeculationBudget
from .llm_tools import make_llm_tools
from .results import BlockRecord, RunResult, RunStats, TurnRecord
from .speculation import Speculator
from .tool_calls import call_digests, traced_call
from .trace import Event, Trace

_FENCED = re.compile(r"^```[^\n]*\n.*?(?:^```[ \t]*$|\Z)", re.S | re.M)
_TEXT_FINAL_VAR = re.compile(r"FINAL_VAR\(\s*['\"]?([A-Za-z_][A-Za-z_0-9]*)['\"]?\s*\)")
_TEXT_FINAL = re.compile(r"FINAL\((.*)\)")

SUB_QUERY_PRIORITY = 1
"""Default `SamplingParams.priority` of ``llm_query`` requests (the root streams at 0)."""


class Agent:
    """A code-writing agent: a model engine, a sandboxed REPL and a set of tools.

    Each turn the model's response is streamed; every fenced ```repl / ```python block runs in
    the sandboxed REPL as soon as it is complete; what it printed (and any error) becomes the
    next user message. The run ends when code calls ``FINAL(answer)`` / ``FINAL_VAR("name")``
    (or the response says ``FINAL(...)`` in prose), or after ``max_turns``.

    ``examples`` are chat messages (few-shot turns) placed between the system prompt and the
    task (default: `prompts.default_examples`, an exchange that teaches the REPL format, with
    the default system prompt only). ``sub_engine`` backs the built-in ``llm_query`` /
    ``llm_query_batched`` tools (default: the main engine); their requests go out at ``sub_sampling`` (default: priority
    ``SUB_QUERY_PRIORITY``, so that an engine serving the root and its sub-queries at once, such as
    the native engine, keeps the root's stream going first). ``speculation`` runs the shadow interpreter, which starts speculatable tool calls
    while the code is still streaming; answers are identical either way. ``budget`` bounds those
    early calls. ``on_event`` sees every trace event as it happens (for live displays).
    ``capture_namespace`` records the REPL's final variables in ``RunResult.namespace``.
    """

    def __init__(
        self,
        engine: Engine,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        *,
        sub_engine: Engine | None = None,
        speculation: bool = True,
        max_turns: int = 10,
        system_prompt: str | None = None,
        examples: Sequence[Message] | None = None,
        sampling: SamplingParams | None = None,
        sub_sampling: SamplingParams | None = None,
        builtin_tools: bool = True,
        repl_limits: ReplLimits | None = None,
        max_observation_chars: int = 4000,
        budget: SpeculationBudget | None = None,
        on_event: Callable[[Event], None] | None = None,
        capture_namespace: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.engine = engine
        self.sub_engine = sub_engine or engine
        self.registry = ToolRegistry()
        if builtin_tools:
            if sub_sampling is None:  # sub-queries yield to the root's stream on a shared engine
                sub_sampling = SamplingParams(priority=SUB_QUERY_PRIORITY)
            for t in make_llm_tools(self.sub_engine, sub_sampling):
                self.registry.register(t)
        for t in tools:
            self.registry.register(t)
        self.speculation = speculation
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.examples = (list(examples) if examples is not None
                         else prompts.default_examples(system_prompt, self.registry.names()))
        self.sampling = sampling or SamplingParams(max_tokens=1024)
        self.repl_limits = repl_limits or ReplLimits()
        self.max_observation_chars = max_observation_chars
        self.budget = budget or SpeculationBudget()
        self.on_event = on_event
        self.capture_namespace = capture_namespace

    def run_sync(self, task: str, context: Any = None) -> RunResult:
        """Blocking form of `run`."""
        return anyio.run(self.run, task, context)

    async def run(self, task: str, context: Any = None) -> RunResult:
        """Run the agent on ``task``; ``context`` becomes the REPL variable ``context``."""
        run = _Run(self, task, context)
        return await run.execute()


class _Run:
    """State of one `Agent.run`."""

    def __init__(self, agent: Agent, task: str, context: Any) -> None:
        self.agent = agent
        self.task = task
        self.context = context
        self.trace = Trace(agent.on_event)
        self.stats = RunStats()
        self.turns: list[TurnRecord] = []
        self.repl: Repl | None = None
        self.answer: Any = None
        self.finished = False
        self.spec: Speculator | None = None
        self.stopped_s: float | None = None
        """When the run stopped on an error (tearing the sandbox down is not counted)."""
        self._call_ids = 0
        self._current_block: tuple[int, int] = (0, 0)
        self._repl_ready = anyio.Event()
        self._repl_error: BaseException | None = None

    async def _start_repl(self, repl: Repl, context: Any) -> None:
        """Start the sandbox and bind ``context``; a failure is raised by the first block."""
        try:
            await repl.start()
            await repl.set_variable("context", context)
        except Exception as exc:
            self._repl_error = exc
        finally:
            self._repl_ready.set()

    async def _repl(self) -> Repl:
        """The started sandbox (waits for its start; raises its start error)."""
        await self._repl_ready.wait()
        if self._repl_error is not None:
            raise self._repl_error
        assert self.repl is not None
        return self.repl

    # -- tools -------------------------------------------------------------------------------

    async def call_tool(self, name: str, args: tuple, kwargs: dict, line: int | None = None) -> Any:
        """The REPL's tool handler for the authoritative run: claim or invoke, trace, count.

        Every call the program makes ends with a ``program_call`` event (digests of its arguments
        and outcome, in program order, hits and misses alike), so that runs with and without
        speculation can be compared call by call."""
        try:
            value = await self._serve_call(name, args, kwargs, line)
        except Exception as exc:
            self.trace.emit("program_call", **call_digests(self.agent.registry, name, args, kwargs,
                                                           error=exc))
            raise
        self.trace.emit("program_call", **call_digests(self.agent.registry, name, args, kwargs,
                                                       value=value))
        return value

    async def _serve_call(self, name: str, args: tuple, kwargs: dict, line: int | None) -> Any:
        turn, block = self._current_block
        if self.spec is not None:
            hit, value = await self.spec.claim(name, args, kwargs, block=block)
            if hit:
                return value
        self._call_ids += 1
        return await traced_call(self.agent.registry, self.trace, self.stats, name, args, kwargs,
                                 call_id=self._call_ids, mode="sync", turn=turn, block=block,
                                 lineno=line)

    # -- the loop ----------------------------------------------------------------------------

    async def execute(self) -> RunResult:
        agent = self.agent
        self.trace.emit("run_started", task=self.task)
        status, error = "max_turns", None
        end: float | None = None
        namespace: dict[str, str] | None = None
        try:
            signatures = {t.name: t.signature_line() for t in agent.registry}
            context = to_plain(self.context)  # not plain data: a TypeError now, as before
            async with contextlib.AsyncExitStack() as stack:
                repl = Repl(self.call_tool, signatures, limits=agent.repl_limits)
                stack.push_async_callback(repl.aclose)
                self.repl = repl
                if agent.speculation:
                    self.spec = await stack.enter_async_context(
                        Speculator(repl, agent.registry, agent.budget, self.trace, self.stats,
                                   ready=self._repl_ready)
                    )
                # The sandbox starts while the model streams its first tokens; the first block
                # (and the first shadow) wait for it.
                failure: Exception | None = None
                async with anyio.create_task_group() as starter:
                    starter.start_soon(self._start_repl, repl, context)
                    try:
                        status, end, namespace = await self._converse()
                    except Exception as exc:  # raised below, outside the task group
                        failure = exc
                if failure is not None:
                    raise failure
        except (EngineError, ReplError) as exc:
            end = self.stopped_s
            status, error = "error", f"{type(exc).__name__}: {exc}"
            self.trace.emit("run_error", error=error)
        wall = self.trace.now() if end is None else end
        self.trace.emit("run_finished", status=status, answer=repr(self.answer)[:200])
        return RunResult(
            answer=self.answer, status=status, turns=self.turns, stats=self.stats,
            wall_s=wall, trace=self.trace, error=error, namespace=namespace,
        )

    async def _converse(self) -> tuple[str, float | None, dict[str, str] | None]:
        """The turns of the run: (status, end time, namespace summary)."""
        status, namespace = "max_turns", None
        messages = self._initial_messages()
        for index in range(self.agent.max_turns):
            turn = await self._turn(index, messages)
            if self.finished:
                status = "final"
                break
            messages.append({"role": "assistant", "content": turn.response})
            messages.append({"role": "user", "content": turn.observation})
        end = self.trace.now()  # the answer is known; closing the sandbox is not waited on
        if self.agent.capture_namespace:
            summary = await (await self._repl()).namespace_summary()
            namespace = {k: f"{v.type_name}: {v.repr}" for k, v in summary.items()}
        return status, end, namespace

    def _initial_messages(self) -> list[Message]:
        lines = self.agent.registry.render_signatures()
        system = prompts.system_prompt(lines, self.context, self.agent.system_prompt)
        return [
            {"role": "system", "content": system},
            *self.agent.examples,
            {"role": "user", "content": self.task},
        ]

    async def _turn(self, index: int, messages: Sequence[Message]) -> TurnRecord:
        turn = TurnRecord(index=index, started_s=self.trace.now())
        self.turns.append(turn)
        self.trace.emit("turn_started", turn=index)
        send, receive = anyio.create_memory_object_stream[BlockClosed](math.inf)
        segmenter = CodeStream()
        text: list[str] = []
        stream_error: EngineError | None = None
        if self.spec is not None:
            self.spec.start_turn(index)

        async def run_blocks() -> None:
            async with receive:
                async for block in receive:
                    if not self.finished:
                        await self._run_block(turn, block)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_blocks)
            with send:
                try:
                    stream = self.agent.engine.stream(messages, self.agent.sampling)
                    async with contextlib.aclosing(stream) as deltas:
                        async for delta in deltas:
                            if delta.text:
                                text.append(delta.text)
                                self.trace.emit(
                                    "delta", turn=index, chars=len(delta.text), text=delta.text
                                )
                                self._segment(turn, segmenter.feed(delta.text), send)
                                if (self.spec is not None and "\n" in delta.text
                                        and segmenter.in_block):
                                    self.spec.open_block_grew(segmenter.open_tail)
                            if delta.finish_reason is not None:
                                turn.finish_reason = delta.finish_reason
                            if delta.usage is not None:
                                turn.completion_tokens = delta.usage.completion_tokens
                            if self.finished:
                                turn.finish_reason = "final"
                                break
                    self._segment(turn, segmenter.finish(), send)
                except EngineError as exc:
                    stream_error = exc
                    self.stopped_s = self.trace.now()
        if self.spec is not None:
            await self.spec.end_turn()
        if self._repl_error is not None:
            self.stopped_s = self.trace.now()
            raise self._repl_error
        turn.response = "".join(text)
        if stream_error is not None:
            turn.finished_s = self.trace.now()
            raise stream_error
        if not self.finished:
            await self._final_from_prose(turn)
        turn.observation = prompts.observation(
            [(b.stdout, b.error) for b in turn.blocks], self.agent.max_observation_chars
        )
        for block in turn.blocks:
            self.agent.engine.remember(block.code)
        turn.finished_s = self.trace.now()
        self.trace.emit(
            "turn_finished", turn=index, finish_reason=turn.finish_reason,
            completion_tokens=turn.completion_tokens,
        )
        return turn

    def _segment(self, turn: TurnRecord, events: list, send) -> None:
        for ev in events:
            if isinstance(ev, BlockOpened):
                self.trace.emit("block_opened", turn=turn.index, block=ev.index)
            elif isinstance(ev, StatementClosed):
                self.trace.emit(
                    "statement_closed", turn=turn.index, block=ev.block_index,
                    stmt=ev.stmt_index, lineno=ev.lineno,
                )
                if self.spec is not None:
                    self.spec.statement_closed(ev.block_index, ev.lineno, ev.end_lineno,
                                               ev.source)
            elif isinstance(ev, BlockClosed):
                self.trace.emit(
                    "block_closed", turn=turn.index, block=ev.block_index, chars=len(ev.code),
                    unterminated=ev.unterminated,
                )
                send.send_nowait(ev)
                if self.spec is not None:
                    self.spec.block_closed(ev.block_index, ev.code)

    async def _run_block(self, turn: TurnRecord, block: BlockClosed) -> None:
        await self._repl_ready.wait()
        if self._repl_error is not None:
            self.finished = True  # the run stops: the error is raised after the turn
            return
        assert self.repl is not None
        record = BlockRecord(code=block.code, started_s=self.trace.now())
        turn.blocks.append(record)
        self.trace.emit("exec_started", turn=turn.index, block=block.block_index)
        self._current_block = (turn.index, block.block_index)
        if self.spec is not None:
            self.spec.block_started(block.block_index)
        result = await self.repl.execute(block.code)
        if self.spec is not None:
            self.spec.block_executed(block.block_index)
        record.stdout, record.error = result.stdout, result.error
        record.finished_s = self.trace.now()
        if result.final is not None:
            self.answer = result.final.value
            self.finished = True
        self.trace.emit(
            "exec_finished", turn=turn.index, block=block.block_index, error=result.error,
            final=result.final is not None,
        )

    async def _final_from_prose(self, turn: TurnRecord) -> None:
        """Honour ``FINAL(...)`` / ``FINAL_VAR(name)`` written as text outside code blocks."""
        prose = _FENCED.sub("", turn.response)
        match = _TEXT_FINAL_VAR.search(prose)
        if match:
            repl = await self._repl()
            try:
                self.answer = await repl.get_variable(match.group(1))
            except (KeyError, NameError):
                return
            self.finished = True
            return
        match = _TEXT_FINAL.search(prose)
        if match:
            self.answer = match.group(1).strip()
            self.finished = True
