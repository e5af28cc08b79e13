"""The native engine: continuous batching over `llama.Transformer` with speculative decoding.

One worker thread owns the model, the paged KV cache (`kv_cache.KVPool`) and the drafter, and
runs every live request in one forward per step (`Transformer.forward_batch`): each decoding
request feeds its last token plus its draft, each request still reading its prompt feeds a chunk
of it, all stacked as rows of one batch with their own positions and block tables. New requests
join at the next step; finished or cancelled ones leave at once. Requests wait while their blocks
do not fit the budget (less urgent running ones are preempted for more urgent ones); prompts
reuse cached blocks of earlier requests with the same prefix. Each stream is fed from that thread
through an asyncio queue.

Verification, per request, of ``[last token, *draft]``:

* temperature 0: `greedy_verify` (accept while the draft equals the target argmax);
* temperature > 0, deterministic drafts (n-gram, suffix): the target samples every position from
  pre-drawn uniforms indexed by *output position*, and the draft is accepted while it matches
  those samples. That accepts token x with probability p(x), exactly like rejection sampling
  against a one-hot draft, and makes a seeded run produce the same text with or without
  speculation, whatever k was;
* temperature > 0 with draft probabilities (draft model) or ``acceptance_threshold < 1``:
  `stochastic_verify` (rejection sampling; the threshold rule is lossy and reported so).

With the CPU kernels every row's logits depend only on its own request's tokens, so a request's
output is the same alone or in any batch, with or without speculation, cached prefixes or
preemption.
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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from agentrt.kernels import greedy_verify, probs_from_logits, sample, stochastic_verify

from .base import BaseEngine, Delta, EngineError, Message, SamplingParams, Usage, check_messages
from .kv_cache import DEFAULT_BLOCK_SIZE, KVPool
from .llama import SeqRows, Transformer
from .metrics import BatchMetrics, SpecMetrics
from .models import resolve
from .proposers.base import Draft, DraftSampling, Proposer
from .proposers.draft import DraftModelProposer
from .proposers.ngram import NgramProposer
from .proposers.suffix import SuffixProposer
from .sequence import Job, OutputText, RequestState, Uniforms, forced_verify
from .tokenizer import ChatTokenizer

SPECULATION_KINDS = ("suffix", "ngram", "draft")
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ adaptive k

class StepCosts:
    """Seconds of one target forward over n rows: the curve measured at start-up (one
    sequence), times a load factor refreshed from the forwards the engine actually runs (so
    load, context length and batch show), interpolated between the sizes measured.

    Observations scale the whole curve rather than the size they were seen at: a batched
    step's time includes every sequence's attention, and folding it into one point only
    (while its neighbours keep the start-up values) would make a few more rows look free, or
    cheaper than none. Its shape, what extra rows cost relative to the rows already in a
    step, stays the measured one."""

    def __init__(self, seconds_by_n: dict[int, float], smoothing: float = 0.1):
        if 1 not in seconds_by_n:
            raise ValueError("step costs need a measurement for n=1")
        self.points = sorted(seconds_by_n.items())
        self.smoothing = smoothing
        self.factor = 1.0

    def measured(self, n: int) -> float:
        """The start-up curve at n rows (linear beyond the largest size measured)."""
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, s0), (n1, s1) in itertools.pairwise(pts):
            if n <= n1:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        if len(pts) == 1:
            return pts[0][1] * n
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) / (n1 - n0) * (n - n1)

    def __call__(self, n: int) -> float:
        return self.factor * self.measured(n)

    def observe(self, n: int, seconds: float) -> None:
        """Fold in one forward's time (a ratio above 3x the current factor counts as 3x)."""
        ratio = min(seconds / self.measured(n), 3 * self.factor)
        self.factor = (1 - self.smoothing) * self.factor + self.smoothing * ratio

    @classmethod
    def measure(cls, model: Transformer, max_n: int, context: int = 128, repeats: int = 5) -> "StepCosts":
        """Time forwards over n = 1, 2, 3, 4, 6, 8, 12, 16, ... tokens (best of ``repeats``;
        a size that measured slower than a larger one is capped at the larger one's time)."""
        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n <= max_n} | {max_n})
        context = max(0, min(context, model.max_seq_len - max_n - 1))
        device = model.device
        warm = torch.zeros(1, context + 1, dtype=torch.long, device=device)
        model(warm, 0, "last")
        costs = {}
        for n in sizes:
            tokens = torch.zeros(1, n, dtype=torch.long, device=device)
            best = float("inf")
            for _ in range(repeats):
                _sync(device)
                t = time.perf_counter()
                model(tokens, context, "all")
                _sync(device)
                best = min(best, time.perf_counter() - t)
            costs[n] = best
        for n, m in zip(reversed(sizes[:-1]), reversed(sizes[1:])):
            costs[n] = min(costs[n], costs[m])
        return cls(costs)


