"""The lookup ceiling: the most a lookup drafter (n-gram, suffix) could gain on given outputs.

Walk the target's own greedy output as the engine would: at each step the drafter proposes up
to ``max_k`` tokens from the context so far, and an oracle that knows the output keeps exactly
the prefix verification would accept (nothing when the first token is wrong). No step pays for
rejected tokens, none skips a match it should have trusted. With ``cost(n)``, the time of one
target forward over n tokens, the ceiling's speedup over plain decoding is
``sum of cost(1) per token / sum of cost(accepted + 1) per step``.

Adaptive k has to choose before it knows, so it stays below the ceiling: the gap is what a better
k policy could still win; the ceiling itself is what only a better drafter (or flatter step
costs) could raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentrt.engine.drafters import DrafterState
from agentrt.engine.scheduler import common_prefix


@dataclass
class Walk:
    """Totals of a walk over one or more outputs (decode steps only: the first output token
    comes from the prefill)."""

    tokens: int = 0
    steps: int = 0
    plain_s: float = 0.0
    drafted_s: float = 0.0

    def __add__(self, other: Walk) -> Walk:
        return Walk(self.tokens + other.tokens, self.steps + other.steps,
                    self.plain_s + other.plain_s, self.drafted_s + other.drafted_s)

    @property
    def tau(self) -> float | None:
        """Tokens per verify step."""
        return self.tokens / self.steps if self.steps else None

    @property
    def speedup(self) -> float | None:
        """Decode speed over plain decoding, at the given step costs."""
        return self.plain_s / self.drafted_s if self.drafted_s else None


def walk(state: DrafterState, output: Sequence[int], cost: Callable[[int], float],
         max_k: int = 16) -> Walk:
    """Walk ``output`` with a drafter state that has seen the prompt; ends the state."""
    totals = Walk()
    if output:
        state.extend(output[:1])
    done = 1
    while done < len(output):
        # the last output token always comes from the target, so it is never matched
        accepted = common_prefix(state.draft(max_k).tokens, output[done:-1])
        step = output[done:done + accepted + 1]
        state.extend(step)
        done += len(step)
        totals.steps += 1
        totals.drafted_s += cost(accepted + 1)
    totals.tokens = max(len(output) - 1, 0)
    totals.plain_s = totals.tokens * cost(1)
    state.end()
    return totals
