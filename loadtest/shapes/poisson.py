"""Open-loop Poisson arrivals served by a pool of Locust users, with send lateness.

Locust users are closed loops; an exponential think time approximates Poisson only while
requests are much shorter than the think time (research/loadgen_bench.md, trap 11). Here every
user claims the next arrival of one shared schedule and sleeps until it, so arrivals follow the
schedule whatever the server does, as long as a user is free; when none is, the request goes
out late and its lateness is recorded, so a late generator is visible, never silent. Arrivals
whose time came while every user was still waiting, and that were never sent before the run
ended, are late too: ``overdue`` gives their lateness at the stop (a lower bound, as a TTFT cut
off at the stop is), else a pool stuck on a slow server would look punctual (CI: 67 sent of
~190 due at 16x, all 64 users waiting, and no late send at all).
"""

from __future__ import annotations

import random
import time

OVERDUE_LIMIT = 10_000
"""Overdue arrivals whose lateness a run keeps (a stuck pool at a high rate could owe millions;
those kept are the earliest due, the most late, and the count says how many there were)."""


class ArrivalSchedule:
    """Exponential inter-arrival gaps at ``rate_rps`` from ``start`` (epoch seconds)."""

    def __init__(self, rate_rps: float, seed: int, start: float | None = None) -> None:
        self.rate_rps = rate_rps
        self._rng = random.Random(seed)
        self._next_at = time.time() if start is None else start

    def claim(self) -> float:
        self._next_at += self._rng.expovariate(self.rate_rps)
        return self._next_at

    def overdue(self, now: float, limit: int = OVERDUE_LIMIT) -> tuple[list[float], int]:
        """The lateness at ``now`` of the arrivals due by then that no user claimed, the most
        late first (at most ``limit`` of them), and how many there were; the schedule itself
        is left as it is."""
        rng = random.Random()
        rng.setstate(self._rng.getstate())
        late: list[float] = []
        count, at = 0, self._next_at + rng.expovariate(self.rate_rps)
        while at <= now:
            count += 1
            if len(late) < limit:
                late.append(now - at)
            at += rng.expovariate(self.rate_rps)
        return late, count
