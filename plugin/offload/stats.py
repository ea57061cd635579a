"""Connector stats: what the scheduler and worker halves of the connector saw in one step.

vLLM carries a connector's stats from the worker (KVConnectorOutput) and the scheduler
(``get_kv_connector_stats``, vllm/v1/core/sched/scheduler.py:2336-2351) to the front end, where
``build_kv_connector_stats`` rebuilds them and ``build_prom_metrics`` records them
(vllm/distributed/kv_transfer/kv_connector/v1/metrics.py). We extend LMCache's stats object, so
its lookup-latency histogram keeps working, with our counters under ``kvops_*`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.integration.vllm.lmcache_mp_metrics import LMCacheMPConnectorStats

COUNTERS = (
    "kvops_lookups", "kvops_lookup_tokens", "kvops_hit_tokens",
    "kvops_stored_tokens", "kvops_loaded_tokens", "kvops_stored_bytes", "kvops_loaded_bytes",
    "kvops_unverified_blocks",
)
SERIES = ("kvops_store_seconds", "kvops_load_seconds")
ERRORS = "kvops_errors"
DEGRADED = "kvops_degraded"


@dataclass
class OffloadStats(LMCacheMPConnectorStats):
    """LMCache's lookup latencies plus kvops counters; every field sums, degraded takes the max."""

    def add(self, key: str, amount: float) -> None:
        self.data[key] = self.data.get(key, 0) + amount

    def observe(self, key: str, seconds: float) -> None:
        self.data.setdefault(key, []).append(seconds)

    def error(self, kind: str, count: int = 1) -> None:
        errors = self.data.setdefault(ERRORS, {})
        errors[kind] = errors.get(kind, 0) + count

    def set_degraded(self, degraded: bool) -> None:
        self.data[DEGRADED] = max(int(degraded), int(self.data.get(DEGRADED, 0)))

    def clone_and_reset(self) -> OffloadStats:
        snapshot = OffloadStats(data=self.data)
        self.reset()
        return snapshot

    def aggregate(self, other: Any) -> OffloadStats:
        if not isinstance(other, LMCacheMPConnectorStats):
            raise TypeError(f"Cannot aggregate {type(other)}")
        for key, value in other.data.items():
            if key == DEGRADED:
                self.set_degraded(bool(value))
            elif key == ERRORS:
                for kind, count in value.items():
                    self.error(kind, count)
            elif isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary = super().reduce()
        for key in COUNTERS:
            if self.data.get(key):
                summary[key] = self.data[key]
        if self.data.get(ERRORS):
            summary[ERRORS] = sum(self.data[ERRORS].values())
        if DEGRADED in self.data:
            summary[DEGRADED] = self.data[DEGRADED]
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in self.data if key != DEGRADED) and (
            DEGRADED not in self.data
        )
