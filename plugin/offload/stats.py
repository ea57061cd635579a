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
INTERNAL = "kvops_internal_errors"
DEGRADED = "kvops_degraded"
DIGEST_DEGRADED = "kvops_digest_degraded"
WORKER_COPY = "kvops_worker_copy"
"""1: the engine_driven worker copies with kvops' per-block copy, 0: with LMCache's; reported once,
by the worker that chose (absent in lmcache_driven, where the LMCache server copies)."""
FLAGS = (DEGRADED, DIGEST_DEGRADED, WORKER_COPY)
"""0/1 states: merged by max (either half degraded -> degraded), kept even when 0."""
BY_KIND = (ERRORS, INTERNAL)


@dataclass
class OffloadStats(LMCacheMPConnectorStats):
    """LMCache's lookup latencies plus kvops counters; every field sums, degraded takes the max."""

    def add(self, key: str, amount: float) -> None:
        self.data[key] = self.data.get(key, 0) + amount

    def observe(self, key: str, seconds: float) -> None:
        self.data.setdefault(key, []).append(seconds)

    def error(self, kind: str, count: int = 1, key: str = ERRORS) -> None:
        errors = self.data.setdefault(key, {})
        errors[kind] = errors.get(kind, 0) + count

    def internal_error(self, component: str) -> None:
        self.error(component, 1, INTERNAL)

    def set_degraded(self, degraded: bool, key: str = DEGRADED) -> None:
        self.data[key] = max(int(degraded), int(self.data.get(key, 0)))

    def set_digest_degraded(self, degraded: bool) -> None:
        self.set_degraded(degraded, DIGEST_DEGRADED)

    def set_worker_copy(self, kvops: bool) -> None:
        self.set_degraded(kvops, WORKER_COPY)

    def clone_and_reset(self) -> OffloadStats:
        snapshot = OffloadStats(data=self.data)
        self.reset()
        return snapshot

    def aggregate(self, other: Any) -> OffloadStats:
        if not isinstance(other, LMCacheMPConnectorStats):
            raise TypeError(f"Cannot aggregate {type(other)}")
        for key, value in other.data.items():
            if key in FLAGS:
                self.set_degraded(bool(value), key)
            elif key in BY_KIND:
                for kind, count in value.items():
                    self.error(kind, count, key)
            elif isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = super().reduce()
        for key in COUNTERS:
            if self.data.get(key):
                summary[key] = self.data[key]
        for key in BY_KIND:
            if self.data.get(key):
                summary[key] = sum(self.data[key].values())
        for key in FLAGS:
            if key in self.data:
                summary[key] = self.data[key]
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in self.data if key not in FLAGS) and not any(
            key in self.data for key in FLAGS
        )
