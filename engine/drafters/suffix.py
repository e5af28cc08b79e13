"""Suffix-automaton drafting over the request's own tokens and a bounded cross-request corpus.

Two online suffix automata answer one question: where did the longest suffix of the current
sequence (up to about ``max_depth`` tokens) occur most recently? One automaton holds the
request's tokens (prompt + accepted output); the other holds a corpus of earlier requests'
outputs and remembered text (earlier code cells), capped at ``max_corpus_tokens`` with the oldest
documents evicted first. The proposal is what followed that most recent occurrence; the longer of
the two matches wins (the request's own on ties).

Every state keeps the most recent end position of its substrings. Updating that for all states
an appended token touches can cost O(n) per token on repetitive text, so only states whose
shortest substring has at most ``max_depth`` tokens are kept current, which caps the match length
the drafter relies on, and keeps each append O(max_depth) worst case (amortised O(1) for
the automaton itself). A proposal is O(k).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .base import Draft, DrafterDefaults, DraftSampling
from .ngram import continue_from

NO_MATCH = (-1, 0)
"""``(end, length)`` when nothing matched."""


class SuffixAutomaton:
    """An online suffix automaton over a token list that tracks each state's latest end position.

    ``last_end`` is exact for every state whose shortest string has at most ``max_depth`` tokens
    ("short" states); longer states defer to their nearest short suffix-link ancestor, found via
    path-compressed ``jump`` pointers.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.last_end: list[int] = [-1]
        self.jump: list[int] = [0]
        self._last = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    def append(self, token: int) -> tuple[int, int]:
        """Append ``token``; return ``(end, length)`` of the longest suffix seen before, or ``NO_MATCH``.

        ``end`` is the position where that suffix most recently ended before this token (so
        ``tokens[end + 1]`` is what followed it); ``length`` is the matched length, capped near
        ``max_depth``.
        """
        length, link, nxt, last_end = self.length, self.link, self.next, self.last_end
        pos = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(length[self._last] + 1, pos)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new_state(length[p] + 1, last_end[q])
                nxt[clone] = dict(nxt[q])
                link[clone] = link[q]
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur

        match = self.lookup(link[cur], length[link[cur]])
        x = self._short_ancestor(cur)
        while x > 0:  # every short state on cur's suffix path now ends at pos
            last_end[x] = pos
            x = link[x]
        return match

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Advance a match ``(state, matched length)`` of some external sequence by one token."""
        nxt, link = self.next, self.link
        while state and token not in nxt[state]:
            state = link[state]
            matched = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0

    def lookup(self, state: int, matched: int) -> tuple[int, int]:
        """``(end, length)`` of the most recent occurrence of a match held in ``state``."""
        if state == 0:
            return NO_MATCH
        short = self._short_ancestor(state)
        if short != state:
            matched = self.length[short]
        return self.last_end[short], matched

    def _new_state(self, length: int, last_end: int) -> int:
        state = len(self.length)
        self.length.append(length)
        self.link.append(0)
        self.next.append({})
        self.last_end.append(last_end)
        self.jump.append(state)
        return state

    def _short_ancestor(self, state: int) -> int:
        """The first state on ``state``'s suffix-link path whose shortest string is <= max_depth."""
        length, link, jump, depth = self.length, self.link, self.jump, self.max_depth
        x = state
        passed = []
        while x and length[link[x]] >= depth:
            passed.append(x)
            x = jump[x] if jump[x] != x else link[x]
        for long_state in passed:
            jump[long_state] = x
        return x


class _Corpus:
    """Earlier outputs and remembered text, as one automaton over separator-joined documents."""

    def __init__(self, max_tokens: int, max_depth: int) -> None:
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self.docs: deque[list[int]] = deque()
        self.num_tokens = 0
        self.version = 0
        self.automaton = SuffixAutomaton(max_depth)
        self._separators = 0

    def add(self, token_ids: Sequence[int]) -> None:
        doc = [int(t) for t in token_ids][-self.max_tokens :]
        if not doc:
            return
        self.docs.append(doc)
        self.num_tokens += len(doc)
        if self.num_tokens > self.max_tokens:
            # Evict down to a low-water mark so rebuilds stay rare (amortised O(1) per token).
            low_water = self.max_tokens - self.max_tokens // 4
            while len(self.docs) > 1 and self.num_tokens > low_water:
                self.num_tokens -= len(self.docs.popleft())
            self.automaton = SuffixAutomaton(self.max_depth)
            for kept in self.docs:
                self._append(kept)
        else:
            self._append(doc)
        self.version += 1

    def continuation(self, end: int, k: int) -> list[int]:
        """Up to ``k`` corpus tokens after position ``end``, stopping at a document boundary."""
        out = []
        for token in self.automaton.tokens[end + 1 : end + 1 + k]:
            if token < 0:
                break
            out.append(token)
        return out

    def _append(self, doc: list[int]) -> None:
        for token in doc:
            self.automaton.append(token)
        self._separators += 1
        self.automaton.append(-self._separators)  # unique, so no match crosses documents


