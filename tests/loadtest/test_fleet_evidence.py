"""A load test's verdict on a fleet names the replica in the worst state and carries each
replica's own numbers (kvops.loadtest.analysis.fleet)."""

from __future__ import annotations

from kvops.core.prom import MetricsSample
from kvops.core.verdict import Verdict, healthy
from kvops.loadtest.analysis.fleet import name_replicas, replica_table


def _run(preempted: float, usage: float, waiting: float) -> list[MetricsSample]:
    return [MetricsSample(0.0, {"preemptions": 10.0, "kv_usage": 0.1, "waiting": 0.0, "running": 1.0}),
            MetricsSample(5.0, {"preemptions": 10.0 + preempted, "kv_usage": usage, "waiting": waiting,
                                "running": 3.0})]


def test_the_replica_that_preempted_is_named() -> None:
    replicas = {"a:1": _run(0, 1.0, 4), "b:1": _run(3, 0.9, 1)}
    [v] = name_replicas([Verdict("kv-exhaustion", "kv-capacity", {"users": 8}, "x")], replicas)
    assert v.evidence["instance"] == "b:1"  # preempted 3, though a:1 was fuller
    assert v.evidence["users"] == 8
    assert v.evidence["replicas"]["a:1"] == {"preemptions": 0.0, "kv_usage_max": 1.0,
                                             "waiting_max": 4.0, "running_max": 3.0}


def test_without_preemptions_the_fullest_is_named_and_healthy_names_none() -> None:
    replicas = {"a:1": _run(0, 0.5, 0), "b:1": _run(0, 0.97, 2)}
    assert name_replicas([Verdict("kv-exhaustion", "failing", {}, "")], replicas)[0].evidence["instance"] == "b:1"
    [ok] = name_replicas([healthy()], replicas)
    assert "instance" not in ok.evidence
    assert set(ok.evidence["replicas"]) == {"a:1", "b:1"}
    assert replica_table({"gone:1": []}) == {}
