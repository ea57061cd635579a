"""Arrivals from a request trace: each request at its own (sped-up) time, served by a pool.

Like the Poisson schedule, users claim the next arrival and sleep until it, so the trace's
timing holds whatever the server does while a user is free; a late send is recorded. In a
distributed run each process takes every N-th request (its index among N processes).
"""

from __future__ import annotations

import time
from collections import deque

from kvops.core.trace.replay import ReplayRequest


class TraceSchedule:
    def __init__(self, requests: list[ReplayRequest], start: float | None = None) -> None:
        self._pending = deque(requests)
        self.start = time.time() if start is None else start
        self.in_flight = 0

    def claim(self) -> tuple[ReplayRequest, float] | None:
        """The next request and its send time (epoch s), None when the trace is used up."""
        if not self._pending:
            return None
        request = self._pending.popleft()
        self.in_flight += 1
        return request, self.start + request.send_at_s

    def finished(self) -> None:
        self.in_flight -= 1

    @property
    def done(self) -> bool:
        return not self._pending and self.in_flight == 0
