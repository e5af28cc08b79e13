"""The native engine: a torch decode loop over `llama.Transformer` with speculative decoding.

One model, one request at a time: requests queue up for a single worker thread that owns the
model, its KV cache and the drafter, so concurrent streams never touch each other's state. Each
stream is fed from that thread through an asyncio queue; a consumer that stops iterating (or is
cancelled) flags its request, and the worker drops it at the next step.

A decode step drafts up to k tokens (n-gram / suffix / draft model), runs the target once over
``[last token, *draft]`` and keeps the accepted prefix plus one target token:

* temperature 0: `greedy_verify` (accept while the draft equals the target argmax);
* temperature > 0, deterministic drafts (n-gram, suffix): the target samples every position from
  pre-drawn uniforms indexed by *output position*, and the draft is accepted while it matches
  those samples. That accepts token x with probability p(x), exactly like rejection sampling
  against a one-hot draft, and makes a seeded run produce the same text with or without
  speculation, whatever k was;
* temperature > 0 with draft probabilities (draft model) or ``acceptance_threshold < 1``:
  `stochastic_verify` (rejection sampling; the threshold rule is lossy and reported so).

The KV cache is rolled back by position only. Its contents are remembered as a token list, so a
request whose prompt extends the previous conversation prefills only the new tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import torch

from agentrt.kernels import greedy_verify, probs_from_logits, sample, stochastic_verify

from .base import BaseEngine, Delta, EngineError, Message, SamplingParams, Usage
from .llama import Transformer
from .metrics import SpecMetrics
from .models import resolve
from .proposers.base import Draft, Proposer
from .proposers.draft import DraftModelProposer
from .proposers.ngram import NgramProposer
from .proposers.suffix import SuffixProposer
from .tokenizer import ChatTokenizer, StopStringMatcher

SPECULATION_KINDS = ("suffix", "ngram", "draft")
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ adaptive k

class StepCosts:
    """Seconds of one target forward over n tokens: measured at start-up, refreshed from the
    forwards the engine actually runs (so load and context length show), interpolated between
    the sizes seen."""

    def __init__(self, seconds_by_n: dict[int, float], smoothing: float = 0.1):
        if 1 not in seconds_by_n:
            raise ValueError("step costs need a measurement for n=1")
        self.seconds = dict(seconds_by_n)
        self.smoothing = smoothing
        self.points = sorted(self.seconds.items())

    def __call__(self, n: int) -> float:
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

    def observe(self, n: int, seconds: float) -> None:
        """Fold in one forward's time (outliers above 3x the estimate count as 3x)."""
        old = self.seconds.get(n)
        if old is None:
            self.seconds[n] = min(seconds, 3 * self(n))
        else:
            self.seconds[n] = (1 - self.smoothing) * old + self.smoothing * min(seconds, 3 * old)
        self.points = sorted(self.seconds.items())

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
        self.hits = [[0.0] * max_k for _ in range(self.BUCKETS)]
        self.seen = [[0.0] * max_k for _ in range(self.BUCKETS)]
        self.probe_every = probe_every
        self.probe_k = min(probe_k, max_k)
        self._off_steps = [0] * self.BUCKETS

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

    def observe(self, drafted: int, accepted: int, bucket: int = 0) -> None:
        """Fold in one verify step's outcome."""
        hits, seen = self.hits[bucket], self.seen[bucket]
        for i in range(min(drafted, accepted + 1)):
            hits[i] = self.decay * hits[i] + (1.0 if i < accepted else 0.0)
            seen[i] = self.decay * seen[i] + 1.0


# --------------------------------------------------------------------------------- helpers

@dataclass
class _Job:
    messages: list[Message]
    params: SamplingParams
    emit: Callable[[object], bool]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Remember:
    token_ids: list[int]


class _OutputText:
    """Turns accepted tokens into text deltas; applies EOS, stop strings and max_tokens."""

    def __init__(self, tokenizer: ChatTokenizer, params: SamplingParams):
        self.detok = tokenizer.detokenizer()
        self.stop = StopStringMatcher(params.stop)
        self.eos = tokenizer.eos_token_ids
        self.max_tokens = params.max_tokens
        self.token_ids: list[int] = []
        self.hit_eos = False

    def add(self, tokens: Sequence[int]) -> tuple[str, list[int], str | None]:
        """``(text, token_ids, finish_reason)`` for the next accepted tokens."""
        parts: list[str] = []
        ids: list[int] = []
        for token in tokens:
            if token in self.eos:
                self.hit_eos = True
                return "".join(parts) + self._tail(), ids, "stop"
            ids.append(token)
            self.token_ids.append(token)
            text, stopped = self.stop.push(self.detok.push([token]))
            parts.append(text)
            if stopped:
                return "".join(parts), ids, "stop"
            if len(self.token_ids) >= self.max_tokens:
                return "".join(parts) + self._tail(), ids, "length"
        return "".join(parts), ids, None

    def finish(self) -> str:
        """Text still held back when generation ends for another reason (max_seq_len)."""
        return self._tail()

    def _tail(self) -> str:
        text, stopped = self.stop.push(self.detok.flush())
        return text if stopped else text + self.stop.flush()


