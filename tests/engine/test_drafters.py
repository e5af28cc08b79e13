"""Drafters: n-gram prompt lookup and the suffix automaton; adaptive k's draft lengths."""

from __future__ import annotations

import random
import time

import pytest

from agentrt.engine.drafters import Draft, Drafter, DrafterState, NgramDrafter, SuffixDrafter
from agentrt.engine.drafters.suffix import SuffixAutomaton

DRAFTERS = [NgramDrafter, SuffixDrafter]


def fresh(n: int, start: int = 10_000) -> list[int]:
    """``n`` distinct tokens never used elsewhere in a test."""
    return list(range(start, start + n))


@pytest.mark.parametrize("make", DRAFTERS)
def test_satisfies_the_protocols(make):
    drafter = make()
    state = drafter.begin([1, 2, 3])
    assert isinstance(drafter, Drafter) and isinstance(drafter.name, str)
    assert isinstance(state, DrafterState)
    assert isinstance(state.draft(3), Draft)


@pytest.mark.parametrize("make", DRAFTERS)
def test_continues_a_repeated_span(make):
    span = [5, 6, 7, 8, 9, 10, 11]
    state = make().begin([1, 2, *span, 3, 4, 5, 6])
    assert state.draft(4).tokens == [7, 8, 9, 10]
    state.extend([7, 8])
    assert state.draft(3).tokens == [9, 10, 11]


@pytest.mark.parametrize("make", DRAFTERS)
def test_reports_how_much_context_the_proposal_matched(make):
    # the sequence ends in "3 4 5 6", which occurred before: a 4-token match (at least)
    state = make().begin([9, 3, 4, 5, 6, 7, 8, 1, 3, 4, 5, 6])
    assert state.draft(2).match_len >= 4
    state = make().begin([9, 6, 7, 8, 1, 2, 3, 6])  # only "6" repeats
    draft = state.draft(2)
    assert draft.tokens == [7, 8] or draft.tokens == []
    assert draft.match_len == (1 if draft.tokens else 0)


@pytest.mark.parametrize("make", DRAFTERS)
def test_prefers_the_longest_then_most_recent_match(make):
    # "2" alone was last followed by 50, but the longer suffixes "1 2" / "9 1 2" last led to 40.
    prompt = [1, 2, 30, 9, 1, 2, 40, 9, 7, 2, 50, 9, 1, 2]
    assert make().begin(prompt).draft(2).tokens == [40, 9]


@pytest.mark.parametrize("make", DRAFTERS)
def test_learns_from_accepted_output(make):
    state = make().begin(fresh(20))
    assert state.draft(3).tokens == []
    state.extend([1, 2, 3, 4, 5, 1, 2])
    assert state.draft(3).tokens == [3, 4, 5]


@pytest.mark.parametrize("make", DRAFTERS)
def test_repetition_runs_on_past_the_end(make):
    state = make().begin([7, 8, 7, 8, 7])
    assert state.draft(5).tokens == [8, 7, 8, 7, 8]


@pytest.mark.parametrize("make", DRAFTERS)
def test_empty_when_nothing_matches(make):
    state = make().begin(fresh(50))
    assert state.draft(5) == Draft([])
    assert make().begin([]).draft(5).tokens == []
    assert make().begin([1, 1, 1]).draft(0).tokens == []


@pytest.mark.parametrize("make", DRAFTERS)
def test_proposals_never_exceed_k(make):
    rng = random.Random(0)
    state = make().begin([rng.randrange(4) for _ in range(300)])
    for step in range(200):
        k = step % 8
        draft = state.draft(k)
        assert len(draft.tokens) <= k and draft.probs is None
        state.extend(draft.tokens[: rng.randrange(len(draft.tokens) + 1)] + [rng.randrange(4)])


def test_ngram_respects_min_n():
    assert NgramDrafter(min_n=2).begin([1, 2, 3, 9, 3]).draft(2).tokens == []
    assert NgramDrafter(min_n=1).begin([1, 2, 3, 9, 3]).draft(2).tokens == [9, 3]
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)


