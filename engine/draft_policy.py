"""Draft-length policy: how many drafted tokens each request verifies in a step.

`StepCosts` is what a target forward over n rows costs on this machine (measured at start-up,
scaled by the load seen since); `AdaptiveK` keeps per-position acceptance estimates per match
length and picks the k that maximises expected tokens per second; `plan_draft_lengths` shares
one batched step's rows among its requests (`drafting.choose_drafts` applies all that to the
requests decoding in a step).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from .llama import SequenceCache, Transformer, synchronize


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
        """Time forwards of one sequence over n = 1, 2, 3, 4, 6, 8, 12, 16, ... tokens after
        ``context`` tokens (best of ``repeats``; a size that measured slower than a larger one
        is capped at the larger one's time), on the model's one forward and a cache of its own."""
        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n <= max_n} | {max_n})
        context = max(0, min(context, model.max_seq_len - max_n - 1))
        device = model.device
        cache = SequenceCache(model, max_len=context + max_n + 1)
        cache(torch.zeros(1, context + 1, dtype=torch.long, device=device), 0, "last")
        costs = {}
        for n in sizes:
            tokens = torch.zeros(1, n, dtype=torch.long, device=device)
            best = float("inf")
            for _ in range(repeats):
                synchronize(device)
                t = time.perf_counter()
                cache(tokens, context, "all")
                synchronize(device)
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
    plain decoding, drafting is off for that bucket, with a probe every ``probe_every``
    steps so the estimate can recover. ``draft_cost_per_token``: seconds of a drafted token,
    or a function of the sequence's length giving them (a drafter that attends over the
    request's context, the int8 twin, costs more per token as the context grows).
    """

    BUCKETS = 5

    @staticmethod
    def bucket_of(match_len: int) -> int:
        """0: not a lookup (model drafts); 1, 2, 3: matched that many tokens; 4: four or more."""
        return max(0, min(match_len, AdaptiveK.BUCKETS - 1))

    def __init__(self, costs: StepCosts, max_k: int,
                 draft_cost_per_token: float | Callable[[int], float] = 0.0,
                 prior: float = 0.6, decay: float = 0.9, probe_every: int = 24, probe_k: int = 4,
                 model_prior: float | None = None):
        self.costs = costs
        self.max_k = max_k
        self._draft_cost = (draft_cost_per_token if callable(draft_cost_per_token)
                            else lambda context, cost=draft_cost_per_token: cost)
        self.prior = prior
        self.model_prior = prior if model_prior is None else model_prior
        """The prior of bucket 0 (model drafts): a drafter that knows its acceptance is high
        (the int8 twin) says so, or a hybrid would hardly ever try it against free lookups."""
        self.decay = decay
        self.probe_every = probe_every
        self.probe_k = min(probe_k, max_k)
        self.forget()

    def draft_cost(self, context: int = 64) -> float:
        """Seconds of one model-drafted token for a sequence of ``context`` positions (the
        drafter's `draft_cost`; a constant where it was given as a number)."""
        return self._draft_cost(context)

    def accept(self, bucket: int = 0) -> list[float]:
        """Estimated acceptance of each draft position, given the earlier ones were accepted."""
        prior = self.model_prior if bucket == 0 else self.prior
        rates, last = [], prior
        for hits, seen in zip(self.hits[bucket], self.seen[bucket]):
            if seen >= 1.0:
                last = (hits + prior) / (seen + 1.0)
            rates.append(last)
        return rates

    def expected_tokens(self, k: int, accept: list[float] | None = None) -> float:
        accept = self.accept() if accept is None else accept
        total, chain = 1.0, 1.0
        for i in range(k):
            chain *= accept[i]
            total += chain
        return total

    def rate(self, k: int, accept: list[float] | None = None, draft_cost: float | None = None) -> float:
        """Expected tokens per second with k drafts (``draft_cost`` per drafted token; default:
        the drafter's)."""
        per_token = self.draft_cost() if draft_cost is None else draft_cost
        return self.expected_tokens(k, accept) / (self.costs(k + 1) + per_token * k)

    def best_rate(self, limit: int, bucket: int = 0, draft_cost: float | None = None) -> float:
        """The highest expected tokens per second over k in ``0..min(limit, max_k)``."""
        accept = self.accept(bucket)
        return max(self.rate(k, accept, draft_cost) for k in range(min(limit, self.max_k) + 1))

    def choose(self, limit: int, bucket: int = 0, draft_cost: float | None = None) -> int:
        """The best k in ``0..min(limit, max_k)`` for a draft of this bucket (``draft_cost``
        per drafted token; default: the drafter's at a short context)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        accept = self.accept(bucket)
        best = max(range(limit + 1), key=lambda k: self.rate(k, accept, draft_cost))
        if best > 0:
            self._off_steps[bucket] = 0
            return best
        return self._off(bucket, limit)

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
        return self._off(bucket, available)

    def _off(self, bucket: int, limit: int) -> int:
        """One more step without drafts for ``bucket``: 0, or ``probe_k`` (at most ``limit``)
        every ``probe_every`` such steps."""
        self._off_steps[bucket] += 1
        if self._off_steps[bucket] >= self.probe_every:
            self._off_steps[bucket] = 0
            return min(self.probe_k, limit)
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


def plan_draft_lengths(chains: list[list[float]], base_tokens: int, base_rows: int,
                       cost: Callable[[int], float], draft_cost: float = 0.0) -> list[int]:
    """Draft lengths for the sequences of one batched step, chosen together.

    ``chains[i][j]``: the estimated probability that sequence i's draft tokens 0..j are all
    accepted (non-increasing in j). The step already runs ``base_rows`` rows and yields
    ``base_tokens`` tokens; each extra draft row adds its chain probability in expected tokens
    and costs what the step's time grows by. The best set of rows for expected tokens per
    second is a prefix of all candidate rows sorted by that probability (each sequence's rows
    in order), so this tries every prefix: at a small batch drafting is nearly free and long
    drafts pay; at a large one each row costs almost a full row of compute and only the likely
    ones are kept. ``draft_cost`` (model drafts): seconds of a one-row draft forward; the
    drafts of one position run as one batched forward, charged as the target's forward over as
    many rows is (``draft_cost * cost(n) / cost(1)``)."""
    candidates = sorted(((p, i) for i, chain in enumerate(chains) for p in chain), reverse=True)
    best_m, best_rate, tokens = 0, base_tokens / cost(base_rows), float(base_tokens)
    drafted, at_depth, drafting, one = [0] * len(chains), [], 0.0, cost(1)
    for m, (p, i) in enumerate(candidates, start=1):
        tokens += p
        if draft_cost:
            depth = drafted[i]
            drafted[i] += 1
            if depth == len(at_depth):
                at_depth.append(0)
            n = at_depth[depth]
            drafting += draft_cost * (cost(n + 1) - (cost(n) if n else 0.0)) / one
            at_depth[depth] = n + 1
        rate = tokens / (cost(base_rows + m) + drafting)
        if rate > best_rate:
            best_m, best_rate = m, rate
    lengths = [0] * len(chains)
    for _, i in candidates[:best_m]:
        lengths[i] += 1
    return lengths