class _Uniforms:
    """Pre-drawn uniforms indexed by output position (so seeded runs do not depend on k).

    Each stream is drawn in fixed blocks from its own generator, so ``residual[i]`` depends only
    on the seed and i, never on how many were drawn.
    """

    BLOCK = 64

    def __init__(self, seed: int, size: int, device: torch.device):
        self.residual = self._draw(seed, size).to(device)
        self.accept = self._draw(seed ^ 0x9E3779B97F4A7C15, size).to(device)
        self.draft_generator = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)

    @classmethod
    def _draw(cls, seed: int, size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        blocks = -(-size // cls.BLOCK)
        return torch.cat([torch.rand(cls.BLOCK, generator=gen) for _ in range(blocks)])


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


# ---------------------------------------------------------------------------------- engine

class NativeEngine(BaseEngine):
    """The embedded engine: SmolLM2-135M-Instruct (or any local Llama/Qwen directory) in torch.

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
        max_seq_len: KV cache length (prompt + output).
        seed: seeds requests whose params have no seed (a seeded engine is reproducible).
        compile: accepted for API stability; the eager path always runs (on CPU, torch.compile
            of the decode step measured no faster than eager + the fused CPU kernels, after an
            80 s compile; see docs/engine.md).
        threads: torch CPU threads (default: torch's setting).
        prefix_cache: reuse the KV cache for the prompt prefix shared with the previous request.
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
        self.proposer = self._make_proposer(speculation, draft_model, dtype)
        self.speculation = (None if self.proposer is None else
                            speculation if isinstance(speculation, str) else self.proposer.name)
        self._policy: AdaptiveK | None = None
        self._seed_rng = (torch.Generator().manual_seed(seed) if seed is not None else None)
        self._cache_tokens: list[int] = []
        self._metrics = SpecMetrics(lossy=acceptance_threshold < 1.0)
        self._metrics_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
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

    async def stream(self, messages: Sequence[Message],
                     params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """Stream the reply to ``messages``; the last delta has finish_reason, usage, metrics."""
        if self._closed:
            raise EngineError("engine is closed")
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def emit(item: object) -> bool:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
                return True
            except RuntimeError:  # the consumer's event loop is gone
                return False

        job = _Job([dict(m) for m in messages], params, emit)
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

    def metrics(self) -> SpecMetrics:
        """Speculative-decoding metrics aggregated over every generation so far."""
        with self._metrics_lock:
            snapshot = SpecMetrics(lossy=self._metrics.lossy)
            snapshot.merge(self._metrics)
            return snapshot

    def close(self) -> None:
        """Stop the worker (after the request in progress) and release it."""
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
            while (job := self._jobs.get()) is not None:
                if isinstance(job, _Remember):
                    try:
                        self.proposer.remember(job.token_ids)
                    except Exception:  # a drafter's corpus is an optimisation, never fatal
                        log.exception("proposer %s failed to remember text", self.speculation)
                    continue
                if job.cancelled.is_set():
                    continue
                try:
                    self._generate(job)
                except Exception as exc:  # report to the stream, keep serving
                    self._cache_tokens = []
                    if not isinstance(exc, EngineError):
                        wrapped = EngineError(f"native generation failed: {type(exc).__name__}: {exc}")
                        wrapped.__cause__ = exc
                        exc = wrapped
                    job.emit(exc)

    def _prefill(self, prompt: list[int]) -> torch.Tensor:
        """Fill the KV cache for ``prompt`` (reusing a shared prefix); logits after its last token."""
        start = common_prefix(self._cache_tokens, prompt) if self.prefix_cache else 0
        start = min(start, len(prompt) - 1)
        self._cache_tokens = []
        logits = None
        for begin in range(start, len(prompt), self.prefill_chunk):
            chunk = prompt[begin:begin + self.prefill_chunk]
            tokens = torch.tensor([chunk], dtype=torch.long, device=self.device)
            logits = self.model(tokens, begin, "last")
        return logits[0, -1]

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
            costs = StepCosts.measure(self.model, self.max_k + 1)
            draft_cost = 0.0
            if isinstance(self.proposer, DraftModelProposer):
                draft_cost = StepCosts.measure(self.proposer.model, 1)(1)
            self._policy = AdaptiveK(costs, self.max_k, draft_cost)
        return self._policy

    def _generate(self, job: _Job) -> None:
        params = job.params
        policy = self._policy_for()  # measures step costs on first use, outside the timings
        t_start = time.perf_counter()
        prompt = self.tokenizer.encode_chat(job.messages)
        if len(prompt) + 1 > self.max_seq_len:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len}")
        greedy = params.temperature == 0
        metrics = SpecMetrics(lossy=self.acceptance_threshold < 1.0)
        uniforms = _Uniforms(self._seed_for(params), params.max_tokens + self.max_k + 2, self.device)
        out = _OutputText(self.tokenizer, params)

        logits = self._prefill(prompt)
        if greedy:
            first = int(logits.argmax())
        else:
            probs = probs_from_logits(logits[None], params.temperature, params.top_k, params.top_p)
            first = int(sample(probs, uniforms.residual[:1])[0])
        metrics.prefill_s = time.perf_counter() - t_start
        seq = prompt + [first]
        pos = len(prompt)  # tokens with keys/values in the cache; seq[pos] is the next input

        state = None
        if self.proposer is not None:
            if isinstance(self.proposer, DraftModelProposer):
                state = self.proposer.begin(prompt, temperature=params.temperature, top_k=params.top_k,
                                            top_p=params.top_p, generator=uniforms.draft_generator)
            else:
                state = self.proposer.begin(prompt)
            state.extend([first])
        try:
            text, ids, finish = out.add([first])
            while finish is None:
                if pos >= self.max_seq_len:
                    finish = "length"
                    text += out.finish()
                    break
                if not job.emit(Delta(text, tuple(ids))) or job.cancelled.is_set():
                    return
                new_tokens = self._step(seq, pos, len(prompt), state, policy, params, uniforms, metrics)
                pos += len(new_tokens)
                seq.extend(new_tokens)
                if state is not None:
                    state.extend(new_tokens)
                text, ids, finish = out.add(new_tokens)
            metrics.generated_tokens = len(out.token_ids) + out.hit_eos
            metrics.wall_s = time.perf_counter() - t_start
            with self._metrics_lock:
                self._metrics.merge(metrics)
            usage = Usage(prompt_tokens=len(prompt), completion_tokens=metrics.generated_tokens)
            job.emit(Delta(text, tuple(ids), finish_reason=finish, usage=usage, metrics=metrics))
        finally:
            self._cache_tokens = seq[:pos]
            if state is not None:
                state.end()

    def _step(self, seq: list[int], pos: int, prompt_len: int, state, policy: AdaptiveK | None,
              params: SamplingParams, uniforms: _Uniforms, metrics: SpecMetrics) -> list[int]:
        """One verify step from ``seq[pos]``: returns the accepted tokens plus the target's token."""
        produced = len(seq) - prompt_len  # output index of the token this step produces
        room = min(params.max_tokens - produced - 1, self.max_seq_len - pos - 1)
        t0 = time.perf_counter()
        draft, k = Draft([]), 0
        if state is not None and policy is None:
            k = min(self.fixed_k, room)
            draft = state.propose(k) if k > 0 else draft
        elif state is not None and isinstance(self.proposer, DraftModelProposer):
            k = policy.choose(room)  # model drafts cost a forward per token: choose k first
            draft = state.propose(k) if k > 0 else draft
        elif state is not None and room > 0:  # lookups are cheap: see the match, then choose k
            draft = state.propose(min(room, self.max_k))
            k = policy.choose(len(draft.tokens), AdaptiveK.bucket_of(draft.match_len))
        drafted = draft.tokens[:max(k, 0)]
        t1 = time.perf_counter()
        tokens = torch.tensor([[seq[pos], *drafted]], dtype=torch.long, device=self.device)
        logits = self.model(tokens, pos, "all")
        _sync(self.device)
        t2 = time.perf_counter()
        accepted, token = self._verify(drafted, draft, logits, params, uniforms, produced)
        t3 = time.perf_counter()
        metrics.draft_s += t1 - t0
        metrics.verify_s += t2 - t1
        metrics.sample_s += t3 - t2
        metrics.record_step(len(drafted), accepted)
        if policy is not None:
            policy.costs.observe(len(drafted) + 1, t2 - t1)
            if drafted:
                policy.observe(len(drafted), accepted, AdaptiveK.bucket_of(draft.match_len))
        return drafted[:accepted] + [token]

    def _verify(self, drafted: list[int], draft: Draft, logits: torch.Tensor,
                params: SamplingParams, uniforms: _Uniforms, at: int) -> tuple[int, int]:
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
