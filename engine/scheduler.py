"""Scheduling: which requests run in a step, with how many rows, and where their keys live.

The `Scheduler` owns the requests waiting and running and their blocks of the `KVPool`:

* **Admission.** Waiting requests start, most urgent first (lower ``priority``, then arrival),
  when blocks for all their known tokens fit; prompts share the cached blocks of earlier
  requests with the same prefix (the prefix cache) and copy the matching start of the next,
  partly filled one. A request whose prompt shares a block-sized prefix with one still
  prefilling waits until those blocks are cached.
* **Preemption.** A request that does not fit preempts running requests less urgent than it;
  one that needs a block mid-decode preempts the least urgent, latest one, or goes back to
  waiting itself. Preempted requests give their blocks back (indexed ones stay cached) and
  recompute later, with identical results.
* **Priorities.** While a request of priority p decodes, less urgent ones share only some
  steps: a step of the urgent requests alone earns ``t / share - t`` seconds of credit, a
  shared step spends what it took beyond an urgent-only one, and shared steps run while the
  credit is not negative; less urgent prompts prefill at most ``background_prefill_tokens`` per
  shared step.
* **A step's plan.** `plan` turns the step's requests and their drafts into a `StepPlan`:
  decoding requests feed their last token and draft (blocks grown for them, the draft cut to
  what fits), prefilling ones a chunk of their prompt, within ``max_batch_tokens`` rows, or
  ``step_token_budget`` rows while requests decode (their last tokens always run; drafts and
  prompt chunks fill what is left), so that their time between tokens stays bounded while new
  prompts prefill. After the step, `written` counts the positions that now hold keys and
  values.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from .drafters.base import common_prefix
from .kv_cache import KVPool
from .metrics import BatchMetrics
from .native_config import SchedulingOptions
from .sequence import RequestState
from .step_plan import DecodeRows, DraftChoice, PrefillRows, Selection, StepPlan


class Scheduler:
    """Waiting and running requests over one `KVPool` (see the module docstring), as
    ``options`` say, with at most ``max_batch_tokens`` rows a step and the prefix cache on or
    off. Runs on the engine's worker thread only; ``stats`` (guarded by ``lock``) gets its
    admission, prefix-hit and preemption counts."""

    def __init__(self, pool: KVPool, options: SchedulingOptions, prefix_cache: bool,
                 max_batch_tokens: int, stats: BatchMetrics, lock: threading.Lock):
        self.pool = pool
        self.options = options
        self.prefix_cache = prefix_cache
        self.max_batch_tokens = max_batch_tokens
        self.stats, self.lock = stats, lock
        self.waiting: list[RequestState] = []
        self.running: list[RequestState] = []
        self.credit = 0.0
        """Seconds less urgent requests may still slow the urgent stream by."""
        self.urgent_alone_s = 0.0
        """Recent duration of a step of urgent requests only."""

    def add(self, seq: RequestState) -> None:
        """A new request: it waits until `admit` gives it blocks."""
        self.waiting.append(seq)

    def in_flight(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def forget(self, prefix_cache: bool) -> None:
        """Clear the priority credit and, with ``prefix_cache``, every cached block (only while
        nothing is in flight)."""
        if prefix_cache:
            self.pool.forget()
        self.credit, self.urgent_alone_s = 0.0, 0.0

    # ------------------------------------------------------------------------- admission

    def drop_cancelled(self) -> None:
        """Requests whose consumer went away leave, and their blocks go back."""
        for seq in [s for s in self.waiting if s.job.cancelled.is_set()]:
            self.waiting.remove(seq)
            seq.end_drafting()  # preempted after it started
        for seq in [s for s in self.running if s.job.cancelled.is_set()]:
            self.release(seq)

    def admit(self) -> list[RequestState]:
        """Move waiting requests to running, most urgent first, while their blocks fit; returns
        the ones that moved. A request that does not fit waits (and so do less urgent ones),
        after preempting running requests less urgent than it; one whose prompt shares a
        block-sized prefix with a request still prefilling it waits until that prefix is in the
        cache."""
        admitted = []
        for seq in sorted(self.waiting, key=lambda s: s.order):
            if len(self.running) >= self.options.max_num_seqs:
                break
            if self._prefix_in_flight(seq):
                continue
            while not self._try_admit(seq):
                victims = [s for s in self.running if s.order > seq.order]
                if not victims:
                    return admitted
                self._preempt(max(victims, key=lambda s: s.order))
            self.waiting.remove(seq)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _prefix_in_flight(self, seq: RequestState) -> bool:
        if not self.prefix_cache:
            return False
        bs = self.pool.block_size
        for other in self.running:
            if other.computed < len(other.tokens) - 1:  # still prefilling
                shared = common_prefix(other.tokens, seq.tokens[:len(seq.tokens) - 1])
                if shared >= other.computed + bs and shared >= bs:
                    return True
        return False

    def _try_admit(self, seq: RequestState) -> bool:
        """Give ``seq`` blocks for all its known tokens (cached prefix shared, the rest fresh)."""
        pool = self.pool
        limit = len(seq.tokens) - 1  # the last token is always run: its logits are needed
        hits, chain, partial, partial_n = [], KVPool.ROOT, None, 0
        if self.prefix_cache:
            hits, chain, partial, partial_n = pool.match(seq.tokens, limit)
        pool.take(hits)
        if partial is not None:
            pool.take([partial])
        need = pool.blocks_for(len(seq.tokens)) - len(hits)
        if pool.available() < need:
            pool.release(hits + ([partial] if partial is not None else []))
            return False
        fresh = [pool.allocate() for _ in range(need)]
        if partial is not None:
            if fresh:
                pool.copy_positions(partial, fresh[0], partial_n)
            else:
                partial_n = 0
            pool.release([partial])
        seq.blocks = hits + fresh
        seq.computed = len(hits) * pool.block_size + partial_n
        seq.chain, seq.indexed = chain, len(hits)
        seq.metrics.cached_tokens += seq.computed
        with self.lock:
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
                seq.metrics.queue_s = seq.admitted_at - seq.job.submitted
                self.stats.requests += 1
                self.stats.queue_s += seq.metrics.queue_s
            self.stats.cached_tokens += seq.computed
        return True

    def _preempt(self, seq: RequestState) -> None:
        """Give ``seq``'s blocks back (its indexed blocks stay cached) and make it wait again."""
        self._index_tail(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.indexed, seq.chain = [], 0, 0, KVPool.ROOT
        seq.metrics.preemptions += 1
        with self.lock:
            self.stats.preemptions += 1
        self.running.remove(seq)
        self.waiting.append(seq)

    def release(self, seq: RequestState) -> None:
        """``seq`` leaves: its blocks go back to the pool (indexed ones stay cached)."""
        self._index_tail(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        if seq in self.running:
            self.running.remove(seq)
        seq.end_drafting()

    # ------------------------------------------------------------------- prefix index

    def written(self, seq: RequestState, n: int) -> None:
        """``n`` more positions of ``seq`` hold keys and values (its tokens already extended
        past them): count them and index the blocks that became full."""
        seq.computed += n
        self.index_full(seq)

    def index_full(self, seq: RequestState) -> None:
        """Register ``seq``'s blocks that became full of known tokens in the prefix index."""
        bs = self.pool.block_size
        while (seq.indexed + 1) * bs <= seq.computed:
            j = seq.indexed
            seq.chain = self.pool.register(seq.blocks[j], seq.chain, seq.tokens[j * bs:(j + 1) * bs])
            seq.indexed += 1

    def _index_tail(self, seq: RequestState) -> None:
        """Index the full blocks not indexed yet, then the partly filled last one."""
        self.index_full(seq)
        bs = self.pool.block_size
        j = seq.indexed
        if j < len(seq.blocks) and seq.computed > j * bs:
            self.pool.register_partial(seq.blocks[j], seq.chain, seq.tokens[j * bs:seq.computed])

    # ----------------------------------------------------------------------------- a step

    def select(self) -> Selection:
        """The running requests that take part in the next step, in scheduling order: all of
        them, except that less urgent ones sit out while the priority credit is negative."""
        order = sorted(self.running, key=lambda s: s.order)
        urgent = min((s.priority for s in order if s.decoding), default=None)
        throttled = urgent is not None and any(s.priority > urgent for s in order)
        shared = throttled and self.credit >= 0
        if throttled and not shared:
            order = [s for s in order if s.priority <= urgent]
        return Selection(order, [s for s in order if s.decoding], urgent, throttled, shared)

    def plan(self, selection: Selection, drafts: Mapping[RequestState, DraftChoice]) -> StepPlan:
        """The step's `StepPlan`: each decoding request's last token and draft (``drafts``),
        blocks grown for them and the draft cut to the rows that fit (a request that can get
        none waits again), then prefill chunks in scheduling order within ``max_batch_tokens``
        rows. While requests decode, ``step_token_budget`` bounds the step's rows: every
        decoding request's last token runs, drafts and prompt chunks fill what is left."""
        budget = self.options.step_token_budget if selection.decoding else None
        limit = self.max_batch_tokens if budget is None else min(self.max_batch_tokens, budget)
        decode: list[DecodeRows] = []
        used = 0
        for seq in selection.decoding:
            if seq not in self.running:
                continue
            choice = drafts[seq]
            want = choice.rows if budget is None else min(choice.rows, max(1, budget - used))
            rows = self._grow(seq, want)
            if rows == 0:
                if seq in self.running:  # more urgent requests hold every block: wait
                    self._preempt(seq)
                continue
            drafted = choice.tokens[:rows - 1]
            decode.append(DecodeRows(seq, drafted, choice.draft,
                                     min(choice.model_k, rows - 1 - len(drafted))))
            used += rows
        return StepPlan(selection, decode, self._prefill(selection, limit - used))

    def _prefill(self, selection: Selection, room: int) -> list[PrefillRows]:
        """Prompt chunks of the prefilling requests, in scheduling order, within ``room``
        rows (less urgent requests beside an urgent stream: ``background_prefill_tokens`` in
        all)."""
        chunks: list[PrefillRows] = []
        background = 0
        for seq in selection.order:
            if seq.decoding or seq not in self.running:
                continue
            chunk = min(len(seq.tokens) - seq.computed, self.options.prefill_chunk, room)
            if selection.throttled and seq.priority > selection.urgent:
                chunk = min(chunk, self.options.background_prefill_tokens - background)
                background += max(chunk, 0)
            if chunk <= 0:
                continue
            chunks.append(PrefillRows(seq, chunk))
            room -= chunk
        return chunks

    def _grow(self, seq: RequestState, rows: int) -> int:
        """Make blocks hold ``rows`` more rows of ``seq`` (fewer when the pool runs out; less
        urgent sequences are preempted for its first row). Returns the rows that fit, 0 when
        requests at least as urgent hold every block (``seq`` must then wait)."""
        pool = self.pool
        while pool.blocks_for(seq.computed + rows) > len(seq.blocks):
            block = pool.allocate()
            if block is not None:
                seq.blocks.append(block)
                continue
            fit = len(seq.blocks) * pool.block_size - seq.computed
            if fit >= 1:
                return fit
            victims = [s for s in self.running if s.order > seq.order]
            if victims:
                self._preempt(max(victims, key=lambda s: s.order))
                continue
            return 0
        return rows

    def account(self, selection: Selection, seconds: float) -> None:
        """Keep the credit of less urgent requests after a step of ``seconds``: a step of
        urgent requests only earns what the urgent stream may lose (``seconds / share -
        seconds``); a shared step spends what it took beyond an urgent-only step. Shared steps
        run while the credit is not negative, so over the urgent stream's life its steps take
        at most ``1 / share`` of their time alone."""
        if not selection.throttled:
            self.credit = 0.0
        elif selection.shared:
            self.credit += self.urgent_alone_s / self.options.priority_share - seconds
        else:
            self.urgent_alone_s = (seconds if self.urgent_alone_s == 0.0
                                   else 0.8 * self.urgent_alone_s + 0.2 * seconds)
            self.credit += seconds / self.options.priority_share - seconds
