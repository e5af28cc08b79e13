"""Prompt-lookup drafting: continue the most recent earlier occurrence of the longest suffix n-gram."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Draft, DrafterDefaults, DraftSampling


class NgramDrafter(DrafterDefaults):
    """Prompt lookup in the request's own tokens (prompt + output so far).

    For ``n`` from ``max_n`` down to ``min_n`` it looks up the last ``n`` tokens and proposes what
    followed their most recent earlier occurrence. Indexing is incremental (``O(max_n)`` per
    token); a proposal costs ``O(max_n + k)``. `remember` is a no-op: this drafter only looks
    inside the request.
    """

    name = "ngram"
    lookup = True

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def draft_cost(self, context: int = 64) -> float:
        """A lookup costs microseconds: nothing worth modelling."""
        return 0.0

    def begin(self, prompt_ids: Sequence[int], sampling: DraftSampling | None = None) -> "NgramState":
        """Index the prompt of a new request."""
        return NgramState(self.min_n, self.max_n, prompt_ids)

    def remember(self, token_ids: Sequence[int]) -> None:
        """Ignored: prompt lookup has no cross-request memory."""
        return None

    def reset(self) -> None:
        """Nothing to forget: prompt lookup keeps nothing across requests."""
        return None


class NgramState:
    """Per-request n-gram index: ``n-gram -> start of what followed its most recent occurrence``."""

    def __init__(self, min_n: int, max_n: int, prompt_ids: Sequence[int]) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._followers: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self.extend(prompt_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append accepted tokens; each n-gram that now has a continuation is (re)indexed."""
        tokens = self.tokens
        old_len = len(tokens)
        tokens.extend(int(t) for t in token_ids)
        new_len = len(tokens)
        for n, followers in self._followers.items():
            # The n-gram tokens[pos - n : pos] is followed by the new token at each new pos;
            # later positions overwrite earlier ones, so the most recent occurrence wins.
            first = max(old_len, n)
            if new_len - first <= 8:
                for pos in range(first, new_len):
                    followers[tuple(tokens[pos - n : pos])] = pos
            else:  # bulk path for prompts: build all n-grams with C-level slicing and zip
                grams = zip(*(tokens[first - n + j : new_len - n + j] for j in range(n)))
                followers.update(zip(grams, range(first, new_len)))

    def draft(self, k: int) -> Draft:
        """Up to ``k`` tokens after the most recent earlier match of the longest suffix n-gram."""
        if k <= 0:
            return Draft([])
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._followers[n].get(tuple(tokens[-n:]))
            if start is not None:
                return Draft(continue_from(tokens, start, k), match_len=n)
        return Draft([])

    def end(self) -> None:
        """Nothing to keep after the request."""
        return None


def continue_from(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens of ``tokens`` from ``start``, running on into the proposal itself.

    If the match is close to the end (a repetition with period ``len(tokens) - start``), the
    proposal keeps repeating that period, which is what the sequence would read if accepted.
    """
    out = list(tokens[start : start + k])
    period = len(tokens) - start
    while len(out) < k and period > 0:
        out.append(out[len(out) - period])
    return out