class AdaptiveK:
    """Chooses the draft length k that maximises expected tokens per second.

    Keeps decayed counts of how often draft position i was accepted given positions < i were
    (positions never reached yet inherit the deepest estimate: acceptance tends to grow along a
    copied span), separately per *bucket*: lookup drafters report how many tokens of context
    their proposal matched, and a 1-token match is accepted far less often than an 8-token one
    (`bucket_of`). Expected tokens of a step with k drafts: ``1 + sum_j prod_{i<=j} a_i``; its
    cost: the measured target forward over k+1 tokens plus k draft steps. When no k beats
    plain decoding speculation is off for that bucket, with a probe every ``probe_every``
    steps so the estimate can recover.
    """

    BUCKETS = 5

    @staticmethod
    def bucket_of(match_len: int) -> int:
        """0: not a lookup (model drafts); 1, 2, 3: matched that many tokens; 4: four or more."""
        return max(0, min(match_len, AdaptiveK.BUCKETS - 1))

    def __init__(self, costs: StepCosts, max_k: int, draft_cost_per_token: float = 0.0,
                 prior: float = 0.6, decay: float = 0.9, probe_every: int = 24, probe_k: int = 4):
        self.costs = costs
        self.max_k = max_k
        self.draft_cost = draft_cost_per_token
        self.prior = prior
        self.decay = decay
        self.probe_every = probe_every
        self.probe_k = min(probe_k, max_k)
        self.forget()

    def accept(self, bucket: int = 0) -> list[float]:
        """Estimated acceptance of each draft position, given the earlier ones were accepted."""
        rates, last = [], self.prior
        for hits, seen in zip(self.hits[bucket], self.seen[bucket]):
            if seen >= 1.0:
                last = (hits + self.prior) / (seen + 1.0)
            rates.append(last)
        return rates

    def expected_tokens(self, k: int, accept: list[float] | None = None) -> float:
        accept = self.accept() if accept is None else accept
        total, chain = 1.0, 1.0
        for i in range(k):
            chain *= accept[i]
            total += chain
        return total

    def rate(self, k: int, accept: list[float] | None = None) -> float:
        """Expected tokens per second with k drafts."""
        return self.expected_tokens(k, accept) / (self.costs(k + 1) + self.draft_cost * k)

    def choose(self, limit: int, bucket: int = 0) -> int:
        """The best k in ``0..min(limit, max_k)`` for a draft of this bucket."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        accept = self.accept(bucket)
        best = max(range(limit + 1), key=lambda k: self.rate(k, accept))
        if best > 0:
            self._off_steps[bucket] = 0
            return best
        self._off_steps[bucket] += 1
        if self._off_steps[bucket] >= self.probe_every:
            self._off_steps[bucket] = 0
            return min(self.probe_k, limit)
        return 0

    def next_step(self) -> None:
        """Start a batched step: `probe` counts each bucket's steps without drafts once per
        step, however many sequences of the batch fall in it."""
        self._step += 1

    def probe(self, k: int, available: int, bucket: int = 0) -> int:
        """``k`` as planned elsewhere (`plan_draft_lengths`), except that a bucket which drafted
        nothing for ``probe_every`` steps in a row drafts ``probe_k`` once (for one sequence),
        so its estimate can recover."""
        if k > 0:
            self._off_steps[bucket] = 0
            return k
        if available == 0 or self._counted[bucket] == self._step:
            return 0
        self._counted[bucket] = self._step
        self._off_steps[bucket] += 1
        if self._off_steps[bucket] >= self.probe_every:
            self._off_steps[bucket] = 0
            return min(self.probe_k, available)
        return 0

    def forget(self) -> None:
        """Drop the acceptance estimates learned so far (back to the prior). The step costs
        stay: they describe the machine, not the text that was generated."""
        self.hits = [[0.0] * self.max_k for _ in range(self.BUCKETS)]
        self.seen = [[0.0] * self.max_k for _ in range(self.BUCKETS)]
        self._off_steps = [0] * self.BUCKETS
        self._step = 0
        self._counted = [-1] * self.BUCKETS  # the step a bucket's off count last grew in

    def observe(self, drafted: int, accepted: int, bucket: int = 0) -> None:
        """Fold in one verify step's outcome."""
        hits, seen = self.hits[bucket], self.seen[bucket]
        for i in range(min(drafted, accepted + 1)):
            hits[i] = self.decay * hits[i] + (1.0 if i < accepted else 0.0)
            seen[i] = self.decay * seen[i] + 1.0


