"""A token bucket: how fast something may happen, in bursts."""

from __future__ import annotations

import time


class TokenBucket:
    """At most ``burst`` events at once, refilled at ``rate`` per second."""

    def __init__(self, burst: int, rate: float) -> None:
        self._burst, self._rate = burst, rate
        self._tokens, self._stamp = float(burst), time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def take(self) -> bool:
        """Take a token if there is one."""
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def spend(self) -> None:
        """Take a token even if there is none (the balance goes negative)."""
        self._refill()
        self._tokens -= 1

    def debt_s(self) -> float:
        """Seconds until the balance is no longer negative."""
        self._refill()
        return max(0.0, -self._tokens / self._rate)
