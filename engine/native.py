"""The native engine: continuous batching over `llama.Transformer` with speculative decoding.

One worker thread owns the model, the paged KV cache (`kv_cache.KVPool`) and the drafter, and
runs every live request in one forward per step: each decoding request feeds its last token plus
its draft, each request still reading its prompt feeds a chunk of it, all stacked as rows of one
batch with their own positions and block tables. New requests join at the next step; finished or
cancelled ones leave at once. Each stream is fed from that thread through an asyncio queue.

A step, and who decides each part of it:

1. which requests take part, and prefix-cache hits and preemptions on admission:
   `scheduler.Scheduler` (``admit``, ``select``);
2. what each decoding request would verify: `drafting.choose_drafts` (lookups drafted, model
   draft lengths chosen; adaptive k over measured `StepCosts`);
3. the step's plan within the token and KV budgets: `Scheduler.plan` (a `StepPlan`);
4. executing it, here (`NativeEngine._step`): the model drafts into the rows reserved for them
   (`drafting.draft_models`), one forward over all rows (`Transformer.forward`), then per
   request which drafted tokens it keeps (`verify.verify` or `verify.forced_verify`), what its
   cache now holds (`Scheduler.written`), and streaming the accepted text, finishing or
   releasing the request (`NativeEngine._advance`).

With the CPU kernels every row's logits depend only on its own request's tokens, so a request's
output is the same alone or in any batch, with or without drafts, cached prefixes or preemption.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import BaseEngine, Delta, EngineError, Message, SamplingParams, Usage, check_messages
from .draft_policy import AdaptiveK, StepCosts
from .drafters.base import Draft, Drafter, DraftSampling, missing_members
from .drafters.eagle import EagleDrafter
from .drafters.hybrid import HybridDrafter
from .drafters.model import ModelDrafter
from .drafters.ngram import NgramDrafter
from .drafters.suffix import SuffixDrafter
from .drafters.twin import TwinDrafter
from .drafting import choose_drafts, draft_models
from .eagle.head import DraftHead, check_target, head_dir, model_name
from .kv_cache import KVPool
from .llama import Transformer, synchronize
from .metrics import BatchMetrics, DecodeMetrics
from .models import resolve
from .native_config import NativeConfig
from .scheduler import Scheduler
from .sequence import Job, OutputText, RequestState
from .step_plan import DecodeRows, PrefillRows
from .tokenizer import ChatTokenizer
from .verify import Uniforms, forced_verify, verify

log = logging.getLogger(__name__)


@dataclass
class _Remember:
    token_ids: list[int]


@dataclass
class _Reset:
    prefix_cache: bool
    drafter: bool
    done: concurrent.futures.Future


class NativeEngine(BaseEngine):
    """The embedded engine: SmolLM2-135M-Instruct (or any local Llama/Qwen directory) in torch,
    serving every live request in one batched forward per step.

    ``model``: a pulled model name (see `models.pull`) or a local Hugging Face directory.
    ``config``: every other option (`NativeConfig`; default: bf16 on CPU, suffix drafts,
    adaptive k). Keyword ``overrides`` name `NativeConfig` fields and replace them in
    ``config``: ``NativeEngine(drafter=None, max_seq_len=1024)`` is
    ``NativeEngine(config=NativeConfig(drafter=None, max_seq_len=1024))``.
    """

    name = "native"

    def __init__(self, model: str | os.PathLike = "smollm2-135m",
                 config: NativeConfig | None = None, **overrides: Any):
        config = (config or NativeConfig()).replace(**overrides)
        self.config = config
        target, cache = config.target, config.kv_cache
        if target.threads:
            torch.set_num_threads(target.threads)
        self.device = torch.device(target.device)
        self.model_name = model
        self.path = resolve(model, target.dtype)
        self.model = Transformer.from_pretrained(self.path, target.dtype, self.device,
                                                 target.max_seq_len, precision=target.precision)
        self.model.choose_packed_rows()
        self.tokenizer = ChatTokenizer(self.path)
        self.max_seq_len = target.max_seq_len
        self.fixed_k = config.drafting.fixed_k
        self.max_k = config.drafting.max_k
        cfg = self.model.cfg
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                           self.model.cache_dtype)
        num_blocks = cache.kv_cache_bytes // (per_token * cache.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={cache.kv_cache_bytes} holds no block of "
                             f"{cache.block_size} tokens ({per_token * cache.block_size} bytes)")
        self.pool = self.model.new_pool(num_blocks, cache.block_size)
        self._lossy = config.drafting.acceptance_threshold < 1.0
        self._metrics = DecodeMetrics(lossy=self._lossy)
        self._batch = BatchMetrics()
        self._metrics_lock = threading.Lock()
        self.scheduler = Scheduler(self.pool, config.scheduling, cache.prefix_cache,
                                   max(config.scheduling.max_batch_tokens, self.max_k + 1),
                                   self._batch, self._metrics_lock)
        self.drafter = self._make_drafter()
        self._policy: AdaptiveK | None = None
        self._seed_rng = (torch.Generator().manual_seed(config.seed)
                          if config.seed is not None else None)
        self._started = time.perf_counter()
        self._jobs: queue.Queue = queue.Queue()
        self._arrivals = itertools.count()
        self._stopping = False
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="agentrt-native", daemon=True)
        self._worker.start()

    def _make_drafter(self) -> Drafter | None:
        drafting, dtype = self.config.drafting, self.config.target.dtype
        kind, draft_model = drafting.drafter, drafting.draft_model
        if kind is None or self.fixed_k == 0:
            return None
        if not isinstance(kind, str):
            missing = missing_members(kind)
            if missing:
                raise ValueError(f"drafter {kind!r} is not a Drafter: it lacks {missing} "
                                 "(engine.drafters.DrafterDefaults has the usual ones)")
            return kind
        if kind == "ngram":
            return NgramDrafter()
        if kind == "suffix":
            return SuffixDrafter()
        if kind in ("twin", "hybrid-twin"):
            if self.model.precision != "exact":
                raise ValueError(f"drafter={kind!r} drafts with the int8 twin of an exact target; "
                                 f"this engine's precision is {self.model.precision!r}")
            twin = TwinDrafter(self.model.int8_twin(), self.pool)
            return twin if kind == "twin" else HybridDrafter(twin)
        if kind in ("eagle", "hybrid"):
            eagle = self._eagle_drafter()
            return eagle if kind == "eagle" else HybridDrafter(eagle)
        if draft_model is None or isinstance(draft_model, int):
            model = self.model.truncated(draft_model or 4)
        elif isinstance(draft_model, Transformer):
            model = draft_model
        else:
            model = Transformer.from_pretrained(resolve(draft_model, dtype), dtype, self.device,
                                                self.max_seq_len)
        if model.vocab_size != self.model.vocab_size:
            raise ValueError(f"draft model vocabulary ({model.vocab_size}) differs from the "
                             f"target's ({self.model.vocab_size})")
        return ModelDrafter(model)

    def _eagle_drafter(self) -> EagleDrafter:
        """The learned head for this target (refused when trained for another one)."""
        name, drafting = model_name(self.model_name), self.config.drafting
        if drafting.draft_head is None and name is None:
            raise ValueError(f"drafter={drafting.drafter!r} for the local model "
                             f"{self.model_name}: pass draft_head (a head directory)")
        where = Path(drafting.draft_head) if drafting.draft_head is not None else head_dir(name)
        head = DraftHead.load(where)
        check_target(head.config, name, self.model.cfg, str(where))
        return EagleDrafter(head, self.model.embed)

    # ------------------------------------------------------------------------ public API

    async def stream(self, messages: Sequence[Message], params: SamplingParams | None = None,
                     *, forced_text: str | None = None) -> AsyncIterator[Delta]:
        """Stream the reply to ``messages``; the last delta has finish_reason, usage, metrics.

        Messages (a list of dicts, a known role, str content) and ``params`` are checked first:
        a `ValueError` names what is wrong. ``max_tokens`` is bounded by what the context can
        hold (``max_seq_len`` and the KV budget): a request that reaches that bound ends with
        ``finish_reason="length"``, alone or in any batch.

        ``forced_text``: teacher-force this reply instead of the model's (see `ForcedEngine`):
        the request runs as any other, but each verify step takes the script's tokens (the
        text's encoding, then the end-of-turn token) as the target's.
        """
        if self._closed:
            raise EngineError("engine is closed")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        messages = check_messages(messages)
        loop = asyncio.get_running_loop()
        # the template and the tokenizer run here, not on the engine's thread: a huge prompt
        # must not hold up the requests being served
        prompt = await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        inbox: asyncio.Queue = asyncio.Queue()

        def emit(item: object) -> bool:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
                return True
            except RuntimeError:  # the consumer's event loop is gone
                return False

        job = Job(messages, params, emit, prompt_ids=prompt, forced_text=forced_text)
        self._jobs.put(job)
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled.set()

    def remember(self, text: str) -> None:
        """Feed ``text`` (e.g. an earlier code cell) to the drafter's cross-request corpus."""
        if self.drafter is not None and text:
            self._jobs.put(_Remember(self.tokenizer.encode(text)))

    def reset(self, *, prefix_cache: bool = True, drafter: bool = True) -> None:
        """Forget what earlier requests left behind, so the next one starts as on a fresh engine.

        ``prefix_cache``: drop every cached KV block of earlier prompts and outputs (the next
        prompt is prefilled in full). ``drafter``: give the drafter a fresh cross-request state
        (the suffix drafter's corpus of earlier outputs and remembered text; the draft model's
        cached tokens) and drop adaptive k's acceptance estimates. Adaptive k keeps its measured
        step-cost curve: that describes the machine, not the text. Metrics keep counting.

        Applied on the worker thread between steps; blocks until it is. Raises `EngineError`
        while requests are in flight (submitted and not yet finished or cancelled), when the
        engine is closed, or when a custom drafter has no ``reset()``."""
        if self._closed:
            raise EngineError("engine is closed")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(_Reset(prefix_cache, drafter, done))
        while True:
            try:
                return done.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if not self._worker.is_alive():
                    raise EngineError("engine worker is not running") from None

    def metrics(self) -> DecodeMetrics:
        """Decoding metrics (drafts, acceptance, timings) aggregated over every generation so far."""
        with self._metrics_lock:
            snapshot = DecodeMetrics(lossy=self._metrics.lossy)
            snapshot.merge(self._metrics)
            return snapshot

    def batch_metrics(self) -> BatchMetrics:
        """Batching metrics so far: batch size over time, queue wait, prefix-cache hits."""
        with self._metrics_lock:
            return BatchMetrics(**{**self._batch.__dict__, "timeline": list(self._batch.timeline),
                                   "evictions": self.pool.evictions})

    def close(self) -> None:
        """Stop the worker (after the requests already submitted) and release it."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=30)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    # -------------------------------------------------------------------------- worker

    def _work(self) -> None:
        if self.config.target.threads:
            torch.set_num_threads(self.config.target.threads)
        scheduler = self.scheduler
        with torch.inference_mode():
            while True:
                if not scheduler.in_flight():
                    if self._stopping:
                        return
                    self._accept(self._jobs.get())
                while True:
                    try:
                        self._accept(self._jobs.get_nowait())
                    except queue.Empty:
                        break
                scheduler.drop_cancelled()
                if not scheduler.in_flight():
                    continue
                batch = list(scheduler.running)
                try:
                    for seq in scheduler.admit():
                        self._start_drafting(seq)
                    batch = list(scheduler.running)
                    if batch:
                        self._step()
                except Exception as exc:  # report to the streams in the step, keep serving
                    log.exception("native engine step failed")
                    for seq in batch:
                        if seq in scheduler.running:
                            self._fail(seq, exc)

    def _accept(self, item) -> None:
        """Take one item from the submission queue: a request, text to remember, or stop."""
        if item is None:
            self._stopping = True
        elif isinstance(item, _Remember):
            try:
                self.drafter.remember(item.token_ids)
            except Exception:  # a drafter's corpus is an optimisation, never fatal
                log.exception("drafter %s failed to remember text", self.drafter.name)
        elif isinstance(item, _Reset):
            try:
                item.done.set_result(self._reset(item))
            except Exception as exc:
                item.done.set_exception(_engine_error(exc))
        elif not item.cancelled.is_set():
            try:
                self.scheduler.add(self._new_sequence(item))
            except Exception as exc:
                item.emit(_engine_error(exc))

    def _new_sequence(self, job: Job) -> RequestState:
        prompt = (job.prompt_ids if job.prompt_ids is not None
                  else self.tokenizer.encode_chat(job.messages))
        if len(prompt) + 1 > self.max_seq_len:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len}")
        if self.pool.blocks_for(len(prompt) + 1) > self.pool.num_blocks:
            raise EngineError(
                f"prompt of {len(prompt)} tokens needs more KV cache than the whole budget holds "
                f"({self.pool.capacity_tokens} tokens in kv_cache_bytes="
                f"{self.config.kv_cache.kv_cache_bytes})")
        # what the context can hold bounds the output before any per-request state is built
        context = min(self.max_seq_len, self.pool.capacity_tokens)
        if job.params.max_tokens > context - len(prompt):
            job.params = dataclasses.replace(job.params, max_tokens=context - len(prompt))
        params = job.params
        uniforms = Uniforms(self._seed_for(params), params.max_tokens + self.max_k + 2, self.device)
        metrics = DecodeMetrics(lossy=self._lossy)
        seq = RequestState(job, prompt, next(self._arrivals), uniforms,
                           OutputText(self.tokenizer, params), metrics)
        if job.forced_text is not None:
            seq.forced = self._script(job.forced_text)
        return seq

    def _script(self, text: str) -> list[int]:
        """The tokens a forced request streams: ``text``'s encoding, then the end of turn."""
        tokens = self.tokenizer.encode(text)
        if self.tokenizer.decode(tokens) != text:
            raise EngineError("forced text does not decode back to itself (special-token markup "
                              f"such as {self.tokenizer.hf.eos_token!r} in it?): {text[:80]!r}")
        return tokens + [self.tokenizer.end_of_turn_id]

    def _reset(self, item: _Reset) -> None:
        """`reset` on the worker thread."""
        self.scheduler.drop_cancelled()
        if self.scheduler.in_flight():
            raise EngineError(f"reset refused: {self.scheduler.in_flight()} "
                              "request(s) in flight; finish or cancel them first")
        if item.drafter and self.drafter is not None:
            try:  # first: a drafter that cannot forget leaves everything as it was
                self.drafter.reset()
            except NotImplementedError:
                raise EngineError(f"drafter {self.drafter.name!r} has no reset(): its cross-request "
                                  "state cannot be cleared (pass drafter=False to keep it)") from None
        self.scheduler.forget(item.prefix_cache)
        if item.drafter and self._policy is not None:
            self._policy.forget()

    def _seed_for(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        if self._seed_rng is not None:
            return int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return int.from_bytes(os.urandom(7), "little")

    def _policy_for(self) -> AdaptiveK | None:
        if self.drafter is None or self.fixed_k is not None:
            return None
        if self._policy is None:
            costs = StepCosts.measure(self.model, max(self.max_k + 1, 32))
            self.drafter.draft_cost()  # measured now, not inside a step
            self._policy = AdaptiveK(costs, self.max_k, self.drafter.draft_cost,
                                     model_prior=self.drafter.acceptance_prior)
        return self._policy

    def _start_drafting(self, seq: RequestState) -> None:
        """Give a newly admitted request its drafter state (a preempted one keeps its own)."""
        if seq.state is None and self.drafter is not None:
            params = seq.params
            seq.state = self.drafter.begin(seq.tokens[:seq.prompt_len], DraftSampling(
                params.temperature, params.top_k, params.top_p, seq.uniforms.draft_generator))
            if seq.produced:
                seq.state.extend(seq.tokens[seq.prompt_len:])

    # ------------------------------------------------------------------------------ step

    def _step(self) -> None:
        """Make the step's plan (`Scheduler.select`, `choose_drafts`, `Scheduler.plan`) and
        execute it: model drafts, one forward, then each request's verification and stream."""
        policy = self._policy_for()  # measures step costs on first use, outside the timings
        t0 = time.perf_counter()
        selection = self.scheduler.select()
        choices = choose_drafts(selection.decoding, self.drafter, policy, self.max_k, self.max_seq_len)
        plan = self.scheduler.plan(selection, choices)
        if not plan.groups:
            return
        if self.drafter is not None:
            draft_models(self.drafter, plan.decode)
        t1 = time.perf_counter()
        inputs = plan.inputs(self.device)
        capture = self.drafter.features if self.drafter is not None else ()
        logits = self.model(inputs.tokens, inputs.rows, self.pool, inputs.logit_rows, capture)
        features = None
        if capture:
            logits, features = logits
        synchronize(self.device)
        t2 = time.perf_counter()
        forward_s = t2 - t1
        rows = plan.rows
        if policy is not None:
            policy.costs.observe(rows, forward_s)
        self.scheduler.account(selection, t2 - t0)
        self._record_step(t2, len(plan.groups), rows, plan.prefill_tokens)
        for group, seq_logits, seq_features in plan.outputs(logits, features):
            if seq_logits is None:  # a prefill chunk short of the last token
                self._prefilled(group, seq_features)
            else:
                self._advance(group, seq_logits, policy, t1 - t0, forward_s, seq_features)

    def _record_step(self, at: float, sequences: int, rows: int, prompt_rows: int) -> None:
        """Count one step of ``sequences`` requests and ``rows`` rows (``prompt_rows`` of them
        prefill), ending at ``at``."""
        with self._metrics_lock:
            b = self._batch
            b.steps += 1
            b.rows += rows
            b.sequences += sequences
            b.max_batch = max(b.max_batch, sequences)
            b.timeline.append((at - self._started, sequences, rows, prompt_rows))
            if len(b.timeline) > 4096:
                del b.timeline[:1024]

    def _prefilled(self, rows: PrefillRows, features: torch.Tensor | None) -> None:
        """A prompt chunk short of the last token ran: count it (``features``: its captured
        rows, for a drafter that reads them)."""
        seq = rows.seq
        if features is not None and seq.state is not None:
            seq.state.add_features(seq.computed, features)
        self._count_prefill(seq, rows.n)
        self.scheduler.written(seq, rows.n)

    def _count_prefill(self, seq: RequestState, n: int) -> None:
        seq.metrics.prefill_tokens += n
        with self._metrics_lock:
            self._batch.prefill_tokens += n

    def _advance(self, rows: DecodeRows | PrefillRows, logits: torch.Tensor,
                 policy: AdaptiveK | None, draft_s: float, forward_s: float,
                 features: torch.Tensor | None = None) -> None:
        """Verify a request's rows of this step (its decode rows, or the prompt chunk that
        reached its last token), append what was accepted and stream it (``features``: the
        rows' captured target features, for a drafter that reads them)."""
        seq, decode = rows.seq, isinstance(rows, DecodeRows)
        drafted, draft = (rows.drafted, rows.draft) if decode else ([], Draft([]))
        t = time.perf_counter()
        if seq.forced is not None:  # teacher forcing: the script is the target
            accepted, token = forced_verify(drafted, seq.forced, seq.produced)
        else:
            accepted, token = verify(drafted, draft, logits, seq.params, seq.uniforms,
                                     seq.produced, self.config.drafting.acceptance_threshold)
        new_tokens = drafted[:accepted] + [token]
        written = 1 + accepted if decode else rows.n
        if features is not None and seq.state is not None:  # rejected draft rows are dropped
            seq.state.add_features(seq.computed, features[:written])
        m = seq.metrics
        if not decode or not seq.produced:
            # a decode row at the prompt's last token (a chunk or the prefix cache stopped one
            # short) is that token's prefill, as when the chunk reaches it: no verify step
            self._count_prefill(seq, rows.n if not decode else 1)
        else:
            m.record_step(len(drafted), accepted)
            m.draft_s += draft_s
            m.verify_s += forward_s
            if policy is not None and drafted:
                policy.observe(len(drafted), accepted, AdaptiveK.bucket_of(draft.match_len))
        seq.tokens.extend(new_tokens)
        if seq.state is not None:
            seq.state.extend(new_tokens)
        self.scheduler.written(seq, written)
        m.sample_s += time.perf_counter() - t
        if m.prefill_s == 0.0:
            m.prefill_s = time.perf_counter() - seq.admitted_at
        text, ids, finish = seq.out.add(new_tokens)
        if finish is None and seq.computed >= self.max_seq_len:
            finish = "length"
            text += seq.out.finish()
        if finish is not None:
            self._finish(seq, finish, text, ids)
        elif not seq.job.emit(Delta(text, tuple(ids))) or seq.job.cancelled.is_set():
            self.scheduler.release(seq)

    def _finish(self, seq: RequestState, finish: str, text: str, ids: list[int]) -> None:
        m = seq.metrics
        m.generated_tokens = len(seq.out.token_ids) + seq.out.hit_eos
        m.wall_s = time.perf_counter() - seq.admitted_at
        with self._metrics_lock:
            self._metrics.merge(m)
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=m.generated_tokens)
        self.scheduler.release(seq)
        seq.job.emit(Delta(text, tuple(ids), finish_reason=finish, usage=usage, metrics=m))

    def _fail(self, seq: RequestState, exc: BaseException) -> None:
        self.scheduler.release(seq)
        seq.job.emit(_engine_error(exc))


def _engine_error(exc: BaseException) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    wrapped = EngineError(f"native generation failed: {type(exc).__name__}: {exc}")
    wrapped.__cause__ = exc
    return wrapped
