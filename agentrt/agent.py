"""`Agent`: the RLM-style loop — stream a response, run its code blocks, feed back what they printed.

Every run ends with a `RunResult`: an exception from the engine, the sandbox, the shadow
interpreter or the loop itself ends the run with ``status="error"``, the cause in ``error`` (what
failed, where, and its message) and the trace complete. Only the caller's own cancellation
propagates; Ctrl-C during `Agent.run_sync` is `RunInterrupted` (see `Agent.run_sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import signal
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import anyio

from agentrt.engine.base import Delta, Engine, Message, SamplingParams
from agentrt.interpreter.jail import JailUnavailable
from agentrt.interpreter.repl import Repl, ReplLimits
from agentrt.interpreter.repl.pool import PoolLease, WorkerSpec, shared_pool
from agentrt.interpreter.protocol import to_plain
from agentrt.tools import DEFAULT_TOOL_TIMEOUT_S, Tool, ToolRegistry

from . import prompts
from .errors import AgentrtError
from .events import RunError, RunFinished, RunStarted
from .ledger import SpeculationBudget
from .llm_tools import make_llm_tools
from .program_calls import ProgramCalls
from .results import BlockRecord, RunInterrupted, RunResult, RunStats, TurnRecord
from .speculation import LAUNCH_WINDOW, NoSpeculation, Speculator
from .trace import Event, Trace
from .turn import Block, Turn

log = logging.getLogger(__name__)
_TEXT_FINAL_VAR = re.compile(r"FINAL_VAR\(\s*['\"]?([A-Za-z_][A-Za-z_0-9]*)['\"]?\s*\)")
_TEXT_FINAL = re.compile(r"FINAL\((.*)\)")

SUB_QUERY_PRIORITY = 1
"""Default `SamplingParams.priority` of ``llm_query`` requests (the root streams at 0)."""
INTERRUPT_GRACE_S = 0.5
"""After Ctrl-C, how long `Agent.run_sync` waits for the run to wind down by cancellation before
it raises `KeyboardInterrupt` in the main thread itself (code that blocks the event loop)."""


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
    the native engine, keeps the root's stream going first). ``speculation`` runs the shadow
    interpreter, which starts speculatable tool calls while the code is still streaming; answers
    are identical either way. ``speculation_budget`` bounds those early calls (tokens are
    drafted by the engine: see its own options). ``speculation_window`` bounds the early calls
    a loop still being streamed may launch per call site beyond the first one its exit may wait
    on (a ``break`` on a result may not have streamed yet; default `LAUNCH_WINDOW`; 0: one at a
    time); once the statement is complete it is followed exactly and not throttled.
    ``on_event`` sees every trace event as it happens (for live displays).
    ``capture_namespace`` records the REPL's final variables in ``RunResult.namespace``.
    ``tool_timeout`` limits each call of a tool that sets no ``timeout`` of its own (seconds,
    ``math.inf`` for none; the built-in ``llm_query`` tools have none: their engine bounds them).
    ``warm_repls``: sandbox worker processes kept started and ready in the process-wide pool
    (`agentrt.interpreter.repl.pool.shared_pool`, shared with other agents and bounded), so
    that a run's first block does not wait for the sandbox to start; each run takes one and
    a fresh one replaces it in the background (a worker never serves two runs). 0: none,
    each run starts its own. `close` (or leaving ``with Agent(...)``, or the agent being
    garbage-collected) gives them back; they are stopped at interpreter exit in any case.
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
        speculation_budget: SpeculationBudget | None = None,
        speculation_window: int = LAUNCH_WINDOW,
        on_event: Callable[[Event], None] | None = None,
        capture_namespace: bool = False,
        tool_timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        warm_repls: int = 1,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if type(warm_repls) is not int or warm_repls < 0:
            raise ValueError(f"warm_repls must be an int >= 0, got {warm_repls!r}")
        if type(speculation_window) is not int or speculation_window < 0:
            raise ValueError(
                f"speculation_window must be an int >= 0, got {speculation_window!r}")
        self.engine = engine
        self.sub_engine = sub_engine or engine
        self.registry = ToolRegistry(default_timeout=tool_timeout)
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
        self.speculation_budget = speculation_budget or SpeculationBudget()
        self.speculation_window = speculation_window
        self.on_event = on_event
        self.capture_namespace = capture_namespace
        self.warm_repls = warm_repls
        self._pool_lease: PoolLease | None = None
        if warm_repls:
            try:  # plans the jail once per process (~10 ms); its failure is the run's to report
                spec = WorkerSpec.for_limits(self.repl_limits)
            except JailUnavailable:
                spec = None
            if spec is not None:
                self._pool_lease = shared_pool().reserve(spec, warm_repls)
                weakref.finalize(self, self._pool_lease.release)

    def close(self) -> None:
        """Give back the warm sandbox workers this agent reserved (idempotent; runs already
        started keep their own)."""
        if self._pool_lease is not None:
            self._pool_lease.release()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run_sync(self, task: str, context: Any = None) -> RunResult:
        """Blocking form of `run`.

        Ctrl-C (SIGINT, when called from the main thread with Python's default handler in
        place) stops the run whatever it is doing: the run is cancelled (the sandbox's worker
        processes are killed, abandoned tool threads are left behind as daemons) and
        `RunInterrupted`, a `KeyboardInterrupt`, is raised; its ``result`` holds the run so far
        (``status="interrupted"``, the turns and the trace up to the interrupt, which
        ``on_event`` saw too). Code that blocks the event loop is interrupted by a
        `KeyboardInterrupt` raised in it after `INTERRUPT_GRACE_S`; a second Ctrl-C does so
        at once.
        """
        run = _Run(self, task, context)
        with _SigintCancels(run) as sigint:
            try:
                result = anyio.run(_until_cancelled, run, sigint)
            except (KeyboardInterrupt, BaseExceptionGroup) as exc:  # in code blocking the loop
                if isinstance(exc, BaseExceptionGroup) and not exc.subgroup(KeyboardInterrupt):
                    raise
                run.interrupted = True
                result = None
        if run.interrupted:
            raise RunInterrupted(result or run.interrupted_result())
        assert result is not None
        return result

    async def run(self, task: str, context: Any = None) -> RunResult:
        """Run the agent on ``task``; ``context`` (plain data, else a `TypeError` at once)
        becomes the REPL variable ``context``. Always returns a `RunResult`; only a
        cancellation of the caller's own propagates."""
        run = _Run(self, task, context)
        return await run.execute()


