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

DRAIN_S = 10.0
"""How long sampling goes on after the run while the server runs or queues more requests than
before it."""


def in_flight(sample: MetricsSample) -> float:
    """Requests the server ran or queued at this reading."""
    return sample.get("running") + sample.get("waiting")


class MetricsScraper:
    """Keeps every sample; scrape failures are counted, not fatal (the server may be struggling)."""

    def __init__(self, url: str, interval_s: float = 1.0,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers
        self.interval_s = interval_s
        self.samples: list[MetricsSample] = []
        self.failures: list[str] = []
        self.replicas: dict[str, list[MetricsSample]] | None = None
        """Each replica's own readings, for a fleet read through Prometheus (None: one server)."""
        self.missed: dict[str, int] | None = None
        """Readings each replica was missing from (a fleet's; None: one server)."""
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

    def stop(self, settle_s: float = 1.0, drain_s: float | None = None) -> None:
        """Stop sampling; one last sample after ``settle_s`` so counters include the tail, and
        more while the server runs or queues more requests than at the first reading (others'
        traffic), for up to ``drain_s`` (DRAIN_S): a request the run abandoned at its end may
        still be scheduled (its prefix queries, its preemptions counted) before vLLM sees the
        client gone, and the counters the verdict reads must include it."""
        if self._greenlet is not None:
            self._greenlet.kill(block=True)
            self._greenlet = None
        gevent.sleep(settle_s)
        self.sample_now()
        deadline = time.monotonic() + (DRAIN_S if drain_s is None else drain_s)
        while (self.samples and in_flight(self.samples[-1]) > in_flight(self.samples[0])
               and time.monotonic() < deadline):
            gevent.sleep(self.interval_s)
            self.sample_now()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while True:
            self.sample_now()
            next_at += self.interval_s
            gevent.sleep(max(0.0, next_at - time.monotonic()))


CATCH_UP_S = 15.0
"""How long a fleet's sampling goes on after the run for replicas missing from its last reading."""


class PrometheusSampler(MetricsScraper):
    """The same samples for a fleet: each tick one query for every replica's series under
    ``selector``, reduced per replica (kept in ``replicas``, for evidence that names one) and
    combined into one fleet reading (kvops.core.promql.FleetReadings: a replica whose scrape
    failed, and so is missing from a query, keeps its last reading in the fleet's)."""

    def __init__(self, prometheus: str, selector: str, interval_s: float = 1.0) -> None:
        super().__init__(prometheus, interval_s=interval_s)
        self.prometheus = Prometheus(prometheus)
        self.selector = selector
        self.fleet = FleetReadings()
        self._per_replica: dict[str, list[MetricsSample]] = {}
        self.replicas, self.missed = self._per_replica, self.fleet.missed

    def stop(self, settle_s: float = 1.0, drain_s: float | None = None) -> None:
        """Stop as MetricsScraper does, then read on while a replica is missing from the last
        reading, for up to CATCH_UP_S: one whose scrapes failed over the run's end (too busy to
        answer, as a KV-bound replica is) has counted preemptions that only its next reading
        brings (kvops.loadtest.analysis.kv._counter_edge). A replica gone for good costs the wait."""
        super().stop(settle_s, drain_s)
        deadline = time.monotonic() + CATCH_UP_S
        while self.samples and self.samples[-1].unread and time.monotonic() < deadline:
            gevent.sleep(self.interval_s)
            self.sample_now()

    def read(self) -> MetricsSample:
        now = time.time()
        per_replica = replica_samples(self.prometheus, self.selector, t=now)
        if not per_replica:
            raise KvopsError(f"Prometheus at {self.url} has no vLLM series matching {self.selector}")
        for instance, sample in per_replica.items():
            self._per_replica.setdefault(instance, []).append(sample)
        return self.fleet.add(per_replica, t=now)
