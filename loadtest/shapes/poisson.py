"""Open-loop Poisson arrivals served by a pool of Locust users, with send lateness.

Locust users are closed loops; an exponential think time approximates Poisson only while
requests are much shorter than the think time (research/loadgen_bench.md, trap 11). Here every
user claims the next arrival of one shared schedule and sleeps until it, so arrivals follow the
schedule whatever the server does, as long as a user is free; when none is, the request goes
out late and its lateness is recorded, so a late generator is visible, never silent.
"""

from __future__ import annotations

import random
import time


class ArrivalSchedule:
    """Exponential inter-arrival gaps at ``rate_rps`` from ``start`` (epoch seconds)."""

    def __init__(self, rate_rps: float, seed: int, start: float | None = None) -> None:
        self.rate_rps = rate_rps
        self._rng = random.Random(seed)
        self._next_at = time.time() if start is None else start

    def claim(self) -> float:
        self._next_at += self._rng.expovariate(self.rate_rps)
        return self._next_at
