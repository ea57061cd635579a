"""Where a Locust process keeps our per-request records, and how workers ship them to the master.

Workers attach unsent records to every stats report (``report_to_master``, every 3 s and once
more when told to quit, locust/runners.py ``WorkerRunner`` "quit"); the master appends what
arrives (``worker_report``). So the master ends with every worker's records, not only Locust's
rounded stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from kvops.loadtest.records import RequestRecord

REPORT_KEY = "kvops_records"


@dataclass
class RecordStore:
    """The records of this process (and, on the master, those of its workers)."""

    scenario: str = ""
    worker: str = "local"
    records: list[RequestRecord] = field(default_factory=list)
    _unsent: int = 0
    reports_from: set[str] = field(default_factory=set)

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)

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

    def on_report_to_master(client_id: str, data: dict[str, Any]) -> None:
        data[REPORT_KEY] = store.take_unsent()

    def on_worker_report(client_id: str, data: dict[str, Any]) -> None:
        rows = data.get(REPORT_KEY) or []
        store.reports_from.add(client_id)
        store.records.extend(RequestRecord.from_dict(r) for r in rows)

    if isinstance(environment.runner, WorkerRunner):
        store.worker = f"worker-{environment.runner.client_id}"
        environment.events.report_to_master.add_listener(on_report_to_master)  # type: ignore[no-untyped-call]
    elif isinstance(environment.runner, MasterRunner):
        environment.events.worker_report.add_listener(on_worker_report)  # type: ignore[no-untyped-call]