def test_suffix_proposes_from_an_earlier_requests_output():
    drafter = SuffixDrafter()
    first = drafter.begin(fresh(30))
    output = [1, 2, 3, 4, 5, 6, 7, 8]
    first.extend(output)
    first.end()
    assert drafter.corpus_tokens == len(output)  # the output, not the prompt

    second = drafter.begin(fresh(30, start=20_000) + [1, 2, 3])
    assert second.draft(4).tokens == [4, 5, 6, 7]
    assert NgramDrafter().begin(fresh(30, start=20_000) + [1, 2, 3]).draft(4).tokens == []


def test_suffix_proposes_from_remembered_text_and_sees_it_mid_request():
    drafter = SuffixDrafter()
    state = drafter.begin(fresh(10) + [41, 42])
    assert state.draft(3).tokens == []
    drafter.remember([40, 41, 42, 43, 44, 45])
    assert state.draft(3).tokens == [43, 44, 45]
    state.extend([43, 44])
    assert state.draft(3).tokens == [45]  # stops at the end of that document


def test_suffix_never_proposes_across_documents():
    drafter = SuffixDrafter()
    drafter.remember([1, 2, 3])
    drafter.remember([4, 5, 6])
    assert drafter.begin(fresh(5) + [2, 3]).draft(4).tokens == []


def test_suffix_longer_corpus_match_beats_shorter_own_match():
    drafter = SuffixDrafter()
    drafter.remember([60, 61, 62, 63, 64])
    # own text: "62" followed by 99 once; corpus: "61 62" followed by 63.
    state = drafter.begin([62, 99, 5, 61, 62])
    assert state.draft(2).tokens == [63, 64]


def test_suffix_corpus_is_bounded_and_evicts_oldest():
    drafter = SuffixDrafter(max_corpus_tokens=100)
    old, middle, new = fresh(60, 1000), fresh(30, 2000), fresh(60, 3000)
    drafter.remember(old)
    drafter.remember(middle)
    assert drafter.corpus_tokens == 90
    drafter.remember(new)
    assert drafter.corpus_tokens <= 100
    assert drafter.begin(old[:3]).draft(2).tokens == []  # evicted
    assert drafter.begin(new[:3]).draft(2).tokens == new[3:5]

    for i in range(50):  # memory stays bounded however much is added
        drafter.remember(fresh(40, 10_000 + 100 * i))
        assert drafter.corpus_tokens <= 100
    assert drafter.corpus.automaton.num_states <= 2 * (100 + 50)
    huge = fresh(500, 50_000)
    drafter.remember(huge)  # a document bigger than the cap keeps its most recent part
    assert drafter.corpus_tokens == 100
    assert drafter.begin(huge[-10:-7]).draft(2).tokens == huge[-7:-5]


def test_suffix_end_is_idempotent():
    drafter = SuffixDrafter()
    state = drafter.begin([1])
    state.extend([2, 3])
    state.end()
    state.end()
    assert drafter.corpus_tokens == 2


def brute_force_latest(seq: list[int], length: int, before: int) -> int | None:
    """Latest end e < before at which the last ``length`` tokens of seq also occur."""
    suffix = seq[len(seq) - length :]
    for end in range(before - 1, length - 2, -1):
        if seq[end - length + 1 : end + 1] == suffix:
            return end
    return None


@pytest.mark.parametrize("max_depth", [1, 3, 8])
def test_suffix_automaton_matches_brute_force(max_depth):
    rng = random.Random(max_depth)
    for _ in range(60):
        alphabet = rng.choice([1, 2, 3, 5])
        if rng.random() < 0.3:  # periodic text stresses long suffix-link chains
            period = [rng.randrange(alphabet) for _ in range(rng.randint(1, 5))]
            seq = [period[i % len(period)] for i in range(rng.randint(1, 80))]
        else:
            seq = [rng.randrange(alphabet) for _ in range(rng.randint(1, 80))]
        automaton = SuffixAutomaton(max_depth)
        for i, token in enumerate(seq):
            end, length = automaton.append(token)
            prefix = seq[: i + 1]
            longest = 0
            while longest < i and brute_force_latest(prefix, longest + 1, i) is not None:
                longest += 1
            if longest == 0:
                assert (end, length) == (-1, 0)
                continue
            assert min(longest, max_depth) <= length <= longest
            assert end == brute_force_latest(prefix, length, i)