# --------------------------------------------------------------------------------- helpers

@dataclass
class _Remember:
    token_ids: list[int]


@dataclass
class _Reset:
    prefix_cache: bool
    drafter: bool
    done: concurrent.futures.Future


_Uniforms = Uniforms  # the name tests and tools used before sequences had their own module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i



def plan_draft_lengths(chains: list[list[float]], base_tokens: int, base_rows: int,
                       cost: Callable[[int], float]) -> list[int]:
    """Draft lengths for the sequences of one batched step, chosen together.

    ``chains[i][j]``: the estimated probability that sequence i's draft tokens 0..j are all
    accepted (non-increasing in j). The step already runs ``base_rows`` rows and yields
    ``base_tokens`` tokens; each extra draft row adds its chain probability in expected tokens
    and costs what the step's time grows by. The best set of rows for expected tokens per
    second is a prefix of all candidate rows sorted by that probability (each sequence's rows
    in order), so this tries every prefix: at a small batch drafting is nearly free and long
    drafts pay; at a large one each row costs almost a full row of compute and only the likely
    ones are kept."""
    candidates = sorted(((p, i) for i, chain in enumerate(chains) for p in chain), reverse=True)
    best_m, best_rate, tokens = 0, base_tokens / cost(base_rows), float(base_tokens)
    for m, (p, _) in enumerate(candidates, start=1):
        tokens += p
        rate = tokens / cost(base_rows + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    lengths = [0] * len(chains)
    for _, i in candidates[:best_m]:
        lengths[i] += 1
    return lengths


# ---------------------------------------------------------------------------------- engine

class NativeEngine(BaseEngine):
    """The embedded engine: SmolLM2-135M-Instruct (or any local Llama/Qwen directory) in torch,
    serving every live request in one batched forward per step.

    Args:
        model: a pulled model name (see `models.pull`) or a local Hugging Face directory.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        device: ``"cpu"`` or a CUDA device.
        speculation: ``"suffix"``, ``"ngram"``, ``"draft"``, ``None`` (plain decoding), or a
            `Proposer` instance.
        draft_model: for ``"draft"``: a model name/path, a `Transformer`, or an int n (a layer-skip
            drafter from the target's first n layers; the default is 4).
        num_speculative_tokens: ``"auto"`` (adaptive k, measured at the first request) or a
            fixed k.
        max_speculative_tokens: the largest k adaptive mode considers.
        acceptance_threshold: 1.0 is exact; below 1.0 accepts more drafts, and is reported as
            ``lossy`` in the metrics.
        max_seq_len: the longest sequence (prompt + output) one request may reach.
        seed: seeds requests whose params have no seed (a seeded engine is reproducible).
        compile: accepted for API stability; the eager path always runs (on CPU, torch.compile
            of the decode step measured no faster than eager + the fused CPU kernels, after an
            80 s compile; see docs/engine.md).
        threads: torch CPU threads (default: torch's setting).
        prefix_cache: reuse cached keys/values of prompt prefixes seen before (any request's).
        prefill_chunk: the most prompt tokens one request feeds in one step.
        kv_cache_bytes: the KV cache budget (default 512 MiB: ~23k tokens of SmolLM2-135M in float16);
            requests wait when it is full, and one that could never fit is refused.
        block_size: positions per KV block (the prefix cache shares whole blocks and copies
            the last partial one).
        max_batch_tokens: the most token rows one step runs (decode rows, drafts, prefill chunks).
        max_num_seqs: the most requests decoding at once; more wait.
        priority_share: while a more urgent request (lower ``priority``) is decoding, less urgent
            ones take part only in some steps, so that the urgent stream keeps at least this
            share of the decode rate it has alone (see docs/engine.md, "Priority").
        background_prefill_tokens: the most prompt tokens less urgent requests prefill in one
            of those shared steps (bounds the pause they cause in the urgent stream).
        precision: ``"exact"`` (default; the checkpoint's arithmetic, bit-identical on every
            path) or ``"int8"`` (GGUF-block weights times int8-quantised activations on the CPU
            kernels: 2.1-3.5x faster single-stream decode, logits close to but not equal to exact;
            greedy speculative == greedy plain holds in both). See docs/engine.md.
    """

    name = "native"

    def __init__(
        self,
        model: str | os.PathLike = "smollm2-135m",
        dtype: str = "bf16",
        device: str = "cpu",
        speculation: str | Proposer | None = "suffix",
        draft_model: str | os.PathLike | Transformer | int | None = None,
        num_speculative_tokens: str | int = "auto",
        acceptance_threshold: float = 1.0,
        max_seq_len: int = 4096,
        seed: int | None = None,
        compile: bool = False,
        threads: int | None = None,
        max_speculative_tokens: int = 16,
        prefix_cache: bool = True,
        prefill_chunk: int = 512,
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_batch_tokens: int = 512,
        max_num_seqs: int = 64,
        priority_share: float = 0.7,
        background_prefill_tokens: int = 64,
        precision: str = "exact",
    ):
        if not 0.0 < acceptance_threshold <= 1.0:
            raise ValueError(f"acceptance_threshold must be in (0, 1], got {acceptance_threshold}")
        if num_speculative_tokens != "auto" and (
                not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be 'auto' or an int >= 0, "
                             f"got {num_speculative_tokens!r}")
        if isinstance(speculation, str) and speculation not in SPECULATION_KINDS:
            raise ValueError(f"speculation must be one of {SPECULATION_KINDS} or None, got {speculation!r}")
        for name, value in (("prefill_chunk", prefill_chunk), ("block_size", block_size),
                            ("max_batch_tokens", max_batch_tokens), ("max_num_seqs", max_num_seqs),
                            ("background_prefill_tokens", background_prefill_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0.0 < priority_share <= 1.0:
            raise ValueError(f"priority_share must be in (0, 1], got {priority_share}")
        if threads:
            torch.set_num_threads(threads)
        self.threads = threads
        self.device = torch.device(device)
        self.path = resolve(model, dtype)
        self.model = Transformer.from_pretrained(self.path, dtype, self.device, max_seq_len,
                                                 precision=precision)
        self.tokenizer = ChatTokenizer(self.path)
        self.max_seq_len = max_seq_len
        self.acceptance_threshold = acceptance_threshold
        self.fixed_k = None if num_speculative_tokens == "auto" else num_speculative_tokens
        self.max_k = max(1, self.fixed_k or max_speculative_tokens)
        self.compile = compile
        if compile:
            log.warning("NativeEngine(compile=True): no compiled path yet, running eager")
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.max_batch_tokens = max(max_batch_tokens, self.max_k + 1)
        self.max_num_seqs = max_num_seqs
        self.background_prefill_tokens = background_prefill_tokens
        self.priority_share = priority_share
        self._credit = 0.0  # seconds less urgent requests may still slow the urgent stream by
        self._urgent_alone_s = 0.0  # recent duration of a step of urgent requests only
        cfg = self.model.cfg
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                           self.model.cache_dtype)
        self.kv_cache_bytes = kv_cache_bytes or 512 * 2**20
        num_blocks = self.kv_cache_bytes // (per_token * block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} holds no block of {block_size} "
                             f"tokens ({per_token * block_size} bytes)")
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                           self.model.cache_dtype, self.device)
        self.proposer = self._make_proposer(speculation, draft_model, dtype)
        self.speculation = (None if self.proposer is None else
                            speculation if isinstance(speculation, str) else self.proposer.name)
        self._policy: AdaptiveK | None = None
        self._seed_rng = (torch.Generator().manual_seed(seed) if seed is not None else None)
        self._metrics = SpecMetrics(lossy=acceptance_threshold < 1.0)
        self._batch = BatchMetrics()
        self._metrics_lock = threading.Lock()
        self._started = time.perf_counter()
        self._jobs: queue.Queue = queue.Queue()
        self._waiting: list[RequestState] = []
        self._running: list[RequestState] = []
        self._arrivals = itertools.count()
        self._stopping = False
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="agentrt-native", daemon=True)
        self._worker.start()

    def _make_proposer(self, speculation, draft_model, dtype) -> Proposer | None:
        if speculation is None or self.fixed_k == 0:
            return None
        if not isinstance(speculation, str):
            return speculation
        if speculation == "ngram":
            return NgramProposer()
        if speculation == "suffix":
            return SuffixProposer()
        if draft_model is None or isinstance(draft_model, int):
            drafter = self.model.truncated(draft_model or 4)
        elif isinstance(draft_model, Transformer):
            drafter = draft_model
        else:
            drafter = Transformer.from_pretrained(resolve(draft_model, dtype), dtype, self.device,
                                                  self.max_seq_len)
        if drafter.vocab_size != self.model.vocab_size:
            raise ValueError(f"draft model vocabulary ({drafter.vocab_size}) differs from the "
                             f"target's ({self.model.vocab_size})")
        return DraftModelProposer(drafter)

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
        if self.proposer is not None and text:
            self._jobs.put(_Remember(self.tokenizer.encode(text)))

    def reset(self, *, prefix_cache: bool = True, drafter: bool = True) -> None:
        """Forget what earlier requests left behind, so the next one starts as on a fresh engine.

        ``prefix_cache``: drop every cached KV block of earlier prompts and outputs (the next
        prompt is prefilled in full). ``drafter``: give the drafter a fresh cross-request state
        (the suffix proposer's corpus of earlier outputs and remembered text; the draft model's
        cached tokens) and drop adaptive k's acceptance estimates. Adaptive k keeps its measured
        step-cost curve: that describes the machine, not the text. Metrics keep counting.

        Applied on the worker thread between steps; blocks until it is. Raises `EngineError`
        while requests are in flight (submitted and not yet finished or cancelled), when the
        engine is closed, or when a custom proposer has no ``reset()``."""
        if self._closed:
            raise EngineError("engine is closed")
        if drafter and self.proposer is not None and not callable(getattr(self.proposer, "reset", None)):
            raise EngineError(f"proposer {self.proposer.name!r} has no reset(): its cross-request "
                              f"state cannot be cleared (pass drafter=False to keep it)")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(_Reset(prefix_cache, drafter, done))
        while True:
            try:
                return done.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if not self._worker.is_alive():
                    raise EngineError("engine worker is not running") from None

    def metrics(self) -> SpecMetrics:
        """Speculative-decoding metrics aggregated over every generation so far."""
        with self._metrics_lock:
            snapshot = SpecMetrics(lossy=self._metrics.lossy)
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
        if self.threads:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                if not self._running and not self._waiting:
                    if self._stopping:
                        return
                    self._accept(self._jobs.get())
                while True:
                    try:
                        self._accept(self._jobs.get_nowait())
                    except queue.Empty:
                        break
                self._drop_cancelled()
                if not self._running and not self._waiting:
                    continue
                batch = list(self._running)
                try:
                    self._admit()
                    batch = list(self._running)
                    if batch:
                        self._step()
                except Exception as exc:  # report to the streams in the step, keep serving
                    log.exception("native engine step failed")
                    for seq in batch:
                        if seq in self._running:
                            self._fail(seq, exc)

    def _accept(self, item) -> None:
        """Take one item from the submission queue: a request, text to remember, or stop."""
        if item is None:
            self._stopping = True
        elif isinstance(item, _Remember):
            try:
                self.proposer.remember(item.token_ids)
            except Exception:  # a drafter's corpus is an optimisation, never fatal
                log.exception("proposer %s failed to remember text", self.speculation)
        elif isinstance(item, _Reset):
            try:
                item.done.set_result(self._reset(item))
            except Exception as exc:
                item.done.set_exception(_engine_error(exc))
        elif not item.cancelled.is_set():
            try:
                self._waiting.append(self._new_sequence(item))
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
                f"({self.pool.capacity_tokens} tokens in kv_cache_bytes={self.kv_cache_bytes})")
        # what the context can hold bounds the output before any per-request state is built
        context = min(self.max_seq_len, self.pool.capacity_tokens)
        if job.params.max_tokens > context - len(prompt):
            job.params = dataclasses.replace(job.params, max_tokens=context - len(prompt))
        params = job.params
        uniforms = Uniforms(self._seed_for(params), params.max_tokens + self.max_k + 2, self.device)
        metrics = SpecMetrics(lossy=self.acceptance_threshold < 1.0)
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
        self._drop_cancelled()
        if self._running or self._waiting:
            raise EngineError(f"reset refused: {len(self._running) + len(self._waiting)} "
                              "request(s) in flight; finish or cancel them first")
        if item.prefix_cache:
            self.pool.forget()
        if item.drafter:
            if self.proposer is not None:
                self.proposer.reset()
            if self._policy is not None:
                self._policy.forget()
        self._credit, self._urgent_alone_s = 0.0, 0.0

    def _seed_for(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        if self._seed_rng is not None:
            return int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return int.from_bytes(os.urandom(7), "little")

    def _policy_for(self) -> AdaptiveK | None:
        if self.proposer is None or self.fixed_k is not None:
            return None
        if self._policy is None:
            costs = StepCosts.measure(self.model, max(self.max_k + 1, 32))
            self._policy = AdaptiveK(costs, self.max_k, self.proposer.draft_cost())
        return self._policy

    # ------------------------------------------------------------------------ scheduling

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.job.cancelled.is_set()]:
            self._waiting.remove(seq)
            if seq.state is not None:  # preempted after it started
                seq.state.end()
        for seq in [s for s in self._running if s.job.cancelled.is_set()]:
            self._release(seq)

    def _admit(self) -> None:
        """Move waiting requests to running, most urgent first, while their blocks fit. A
        request that does not fit waits (and so do less urgent ones), after preempting running
        requests less urgent than it; one whose prompt shares a block-sized prefix with a
        request still prefilling it waits until that prefix is in the cache."""
        for seq in sorted(self._waiting, key=lambda s: s.order):
            if len(self._running) >= self.max_num_seqs:
                return
            if self._prefix_in_flight(seq):
                continue
            while not self._try_admit(seq):
                victims = [s for s in self._running if s.order > seq.order]
                if not victims:
                    return
                self._preempt(max(victims, key=lambda s: s.order))
            self._waiting.remove(seq)
            self._running.append(seq)

    def _prefix_in_flight(self, seq: RequestState) -> bool:
        if not self.prefix_cache:
            return False
        bs = self.pool.block_size
        for other in self._running:
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
        now = time.perf_counter()
        seq.metrics.cached_tokens += seq.computed
        if seq.admitted_at is None:
            seq.admitted_at = now
            seq.metrics.queue_s = now - seq.job.submitted
            with self._metrics_lock:
                self._batch.requests += 1
                self._batch.queue_s += seq.metrics.queue_s
        if seq.state is None and self.proposer is not None:
            prompt = seq.tokens[:seq.prompt_len]
            params = seq.params
            seq.state = self.proposer.begin(prompt, DraftSampling(
                params.temperature, params.top_k, params.top_p, seq.uniforms.draft_generator))
            if seq.produced:
                seq.state.extend(seq.tokens[seq.prompt_len:])
        with self._metrics_lock:
            self._batch.cached_tokens += seq.computed
        return True

    def _preempt(self, seq: RequestState) -> None:
        """Give ``seq``'s blocks back (its indexed blocks stay cached) and make it wait again."""
        self._index_tail(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.indexed, seq.chain = [], 0, 0, KVPool.ROOT
        seq.metrics.preemptions += 1
        with self._metrics_lock:
            self._batch.preemptions += 1
        self._running.remove(seq)
        self._waiting.append(seq)

    def _index_tail(self, seq: RequestState) -> None:
        """Index the full blocks not indexed yet, then the partly filled last one."""
        self._index_full(seq)
        bs = self.pool.block_size
        j = seq.indexed
        if j < len(seq.blocks) and seq.computed > j * bs:
            self.pool.register_partial(seq.blocks[j], seq.chain, seq.tokens[j * bs:seq.computed])

    def _index_full(self, seq: RequestState) -> None:
        bs = self.pool.block_size
        while (seq.indexed + 1) * bs <= seq.computed:
            j = seq.indexed
            seq.chain = self.pool.register(seq.blocks[j], seq.chain, seq.tokens[j * bs:(j + 1) * bs])
            seq.indexed += 1

    def _release(self, seq: RequestState) -> None:
        """``seq`` leaves: its blocks go back to the pool (indexed ones stay cached)."""
        self._index_tail(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        if seq in self._running:
            self._running.remove(seq)
        if seq.state is not None:
            try:
                seq.state.end()
            except Exception:  # a drafter's bookkeeping must not fail the request
                log.exception("proposer state failed to end")

    def _fail(self, seq: RequestState, exc: BaseException) -> None:
        self._release(seq)
        seq.job.emit(_engine_error(exc))

    # ------------------------------------------------------------------------------ step

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
            victims = [s for s in self._running if s.order > seq.order]
            if victims:
                self._preempt(max(victims, key=lambda s: s.order))
                continue
            return 0
        return rows

    def _draft(self, decoding: list[RequestState], policy: AdaptiveK | None
               ) -> dict[RequestState, tuple[list[int], Draft]]:
        """Each decoding sequence's draft for this step (see `plan_draft_lengths`)."""
        if policy is not None:
            policy.next_step()
        plans: dict[RequestState, tuple[list[int], Draft]] = {}
        lookups: list[tuple[RequestState, Draft]] = []
        for seq in decoding:
            room = min(seq.params.max_tokens - seq.produced - 1, self.max_seq_len - seq.computed - 1)
            draft = Draft([])
            if seq.state is None or room <= 0:
                plans[seq] = ([], draft)
            elif policy is None:
                draft = seq.state.propose(min(self.fixed_k, room))
                plans[seq] = (draft.tokens[:min(self.fixed_k, room)], draft)
            elif not self.proposer.lookup:
                k = policy.choose(room)  # model drafts cost a forward per token: choose k first
                draft = seq.state.propose(k) if k > 0 else draft
                plans[seq] = (draft.tokens[:k], draft)
            else:  # lookups are cheap: see every match, then choose the k's together
                lookups.append((seq, seq.state.propose(min(room, self.max_k))))
        # the most urgent requests plan their drafts as if alone (less urgent rows must not
        # make the urgent stream draft less), the others around what those use
        urgent = min((seq.priority for seq in decoding), default=0)
        groups = [[x for x in lookups if x[0].priority == urgent],
                  [x for x in lookups if x[0].priority != urgent]]
        first_rows = sum(1 for seq in decoding if seq.priority == urgent)
        rows = first_rows
        for group, tokens in zip(groups, (first_rows, len(decoding) - first_rows)):
            if not group:
                continue
            chains = []
            for _, draft in group:
                accept, chain, p = policy.accept(AdaptiveK.bucket_of(draft.match_len)), [], 1.0
                for a in accept[:len(draft.tokens)]:
                    p *= a
                    chain.append(p)
                chains.append(chain)
            base = rows if group is groups[0] else rows + tokens
            lengths = plan_draft_lengths(chains, max(tokens, 1), base, policy.costs)
            for (seq, draft), k in zip(group, lengths):
                k = policy.probe(k, len(draft.tokens), AdaptiveK.bucket_of(draft.match_len))
                plans[seq] = (draft.tokens[:k], draft)
                rows += k
        return plans

    def _step(self) -> None:
        """One forward for every running sequence: decode rows (last token + draft) first, then
        prefill chunks in priority order within the step's token budget."""
        policy = self._policy_for()  # measures step costs on first use, outside the timings
        t0 = time.perf_counter()
        order = sorted(self._running, key=lambda s: s.order)
        urgent = min((s.priority for s in order if s.decoding), default=None)
        throttled = urgent is not None and any(s.priority > urgent for s in order)
        shared = throttled and self._credit >= 0
        if throttled and not shared:
            order = [s for s in order if s.priority <= urgent]
        decoding = [s for s in order if s.decoding]
        plans = self._draft(decoding, policy)
        t1 = time.perf_counter()
        entries: list[tuple[RequestState, int, list[int], Draft | None, bool]] = []
        used = 0
        for seq in decoding:
            if seq not in self._running:
                continue
            drafted, draft = plans[seq]
            rows = self._grow(seq, 1 + len(drafted))
            if rows == 0:
                if seq in self._running:  # more urgent requests hold every block: wait
                    self._preempt(seq)
                continue
            entries.append((seq, rows, drafted[:rows - 1], draft, True))
            used += rows
        background = 0
        for seq in order:
            if seq.decoding or seq not in self._running:
                continue
            chunk = min(len(seq.tokens) - seq.computed, self.prefill_chunk,
                        self.max_batch_tokens - used)
            if throttled and seq.priority > urgent:
                chunk = min(chunk, self.background_prefill_tokens - background)
                background += max(chunk, 0)
            if chunk <= 0:
                continue
            entries.append((seq, chunk, [], None, False))
            used += chunk
        if not entries:
            return
        tokens, rows, logit_rows, row = [], [], [], 0
        for seq, n, drafted, _, decode in entries:
            tokens.extend([seq.tokens[-1], *drafted] if decode
                          else seq.tokens[seq.computed:seq.computed + n])
            rows.append(SeqRows(seq.computed, n, seq.block_table()))
            if seq.computed + n >= len(seq.tokens):  # reaches the last known token: sample
                first = row + (len(seq.tokens) - 1 - seq.computed)
                logit_rows.extend(range(first, row + n))
            row += n
        token_tensor = torch.tensor(tokens, dtype=torch.long, device=self.device)
        logits = self.model.forward_batch(token_tensor, rows, self.pool,
                                          torch.tensor(logit_rows, dtype=torch.long))
        _sync(self.device)
        t2 = time.perf_counter()
        forward_s = t2 - t1
        if policy is not None:
            policy.costs.observe(row, forward_s)
        self._account_priority(throttled, shared, t2 - t0)
        with self._metrics_lock:
            b = self._batch
            b.steps += 1
            b.rows += row
            b.sequences += len(entries)
            b.max_batch = max(b.max_batch, len(entries))
            b.timeline.append((t2 - self._started, len(entries), row))
            if len(b.timeline) > 4096:
                del b.timeline[:1024]
        at = 0
        for seq, n, drafted, draft, decode in entries:
            if seq.computed + n < len(seq.tokens):  # a prefill chunk short of the last token
                seq.metrics.prefill_tokens += n
                with self._metrics_lock:
                    self._batch.prefill_tokens += n
                seq.computed += n
                self._index_full(seq)
                continue
            sampled = len(drafted) + 1
            seq_logits = logits[at:at + sampled][None]
            at += sampled
            self._advance(seq, n, drafted, draft, decode, seq_logits, policy, t1 - t0, forward_s)

    def _account_priority(self, throttled: bool, shared: bool, seconds: float) -> None:
        """Keep the credit of less urgent requests: a step of urgent requests only earns what
        the urgent stream may lose (``seconds / share - seconds``); a shared step spends what it
        took beyond an urgent-only step. Shared steps run while the credit is not negative, so
        over the urgent stream's life its steps take at most ``1 / share`` of their time alone."""
        if not throttled:
            self._credit = 0.0
        elif shared:
            self._credit += self._urgent_alone_s / self.priority_share - seconds
        else:
            self._urgent_alone_s = (seconds if self._urgent_alone_s == 0.0
                                    else 0.8 * self._urgent_alone_s + 0.2 * seconds)
            self._credit += seconds / self.priority_share - seconds

    def _advance(self, seq: RequestState, n: int, drafted: list[int], draft: Draft | None,
                 decode: bool, logits: torch.Tensor, policy: AdaptiveK | None, draft_s: float,
                 forward_s: float) -> None:
        """Verify ``seq``'s rows of this step, append what was accepted and stream it."""
        t = time.perf_counter()
        if seq.forced is not None:  # teacher forcing: the script is the target
            accepted, token = forced_verify(drafted, seq.forced, seq.produced)
        else:
            accepted, token = self._verify(drafted, draft or Draft([]), logits, seq.params,
                                           seq.uniforms, seq.produced)
        new_tokens = drafted[:accepted] + [token]
        m = seq.metrics
        if not decode:
            m.prefill_tokens += n
            with self._metrics_lock:
                self._batch.prefill_tokens += n
            seq.computed += n
        else:
            seq.computed += 1 + accepted
            m.record_step(len(drafted), accepted)
            m.draft_s += draft_s
            m.verify_s += forward_s
            if policy is not None and drafted and draft is not None:
                policy.observe(len(drafted), accepted, AdaptiveK.bucket_of(draft.match_len))
        seq.tokens.extend(new_tokens)
        if seq.state is not None:
            seq.state.extend(new_tokens)
        self._index_full(seq)
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
            self._release(seq)

    def _finish(self, seq: RequestState, finish: str, text: str, ids: list[int]) -> None:
        m = seq.metrics
        m.generated_tokens = len(seq.out.token_ids) + seq.out.hit_eos
        m.wall_s = time.perf_counter() - seq.admitted_at
        with self._metrics_lock:
            self._metrics.merge(m)
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=m.generated_tokens)
        self._release(seq)
        seq.job.emit(Delta(text, tuple(ids), finish_reason=finish, usage=usage, metrics=m))

    def _verify(self, drafted: list[int], draft: Draft, logits: torch.Tensor,
                params: SamplingParams, uniforms: Uniforms, at: int) -> tuple[int, int]:
        """``(accepted, next_token)`` for ``drafted`` against target ``logits[1, k+1, V]``."""
        k = len(drafted)
        draft_ids = torch.tensor([drafted], dtype=torch.long, device=self.device)
        if params.temperature == 0:
            accepted, token = greedy_verify(draft_ids, logits)
            return int(accepted[0]), int(token[0])
        probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
        exact_match = draft.probs is None and self.acceptance_threshold == 1.0
        if exact_match or k == 0:
            samples = sample(probs[0], uniforms.residual[at:at + k + 1]).tolist()
            accepted = 0
            while accepted < k and samples[accepted] == drafted[accepted]:
                accepted += 1
            return accepted, samples[accepted]
        draft_probs = None if draft.probs is None else draft.probs[None, :k].to(probs.device)
        accepted, token = stochastic_verify(
            draft_ids, draft_probs, probs, uniforms.accept[None, at:at + k],
            uniforms.residual[at:at + 1], self.acceptance_threshold)
        return int(accepted[0]), int(token[0])


def _engine_error(exc: BaseException) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    wrapped = EngineError(f"native generation failed: {type(exc).__name__}: {exc}")
    wrapped.__cause__ = exc
    return wrapped
