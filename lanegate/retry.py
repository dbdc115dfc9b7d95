"""Delays between retries: doubling, capped, and jittered, so that what failed together
(webhook deliveries refused by one receiver, workers that lost one Redis, children that
died with one cause) does not retry together.

The jitter is redis-py's ``EqualJitterBackoff``: each delay is between half and all of
``first_s x 2^failures`` (capped at ``cap_s``): never less than half the nominal wait,
and spread over the other half.
"""

from __future__ import annotations

from redis.backoff import EqualJitterBackoff


def jittered_s(first_s: float, cap_s: float, failures: int) -> float:
    """The delay after ``failures + 1`` consecutive failures (0: the first retry)."""
    return float(EqualJitterBackoff(cap=cap_s, base=first_s).compute(max(0, failures)))


class Backoff:
    """The retry delays of one thing that keeps failing; ``reset`` after a success."""

    def __init__(self, first_s: float, cap_s: float) -> None:
        self._policy = EqualJitterBackoff(cap=cap_s, base=first_s)
        self.failures = 0

    def next_s(self) -> float:
        """The delay before the next try (one more failure counted)."""
        delay = float(self._policy.compute(self.failures))
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0