def test_suffix_automaton_walk_matches_brute_force():
    rng = random.Random(1)
    for _ in range(60):
        depth = rng.choice([2, 4, 16])
        text = [rng.randrange(3) for _ in range(rng.randint(1, 60))]
        automaton = SuffixAutomaton(depth)
        for token in text:
            automaton.append(token)
        query = [rng.randrange(3) for _ in range(20)]
        state, matched = 0, 0
        for j, token in enumerate(query):
            state, matched = automaton.step(state, matched, token)
            end, length = automaton.lookup(state, matched)
            longest = 0
            while longest <= j and any(
                text[e - longest : e + 1] == query[j - longest : j + 1] for e in range(longest, len(text))
            ):
                longest += 1
            assert matched == longest
            if longest:
                suffix = query[j + 1 - length : j + 1]
                ends = [e for e in range(length - 1, len(text)) if text[e - length + 1 : e + 1] == suffix]
                assert end == max(ends)


@pytest.mark.parametrize("make", DRAFTERS)
def test_proposing_on_a_20k_token_context_is_fast(make):
    rng = random.Random(2)
    snippets = [[rng.randrange(5000) for _ in range(rng.randint(5, 40))] for _ in range(100)]
    context: list[int] = []
    while len(context) < 20_000:
        context += rng.choice(snippets)
    state = make().begin(context[:20_000])
    calls, drafted, propose_s = 1000, 0, 0.0
    start = time.perf_counter()
    for _ in range(calls):
        before = time.perf_counter()
        draft = state.draft(5)
        propose_s += time.perf_counter() - before
        drafted += len(draft.tokens)
        state.extend(draft.tokens[:2] or [rng.randrange(5000)])
    step_us = (time.perf_counter() - start) / calls * 1e6
    propose_us = propose_s / calls * 1e6
    print(f"\n{make.__name__} on a 20k-token context: propose {propose_us:.1f} us, "
          f"propose+extend {step_us:.1f} us per call")
    assert drafted > 0
    assert propose_us < 5000  # coarse sanity bound only; the target is well under 1 ms


def test_adaptive_k_learns_per_match_length():
    from agentrt.engine.draft_policy import AdaptiveK, StepCosts

    costs = StepCosts({1: 0.030, 2: 0.032, 4: 0.036, 8: 0.045, 16: 0.09})
    policy = AdaptiveK(costs, max_k=12)
    weak, strong = AdaptiveK.bucket_of(1), AdaptiveK.bucket_of(9)
    assert (weak, strong) == (1, AdaptiveK.BUCKETS - 1) and AdaptiveK.bucket_of(0) == 0
    for _ in range(30):
        policy.observe(6, 0, weak)     # 1-token matches: never accepted
        policy.observe(8, 8, strong)   # long matches: always accepted
    assert policy.choose(12, weak) == 0
    assert policy.choose(12, strong) >= 6
    assert policy.choose(3, strong) == 3  # never more than the draft holds
    # a bucket switched off probes again now and then, so its estimate can recover
    picks = [policy.choose(12, weak) for _ in range(policy.probe_every)]
    assert picks.count(0) == policy.probe_every - 1 and max(picks) > 0


def test_step_costs_fold_observations_into_the_whole_curve():
    """A batch's step time (many sequences' attention) scales every size alike: it must never
    make a few more rows look cheaper than the rows already in the step."""
    from agentrt.engine.draft_policy import StepCosts, plan_draft_lengths

    costs = StepCosts({1: 0.010, 8: 0.014, 16: 0.020, 32: 0.040})
    for _ in range(50):
        costs.observe(16, 0.060)  # 16 sequences' steps, 3x the one-sequence measurement
    assert costs(16) == pytest.approx(0.060, rel=0.05)
    assert costs(16) < costs(17) < costs(24)
    assert costs(24) / costs(16) == pytest.approx(costs.measured(24) / costs.measured(16))
    # 16 sequences each with a weak 2-row draft: the extra rows do not pay for themselves
    assert plan_draft_lengths([[0.3, 0.1]] * 16, 16, 16, costs) == [0] * 16


def test_probes_count_steps_not_sequences():
    from agentrt.engine.draft_policy import AdaptiveK, StepCosts

    policy = AdaptiveK(StepCosts({1: 0.01, 8: 0.012}), max_k=8)
    probes = 0
    for _ in range(3 * policy.probe_every):
        policy.next_step()
        probes += sum(policy.probe(0, 5, 1) > 0 for _ in range(16))  # 16 sequences, bucket 1
    assert probes == 3