class SuffixDrafter(DrafterDefaults):
    """Drafts from the longest suffix match in the request itself or in earlier requests' text.

    ``max_depth`` caps the match length the drafter relies on; ``max_corpus_tokens`` bounds the
    cross-request corpus (oldest documents are evicted first); ``min_match`` is the shortest match
    worth proposing from.
    """

    name = "suffix"
    lookup = True

    def __init__(
        self, max_depth: int = 32, max_corpus_tokens: int = 1 << 16, min_match: int = 1
    ) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_corpus_tokens < 1:
            raise ValueError(f"max_corpus_tokens must be >= 1, got {max_corpus_tokens}")
        if not 1 <= min_match <= max_depth:
            raise ValueError(f"min_match must be in [1, max_depth], got {min_match}")
        self.max_depth = max_depth
        self.min_match = min_match
        self.corpus = _Corpus(max_corpus_tokens, max_depth)

    @property
    def corpus_tokens(self) -> int:
        """Tokens currently held in the cross-request corpus."""
        return self.corpus.num_tokens

    def draft_cost(self, context: int = 64) -> float:
        """A lookup costs microseconds: nothing worth modelling."""
        return 0.0

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> "SuffixState":
        """Index the prompt of a new request."""
        return SuffixState(self, prompt_ids)

    def remember(self, token_ids: Sequence[int]) -> None:
        """Add ``token_ids`` to the corpus as one document."""
        self.corpus.add(token_ids)

    def reset(self) -> None:
        """Start a new, empty corpus (earlier outputs and remembered text are forgotten;
        requests still running keep the corpus they started with)."""
        self.corpus = _Corpus(self.corpus.max_tokens, self.max_depth)


class SuffixState:
    """One request: its own automaton, plus a match walked through the shared corpus."""

    def __init__(self, drafter: SuffixDrafter, prompt_ids: Sequence[int]) -> None:
        self._drafter = drafter
        self._corpus = drafter.corpus
        self._own = SuffixAutomaton(drafter.max_depth)
        self._own_match = NO_MATCH
        self._prompt_len = len(prompt_ids)
        self._corpus_state = (0, 0)
        self._corpus_synced = 0  # tokens walked through the corpus automaton
        self._corpus_version = -1
        self._ended = False
        self.extend(prompt_ids)

    @property
    def tokens(self) -> list[int]:
        """The request's sequence so far."""
        return self._own.tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens."""
        for token in token_ids:
            self._own_match = self._own.append(int(token))

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens after the most recent occurrence of the longest matching suffix."""
        if k <= 0:
            return Draft([])
        min_match, depth = self._drafter.min_match, self._drafter.max_depth
        own_end, own_len = self._own_match
        corpus_end, corpus_len = self._corpus_match()
        own = (own_end, min(own_len, depth)) if own_len >= min_match else NO_MATCH
        corpus = (corpus_end, min(corpus_len, depth)) if corpus_len >= min_match else NO_MATCH
        candidates = [("own", own), ("corpus", corpus)]
        if corpus[1] > own[1]:
            candidates.reverse()
        for source, (end, matched) in candidates:
            if matched == 0:
                continue
            if source == "own":
                tokens = continue_from(self.tokens, end + 1, k)
            else:
                tokens = self._corpus.continuation(end, k)
            if tokens:
                return Draft(tokens, match_len=matched)
        return Draft([])

    def end(self) -> None:
        """Add this request's output to the corpus (once)."""
        if not self._ended:
            self._ended = True
            self._corpus.add(self.tokens[self._prompt_len :])

    def _corpus_match(self) -> tuple[int, int]:
        """Bring the corpus walk up to date with our tokens, then look up its occurrence."""
        corpus, tokens = self._corpus, self.tokens
        behind = len(tokens) - self._corpus_synced
        if self._corpus_version != corpus.version or behind > self._drafter.max_depth:
            self._corpus_state = (0, 0)
            self._corpus_synced = max(0, len(tokens) - self._drafter.max_depth)
            self._corpus_version = corpus.version
        state, matched = self._corpus_state
        automaton = corpus.automaton
        for token in tokens[self._corpus_synced :]:
            state, matched = automaton.step(state, matched, token)
        self._corpus_state = (state, matched)
        self._corpus_synced = len(tokens)
        return automaton.lookup(state, matched)