async def _until_cancelled(run: _Run, sigint: _SigintCancels) -> RunResult | None:
    """``run.execute()``, or None when Ctrl-C cancelled it."""
    with anyio.CancelScope() as scope:
        sigint.arm(scope)
        return await run.execute()
    return None


class _SigintCancels:
    """While active (in the main thread, over Python's default SIGINT handler), the first
    SIGINT cancels the run's scope from the event loop; if the loop has not taken that up
    `INTERRUPT_GRACE_S` later (code blocking it), SIGINT is sent again, and a second SIGINT
    raises `KeyboardInterrupt` where the main thread is."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self._scope: anyio.CancelScope | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._active = False
        self._cancelled = False
        """The loop has cancelled the run's scope (it is responsive: no need to escalate)."""
        self._timer: threading.Timer | None = None
        self._previous: Any = None

    def __enter__(self) -> _SigintCancels:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            was_active, self._active = self._active, False
            if self._timer is not None:
                self._timer.cancel()
        if was_active:
            signal.signal(signal.SIGINT, self._previous)

    def arm(self, scope: anyio.CancelScope) -> None:
        """The run is under ``scope`` in the running loop (a SIGINT already seen cancels it)."""
        self._scope, self._loop = scope, asyncio.get_running_loop()
        if self.run.interrupted:
            self._cancel()

    def _cancel(self) -> None:
        assert self._scope is not None
        self._cancelled = True
        self._scope.cancel()

    def _on_sigint(self, signum: int, frame: object) -> None:
        if not self._active:
            return
        if self.run.interrupted:
            raise KeyboardInterrupt
        self.run.interrupted = True
        if self._scope is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                self._loop.call_soon_threadsafe(self._cancel)
        self._timer = threading.Timer(INTERRUPT_GRACE_S, self._escalate)
        self._timer.daemon = True
        self._timer.start()

    def _escalate(self) -> None:
        with self._lock:
            if self._active and not self._cancelled:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class _Listener:
    """``on_event`` kept from stopping the run: what it raises is logged, not propagated."""

    def __init__(self, on_event: Callable[[Event], None]) -> None:
        self.on_event = on_event

    def __call__(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception:
            log.exception("the on_event listener failed on a %r event", event.kind)


class _Failure(AgentrtError):
    """What stopped a run: ``cause``, raised by ``where`` (e.g. ``"turn 2, engine 'openai'"``),
    at ``at`` seconds into the run."""

    def __init__(self, where: str, cause: BaseException, at: float) -> None:
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.where, self.cause, self.at = where, cause, at


def _stopping_failure(exc: BaseException) -> BaseException:
    """The exception that stopped the run: the first `_Failure` in a task group's failure, else
    its first leaf that is not a cancellation."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [_stopping_failure(e) for e in exc.exceptions]
    for leaf in leaves:
        if isinstance(leaf, _Failure):
            return leaf
    for leaf in leaves:
        if not isinstance(leaf, anyio.get_cancelled_exc_class()):
            return leaf
    return leaves[0]


_INTERRUPTED = "KeyboardInterrupt: the run was interrupted (Ctrl-C)"


def _cancel_requested() -> bool:
    """Whether the current task is being cancelled (by its caller, at this point)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Run:
    """State of one `Agent.run`."""

    def __init__(self, agent: Agent, task: str, context: Any) -> None:
        self.agent = agent
        self.task = task
        self.context = context
        self.trace = Trace(None if agent.on_event is None else _Listener(agent.on_event))
        self.stats = RunStats()
        self.turns: list[TurnRecord] = []
        self.repl: Repl | None = None
        self.answer: Any = None
        self.finished = False
        self.calls = ProgramCalls(agent.registry, self.trace, self.stats)
        """The program's tool calls, and the run's speculator (a `NoSpeculation` when off)."""
        self.interrupted = False
        """Ctrl-C stopped the run (`Agent.run_sync`)."""
        self._repl_ready = anyio.Event()
        self._repl_error: BaseException | None = None

    async def _hold_repl(self, repl: Repl, context: Any, release: anyio.Event) -> None:
        """Start the sandbox and bind ``context``, then keep it open until ``release`` (or this
        task is cancelled); a start failure is raised by the first block."""
        try:
            async with repl:
                await repl.set_variable("context", context)
                self._repl_ready.set()
                await release.wait()
        except Exception as exc:
            if not self._repl_ready.is_set():
                self._repl_error = _Failure("starting the sandbox", exc, self.trace.now())
        finally:
            self._repl_ready.set()

    async def _repl(self) -> Repl:
        """The started sandbox (waits for its start; raises its start error)."""
        await self._repl_ready.wait()
        if self._repl_error is not None:
            raise self._repl_error
        assert self.repl is not None
        return self.repl

    async def _in_sandbox(self, where: str, call: Callable[[Repl], Any]) -> Any:
        """``await call(repl)``; its exception becomes a `_Failure` of the sandbox at ``where``."""
        repl = await self._repl()
        try:
            return await call(repl)
        except Exception as exc:
            raise _Failure(f"{where}, sandbox", exc, self.trace.now()) from exc

    # -- the loop ----------------------------------------------------------------------------

    async def execute(self) -> RunResult:
        agent = self.agent
        context = to_plain(self.context)  # not plain data: a TypeError now, as before
        self.trace.emit(RunStarted(self.task))
        status, error, failure = "max_turns", None, None
        end: float | None = None
        namespace: dict[str, str] | None = None
        try:
            signatures = {t.name: t.signature_line() for t in agent.registry}
            repl = Repl(self.calls.call, signatures, limits=agent.repl_limits,
                        pool=shared_pool() if agent._pool_lease is not None else None)
            self.repl = repl
            # The sandbox starts while the model streams its first tokens, in a task that holds
            # it open for the run; the first block (and the first shadow) wait for it.
            if agent.speculation:
                self.calls.speculator = Speculator(repl, agent.registry, agent.speculation_budget,
                                             self.trace, self.stats, ready=self._repl_ready,
                                             window=agent.speculation_window)
            release = anyio.Event()
            stopped: Exception | None = None
            async with anyio.create_task_group() as holder:
                holder.start_soon(self._hold_repl, repl, context, release)
                try:
                    async with self.calls.speculator:
                        status, end, namespace = await self._converse()
                except Exception as exc:  # raised below, outside the task group
                    stopped = exc
                finally:
                    release.set()
            if stopped is not None:
                raise stopped
        except Exception as exc:
            if _cancel_requested():  # the caller cancelled the run while it was failing
                self._emit_stopped()
                raise anyio.get_cancelled_exc_class()() from exc
            failure = _stopping_failure(exc)
            end = failure.at if isinstance(failure, _Failure) else self.trace.now()
            status, error = "error", str(failure) if isinstance(failure, _Failure) \
                else f"{type(failure).__name__}: {failure}"
            self.trace.emit(RunError(error))
        except BaseException:
            self._emit_stopped()
            raise
        finally:
            self._drop_run_state()
        wall = self.trace.now() if end is None else end
        self.trace.emit(RunFinished(status, repr(self.answer)[:200]))
        return RunResult(
            answer=self.answer, status=status, turns=self.turns, stats=self.stats,
            wall_s=wall, trace=self.trace, error=error, namespace=namespace,
            exception=failure.cause if isinstance(failure, _Failure) else failure,
        )

    def _drop_run_state(self) -> None:
        """The run is over: let go of the sandbox and the speculator (the speculator has
        released what it held), so that nothing of the run outlives it but its result."""
        self.repl = None
        self.calls.speculator = NoSpeculation()

    def interrupted_result(self) -> RunResult:
        """The run so far, after Ctrl-C stopped it (its trace ends with ``run_finished``)."""
        if not self.trace.events or self.trace.events[-1].kind != "run_finished":
            self._emit_stopped()
        return RunResult(
            answer=self.answer, status="interrupted", turns=self.turns, stats=self.stats,
            wall_s=self.trace.now(), trace=self.trace, error=_INTERRUPTED,
        )

    def _emit_stopped(self) -> None:
        """End the trace of a run that Ctrl-C interrupted or its caller cancelled."""
        if self.interrupted:
            self.trace.emit(RunError(_INTERRUPTED))
        self.trace.emit(RunFinished("interrupted" if self.interrupted else "cancelled",
                                    repr(self.answer)[:200]))

    async def _converse(self) -> tuple[str, float | None, dict[str, str] | None]:
        """The turns of the run: (status, end time, namespace summary)."""
        status, namespace = "max_turns", None
        messages = self._initial_messages()
        for index in range(self.agent.max_turns):
            try:
                turn = await self._turn(index, messages)
            except Exception as exc:  # the engine's, the sandbox's, or another part of the turn
                failure = _stopping_failure(exc)
                if not isinstance(failure, _Failure):
                    failure = _Failure(f"turn {index}", failure, self.trace.now())
                raise failure from exc
            if self.finished:
                status = "final"
                break
            messages.append({"role": "assistant", "content": turn.response})
            messages.append({"role": "user", "content": turn.observation})
        end = self.trace.now()  # the answer is known; closing the sandbox is not waited on
        if self.agent.capture_namespace:
            summary = await self._in_sandbox("capturing the namespace",
                                             lambda repl: repl.namespace_summary())
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
        record = TurnRecord(index=index, started_s=self.trace.now())
        self.turns.append(record)
        send, receive = anyio.create_memory_object_stream[Block](math.inf)
        turn = Turn(index, self.calls, on_block=send.send_nowait)
        text: list[str] = []
        stream_error: _Failure | None = None
        turn.start()

        async def run_blocks() -> None:
            async with receive:
                async for block in receive:
                    if not self.finished:
                        await self._run_block(record, turn, block)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_blocks)
                with send:
                    try:
                        async with contextlib.aclosing(self._deltas(index, messages)) as deltas:
                            async for delta in deltas:
                                self._take(record, turn, delta, text)
                                if self.finished:
                                    record.finish_reason = "final"
                                    break
                        turn.finish()
                    except _Failure as failure:  # the blocks already closed still run
                        stream_error = failure
            await turn.end_speculation()
        finally:
            record.response = "".join(text)
            record.finished_s = self.trace.now()
        if self._repl_error is not None:
            raise self._repl_error
        if stream_error is not None:
            raise stream_error
        if not self.finished:
            await self._final_from_prose(record, turn.prose)
        record.observation = prompts.observation(
            [(b.stdout, b.error) for b in record.blocks], self.agent.max_observation_chars
        )
        for block in record.blocks:
            try:
                self.agent.engine.remember(block.code)
            except Exception as exc:
                raise _Failure(f"{self._engine_where(index)}.remember()", exc,
                               self.trace.now()) from exc
        record.finished_s = self.trace.now()
        turn.finished(record.finish_reason, record.completion_tokens)
        return record

    async def _deltas(self, index: int, messages: Sequence[Message]) -> AsyncIterator[Delta]:
        """The engine's stream for this turn; whatever it raises (or yields that is not a
        `Delta` of text) becomes a `_Failure` of the engine."""
        engine = self.agent.engine
        try:
            async with contextlib.aclosing(engine.stream(messages, self.agent.sampling)) as deltas:
                async for delta in deltas:
                    if not isinstance(delta, Delta) or not isinstance(delta.text, str):
                        raise TypeError(f"the stream yielded {delta!r:.100}, not a Delta of text")
                    yield delta
        except Exception as exc:
            raise _Failure(self._engine_where(index), exc, self.trace.now()) from exc

    def _engine_where(self, index: int) -> str:
        engine = self.agent.engine
        return f"turn {index}, engine {getattr(engine, 'name', type(engine).__name__)!r}"

    @staticmethod
    def _take(record: TurnRecord, turn: Turn, delta: Delta, text: list[str]) -> None:
        """Record one delta of the response and pass its text to the turn."""
        if delta.text:
            text.append(delta.text)
            turn.feed(delta.text)
        if delta.finish_reason is not None:
            record.finish_reason = delta.finish_reason
        if delta.usage is not None:
            record.completion_tokens = delta.usage.completion_tokens

    async def _run_block(self, record: TurnRecord, turn: Turn, block: Block) -> None:
        await self._repl_ready.wait()
        if self._repl_error is not None:
            self.finished = True  # the run stops: the error is raised after the turn
            return
        assert self.repl is not None
        executed = BlockRecord(code=block.code, started_s=self.trace.now())
        record.blocks.append(executed)
        where = f"turn {turn.index}, block {block.index}"
        try:
            result = await turn.execute(block, lambda code: self._in_sandbox(
                where, lambda repl: repl.execute(code)))
        except _Failure as failure:
            executed.error, executed.finished_s = str(failure), failure.at
            raise
        executed.stdout, executed.error = result.stdout, result.error
        executed.finished_s = self.trace.now()
        if result.final is not None:
            self.answer = result.final.value
            self.finished = True

    async def _final_from_prose(self, turn: TurnRecord, prose: str) -> None:
        """Honour ``FINAL(...)`` / ``FINAL_VAR(name)`` written in the response's prose (the
        segmenter's: outside code and other fenced blocks)."""
        match = _TEXT_FINAL_VAR.search(prose)
        if match:
            name = match.group(1)
            try:
                self.answer = await self._in_sandbox(f"turn {turn.index}, FINAL_VAR({name})",
                                                     lambda repl: repl.get_variable(name))
            except _Failure as failure:
                if isinstance(failure.cause, (KeyError, NameError)):
                    return  # no such variable: not an answer
                raise
            self.finished = True
            return
        match = _TEXT_FINAL.search(prose)
        if match:
            self.answer = match.group(1).strip()
            self.finished = True
