"""A step's drafts: what each decoding request verifies (`choose_drafts`), and the model drafts
run into the rows the step planned for them (`draft_models`).

Lookups (n-gram, suffix) cost microseconds, so they are drafted first and k is chosen for what
they found; model drafts cost a forward per token, so k is chosen first and they run once the
scheduler has planned the step (`StepPlan`), all of a step's together (`Drafter.draft_many`).
With adaptive k (`draft_policy.AdaptiveK`) the k's of a batch are chosen together
(`plan_draft_lengths`); without it, every request drafts the fixed k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from .draft_policy import AdaptiveK, plan_draft_lengths
from .drafters.base import Draft, Drafter, HybridState
from .step_plan import DecodeRows, DraftChoice

if TYPE_CHECKING:
    from .sequence import RequestState


def choose_drafts(decoding: Sequence[RequestState], drafter: Drafter | None,
                  policy: AdaptiveK | None, max_k: int, max_seq_len: int
                  ) -> dict[RequestState, DraftChoice]:
    """Each decoding request's `DraftChoice` for this step (at most ``max_k`` tokens, and no
    more than its ``max_tokens`` and ``max_seq_len`` leave room for; none at the prompt's last
    token, which counts as prefill). Without ``policy``,
    ``max_k`` tokens (the fixed k). A hybrid drafter's request takes its lookup's draft or a
    model draft (`_lookup_wins`)."""
    if policy is not None:
        policy.next_step()
    choices: dict[RequestState, DraftChoice] = {}
    lookups: dict[RequestState, Draft] = {}
    models: dict[RequestState, int] = {}  # model drafts: the most tokens each may take
    for seq in decoding:
        limit = min(max_k, seq.params.max_tokens - seq.produced - 1, max_seq_len - seq.computed - 1)
        if drafter is None or seq.state is None or limit <= 0 or not seq.produced:
            choices[seq] = DraftChoice()
        elif drafter.hybrid:
            found = cast(HybridState, seq.state).lookup_draft(limit)
            if _lookup_wins(found, seq, policy, limit):
                lookups[seq] = found
            else:
                models[seq] = limit
        elif drafter.lookup:
            lookups[seq] = seq.state.draft(limit)
        else:
            models[seq] = limit
    if policy is None:
        lengths = models | {seq: len(draft.tokens) for seq, draft in lookups.items()}
    else:
        lengths = _plan_lengths(decoding, lookups, models, policy) if lookups or models else {}
    for seq, draft in lookups.items():
        choices[seq] = DraftChoice(draft.tokens[:lengths[seq]], draft)
    for seq in models:
        choices[seq] = DraftChoice(model_k=lengths[seq])
    return choices


def _lookup_wins(found: Draft, seq: RequestState, policy: AdaptiveK | None, limit: int) -> bool:
    """Whether a hybrid request drafts its lookup's ``found`` rather than a model draft: with a
    fixed k, when it matched the state's ``min_match`` tokens; with adaptive k, when it matched
    4 or more tokens and such matches are mostly accepted (the first token at least half the
    time), or when its best expected tokens per second (acceptance of its match length, no
    draft cost) is at least the model's (acceptance of model drafts, the model's cost per
    token at the request's length). (Comparing rates alone, a model drafter accepted nearly
    always, the int8 twin, took steps from long lookups: `hybrid-twin` fell below `suffix` on
    agent code.)"""
    if not found.tokens:
        return False
    if policy is None:
        return found.match_len >= cast(HybridState, seq.state).min_match
    bucket = AdaptiveK.bucket_of(found.match_len)
    if bucket == AdaptiveK.BUCKETS - 1 and policy.accept(bucket)[0] >= 0.5:
        return True
    return (policy.best_rate(len(found.tokens), bucket, 0.0)
            >= policy.best_rate(limit, 0, policy.draft_cost(seq.computed)))


def _plan_lengths(decoding: Sequence[RequestState], lookups: dict[RequestState, Draft],
                  models: dict[RequestState, int], policy: AdaptiveK) -> dict[RequestState, int]:
    """Adaptive k for a step: the most urgent requests plan as if alone (less urgent rows must
    not make the urgent stream draft less), the others around what those use; within each, the
    model drafts first (`_model_lengths`), then the lookups, over the rows planned so far."""
    urgent = min(seq.priority for seq in decoding)
    first = sum(1 for seq in decoding if seq.priority == urgent)
    lengths: dict[RequestState, int] = {}
    rows = first
    for tokens, is_urgent in ((first, True), (len(decoding) - first, False)):
        def mine(seqs: dict) -> list[RequestState]:
            return [seq for seq in seqs if (seq.priority == urgent) == is_urgent]

        group = mine(models)
        if group:
            base = rows if is_urgent else rows + tokens
            lengths |= _model_lengths(group, models, policy, tokens, base, alone=len(models) == 1)
            rows += sum(lengths[seq] for seq in group)
        looks = mine(lookups)
        if looks:
            base = rows if is_urgent else rows + tokens
            buckets = [AdaptiveK.bucket_of(lookups[seq].match_len) for seq in looks]
            chains = [_chain(policy.accept(b), len(lookups[seq].tokens)) for seq, b in zip(looks, buckets)]
            planned = plan_draft_lengths(chains, max(tokens, 1), base, policy.costs)
            for seq, k, b in zip(looks, planned, buckets):
                lengths[seq] = policy.probe(k, len(lookups[seq].tokens), b)
                rows += lengths[seq]
    return lengths


def _model_lengths(group: list[RequestState], models: dict[RequestState, int],
                   policy: AdaptiveK, tokens: int, base: int, alone: bool) -> dict[RequestState, int]:
    """Model draft lengths for ``group`` (the step yields ``tokens`` tokens over ``base`` rows
    without them): `AdaptiveK.choose` for a request drafting alone, else planned together,
    each position's drafts charged as one batched draft forward at the group's mean length."""
    if alone:
        seq = group[0]
        return {seq: policy.choose(models[seq], draft_cost=policy.draft_cost(seq.computed))}
    chains = [_chain(policy.accept(0), models[seq]) for seq in group]
    context = sum(seq.computed for seq in group) // len(group)
    planned = plan_draft_lengths(chains, max(tokens, 1), base, policy.costs,
                                 policy.draft_cost(context))
    return {seq: policy.probe(k, models[seq]) for seq, k in zip(group, planned)}


def _chain(accept: list[float], limit: int) -> list[float]:
    """Probabilities that the first 1, 2, ... ``limit`` draft tokens are all accepted."""
    chain, p = [], 1.0
    for a in accept[:limit]:
        p *= a
        chain.append(p)
    return chain


def draft_models(drafter: Drafter, rows: Sequence[DecodeRows]) -> None:
    """Run the model drafts the plan reserved rows for (`DecodeRows.model_k`), all of the
    step's in one `Drafter.draft_many` call, in their slots where the drafter writes the
    target's cache, and fill the rows with them."""
    wanted = [r for r in rows if r.model_k > 0]
    if not wanted:
        return
    slots = [r.slots() if drafter.writes_target_cache else None for r in wanted]
    drafts = drafter.draft_many([r.seq.state for r in wanted], [r.model_k for r in wanted], slots)
    for r, draft in zip(wanted, drafts):
        r.fill(draft)
