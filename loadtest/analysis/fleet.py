"""Which replica a verdict is about, when the metrics came from Prometheus for a fleet.

The verdict itself is reached on the fleet reading (counts and counters summed over replicas, KV
usage the fullest one's: kvops.core.promql.fleet_sample), so the same rules judge one server or
several; this adds each replica's own numbers over the run and names the one in the worst state.
"""

from __future__ import annotations

from typing import Any

from kvops.core.prom import MetricsSample, delta
from kvops.core.verdict import Verdict


def replica_table(replicas: dict[str, list[MetricsSample]],
                  missed: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per replica: preemptions over the run, the largest KV usage and queue it showed; and, given
    ``missed``, how many fleet readings lacked it (its scrape failed: too busy, or gone)."""
    table: dict[str, dict[str, Any]] = {}
    for instance, samples in sorted(replicas.items()):
        if not samples:
            continue
        table[instance] = {
            "preemptions": delta(samples[0], samples[-1], "preemptions"),
            "kv_usage_max": round(max(s.get("kv_usage") for s in samples), 4),
            "waiting_max": max(s.get("waiting") for s in samples),
            "running_max": max(s.get("running") for s in samples),
        }
        if missed is not None:
            table[instance]["missed_readings"] = missed.get(instance, 0)
    return table


def worst(table: dict[str, dict[str, Any]]) -> str | None:
    """The replica that preempted most, then the fullest, then the longest queue."""
    if not table:
        return None
    return max(table, key=lambda i: (table[i]["preemptions"], table[i]["kv_usage_max"], table[i]["waiting_max"]))


def name_replicas(verdicts: list[Verdict], replicas: dict[str, list[MetricsSample]],
                  missed: dict[str, int] | None = None) -> list[Verdict]:
    """Each verdict with the replicas' numbers in its evidence; a problem also names the worst
    replica (``instance``, as Prometheus and `kvops diagnose --prometheus` call it)."""
    table = replica_table(replicas, missed)
    bad = worst(table)
    out = []
    for v in verdicts:
        named = {"instance": bad} if v.problem != "healthy" and bad is not None else {}
        out.append(Verdict(v.problem, v.cause, {**v.evidence, **named, "replicas": table}, v.next))
    return out
