"""Samples the server's metrics about once a second while the test runs: its /metrics, or,
behind a load balancer, every replica's series from Prometheus (``--prometheus``).

Runs only where the verdict is computed (the local or master process), as a greenlet, so its
samples share the wall clock with the request records they are aligned with.
"""

from __future__ import annotations

import time

import gevent
from gevent import Greenlet

from kvops.core.errors import KvopsError
from kvops.core.prom import MetricsSample, scrape
from kvops.core.promql import FleetReadings, Prometheus, replica_samples


class MetricsScraper:
    """Keeps every sample; scrape failures are counted, not fatal (the server may be struggling)."""

    def __init__(self, url: str, interval_s: float = 1.0,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers
        self.interval_s = interval_s
        self.samples: list[MetricsSample] = []
        self.failures: list[str] = []
        self._greenlet: Greenlet | None = None

    def start(self) -> None:
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._loop)

    def read(self) -> MetricsSample:
        """One reading now (KvopsError when it cannot be had)."""
        return scrape(self.url, headers=self.headers)

    def sample_now(self) -> None:
        try:
            self.samples.append(self.read())
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


class PrometheusSampler(MetricsScraper):
    """The same samples for a fleet: each tick one query for every replica's series under
    ``selector``, reduced per replica (kept in ``replicas``, for evidence that names one) and
    combined into one fleet reading (kvops.core.promql.FleetReadings: a replica whose scrape
    failed, and so is missing from a query, keeps its last reading in the fleet's)."""

    def __init__(self, prometheus: str, selector: str, interval_s: float = 1.0) -> None:
        super().__init__(prometheus, interval_s=interval_s)
        self.prometheus = Prometheus(prometheus)
        self.selector = selector
        self.replicas: dict[str, list[MetricsSample]] = {}
        self.fleet = FleetReadings()

    def read(self) -> MetricsSample:
        now = time.time()
        per_replica = replica_samples(self.prometheus, self.selector, t=now)
        if not per_replica:
            raise KvopsError(f"Prometheus at {self.url} has no vLLM series matching {self.selector}")
        for instance, sample in per_replica.items():
            self.replicas.setdefault(instance, []).append(sample)
        return self.fleet.add(per_replica, t=now)
