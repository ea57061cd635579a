"""Where a Locust process keeps our per-request records, and how workers ship them to the master.

Workers attach unsent records to every stats report (``report_to_master``, every 3 s); the master
appends what arrives (``worker_report``). At the end the master drains its workers before Locust
stops them: each stops its users (the requests in flight are recorded as stopped, as in one
process) and sends the rest of its records, and the master waits for every answer. Locust's own
end is not enough: a headless master sends "quit" and exits 0.5 s later (locust/runners.py
``MasterRunner.quit``), so a worker slower than that to send its final report (a busy machine)
lost every record since its last report. So the master ends with every worker's records, not
only Locust's rounded stats.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import gevent
from locust.env import Environment
from locust.rpc import Message
from locust.runners import STATE_MISSING, STATE_RUNNING, STATE_SPAWNING, MasterRunner, WorkerRunner

from kvops.loadtest.records import RequestRecord

REPORT_KEY = "kvops_records"
OVERDUE_KEY = "kvops_overdue"
DRAIN, DRAINED = "kvops_drain", "kvops_drained"
DRAIN_GRACE_S = 60.0
"""The master waits at most --stop-timeout plus this for its workers' last records: Locust's own
bound on waiting for workers to stop (``MasterRunner.stop``). A worker that died is given up on
sooner, when Locust's heartbeat marks it missing (~4 s of silence)."""


@dataclass
class RecordStore:
    """The records of this process (and, on the master, those of its workers)."""

    scenario: str = ""
    worker: str = "local"
    records: list[RequestRecord] = field(default_factory=list)
    _unsent: int = 0
    reports_from: set[str] = field(default_factory=set)
    drained: set[str] = field(default_factory=set)
    """Workers that sent their last records at this run's end."""
    overdue_s: list[float] = field(default_factory=list)
    """Lateness at the stop of the arrivals that came due and were never sent (every user was
    waiting on a response); on the master, its workers' too (shapes/poisson.py ``overdue``)."""
    overdue_count: int = 0
    """How many there were (``overdue_s`` keeps at most OVERDUE_LIMIT per process)."""

    def note_overdue(self, lateness_s: list[float], count: int) -> None:
        self.overdue_s.extend(lateness_s)
        self.overdue_count += count

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        """A new run: in place, so a progress printer holding the list sees the new records."""
        self.records.clear()
        self._unsent = 0
        self.reports_from.clear()
        self.drained.clear()
        self.overdue_s.clear()
        self.overdue_count = 0

    def take_unsent(self) -> list[dict[str, Any]]:
        batch = [r.to_dict() for r in self.records[self._unsent:]]
        self._unsent = len(self.records)
        return batch


def store_of(environment: Environment) -> RecordStore:
    """The environment's store (one per Locust process), created on first use."""
    store = getattr(environment, "kvops_store", None)
    if store is None:
        store = RecordStore()
        environment.kvops_store = store  # type: ignore[attr-defined]
    return store


def install_merging(environment: Environment) -> None:
    """Wire worker → master record shipping for distributed runs (no-op when local)."""
    store = store_of(environment)
    runner = environment.runner

    def on_report_to_master(client_id: str, data: dict[str, Any]) -> None:
        data[REPORT_KEY] = store.take_unsent()

    def on_worker_report(client_id: str, data: dict[str, Any]) -> None:
        rows = data.get(REPORT_KEY) or []
        store.reports_from.add(client_id)
        store.records.extend(RequestRecord.from_dict(r) for r in rows)

    if isinstance(runner, WorkerRunner):
        store.worker = f"worker-{runner.client_id}"
        environment.events.report_to_master.add_listener(on_report_to_master)  # type: ignore[no-untyped-call]

        def on_drain(msg: Message, **_: Any) -> None:
            # kills the users at once (--stop-timeout 0): cut-off requests are recorded, and
            # test_stopping notes the arrivals never sent (scenarios/glue.py)
            runner.stop()
            runner.send_message(DRAINED, {REPORT_KEY: store.take_unsent(),
                                          OVERDUE_KEY: [store.overdue_s, store.overdue_count]})

        runner.register_message(DRAIN, on_drain)
    elif isinstance(runner, MasterRunner):
        environment.events.worker_report.add_listener(on_worker_report)  # type: ignore[no-untyped-call]

        def on_drained(msg: Message, **_: Any) -> None:
            on_worker_report(msg.node_id, msg.data)
            late, count = msg.data.get(OVERDUE_KEY) or ([], 0)
            store.note_overdue(list(late), int(count))
            store.drained.add(msg.node_id)

        runner.register_message(DRAINED, on_drained)
        environment.events.test_stopping.add_listener(  # type: ignore[no-untyped-call]
            lambda **_: _warn_missing(drain(runner, store)))


def drain(runner: MasterRunner, store: RecordStore) -> list[str]:
    """Ask every worker with users to stop them and send its last records, and wait (yielding to
    the master's message loop) until each has, has left, or is missing by Locust's heartbeat;
    at most --stop-timeout + DRAIN_GRACE_S. Returns the workers that never answered. Runs in
    ``test_stopping``: on the master that comes before Locust's "quit" or "stop" to the workers,
    headless or not. (When Locust stops because its last worker quit, it does so inside its
    message loop, where no answer could arrive: then no worker has users and none is asked.)"""
    asked = {c.id for c in runner.clients.all if c.state in (STATE_RUNNING, STATE_SPAWNING)}
    for client_id in asked:
        runner.send_message(DRAIN, None, client_id)
    deadline = time.monotonic() + float(runner.environment.stop_timeout or 0.0) + DRAIN_GRACE_S
    while True:
        alive = {c.id for c in runner.clients.all if c.state != STATE_MISSING}
        pending = sorted((asked & alive) - store.drained)
        if not pending or time.monotonic() > deadline:
            return pending + sorted(asked - alive - store.drained)
        gevent.sleep(0.05)


def _warn_missing(workers: list[str]) -> None:
    if workers:
        sys.stderr.write(f"kvops: {len(workers)} worker(s) did not send their last records "
                         f"({', '.join(workers)}): the requests they sent since their last report "
                         "(every 3 s) are missing from the result\n")
