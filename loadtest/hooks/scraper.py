"""Samples the server's /metrics about once a second while the test runs.

Runs only where the verdict is computed (the local or master process), as a greenlet, so its
samples share the wall clock with the request records they are aligned with.
"""

from __future__ import annotations

import time

import gevent
from gevent import Greenlet

from kvops.loadtest.metrics import MetricsSample, scrape
from kvops.ops.errors import KvopsError


class MetricsScraper:
    """Keeps every sample; scrape failures are counted, not fatal (the server may be struggling)."""

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[MetricsSample] = []
        self.failures: list[str] = []
        self._greenlet: Greenlet | None = None

    def start(self) -> None:
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._loop)

    def sample_now(self) -> None:
        try:
            self.samples.append(scrape(self.url))
        except KvopsError as exc:
            self.failures.append(str(exc))

    def stop(self, settle_s: float = 1.0) -> None:
        """Stop sampling; one last sample after ``settle_s`` so counters include the tail."""
        if self._greenlet is not None:
            self._greenlet.kill(block=True)
            self._greenlet = None
        gevent.sleep(settle_s)
        self.sample_now()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while True:
            self.sample_now()
            next_at += self.interval_s
            gevent.sleep(max(0.0, next_at - time.monotonic()))
