"""Connector stats merge as vLLM merges them (worker + scheduler, every step), and the KV bytes
per token the connector reports follow the KV formula for vLLM's CPU cache layout."""

from __future__ import annotations

import pytest
import torch

from kvops.plugin.offload.stats import OffloadStats


def test_stats_sum_counters_extend_series_and_keep_the_worst_health():
    worker = OffloadStats()
    worker.add("kvops_loaded_bytes", 100)
    worker.observe("kvops_load_seconds", 0.5)
    worker.error("corrupt", 2)
    scheduler = OffloadStats()
    scheduler.add("kvops_lookups", 1)
    scheduler.set_degraded(True)
    scheduler.error("corrupt", 1)
    later = OffloadStats()
    later.set_degraded(False)
    merged = worker.aggregate(scheduler).aggregate(later)
    assert merged.data["kvops_loaded_bytes"] == 100
    assert merged.data["kvops_load_seconds"] == [0.5]
    assert merged.data["kvops_errors"] == {"corrupt": 3}
    assert merged.data["kvops_degraded"] == 1
    assert merged.reduce()["kvops_errors"] == 3


def test_empty_unless_something_was_seen_or_health_reported():
    assert OffloadStats().is_empty()
    healthy = OffloadStats()
    healthy.set_degraded(False)
    assert not healthy.is_empty()  # health is reported every step, even when idle
    snapshot = healthy.clone_and_reset()
    assert healthy.is_empty()
    assert snapshot.data["kvops_degraded"] == 0


def test_kv_bytes_per_token_matches_the_formula_for_the_cpu_layout():
    from kvops.plugin.offload.connector import kv_bytes_per_token

    layers, heads, head_dim, block, blocks = 4, 2, 64, 128, 5
    caches = {f"l{i}": torch.zeros(blocks, heads, block, 2 * head_dim, dtype=torch.bfloat16)
              for i in range(layers)}
    assert kv_bytes_per_token(caches, block) == 2 * layers * heads * head_dim * 2


def test_digest_health_and_internal_errors_merge_like_the_other_fields():
    worker = OffloadStats()
    worker.set_digest_degraded(True)
    worker.internal_error("offload_digest_store")
    scheduler = OffloadStats()
    scheduler.set_digest_degraded(False)
    scheduler.internal_error("offload_digest_store")
    merged = worker.aggregate(scheduler)
    assert merged.data["kvops_digest_degraded"] == 1
    assert merged.data["kvops_internal_errors"] == {"offload_digest_store": 2}
    assert merged.reduce()["kvops_internal_errors"] == 2
    healthy = OffloadStats()
    healthy.set_digest_degraded(False)
    assert not healthy.is_empty()


def test_only_loads_that_finished_without_a_failed_block_are_checksummed():
    """A load LMCache reports failed holds stale bytes: checking it would log a false 'corrupt'
    (failures may come in an earlier step than the finish, so they are remembered meanwhile)."""
    from types import SimpleNamespace

    from kvops.plugin.offload.connector import KVOpsOffloadConnector

    verified: list[str] = []
    meta = {name: SimpleNamespace(request_id=name, op=SimpleNamespace(block_ids=[blocks]))
            for name, blocks in (("ok", [1, 2]), ("failed", [3, 4]), ("later", [5, 6]))}
    half = SimpleNamespace(_kvops_failed_blocks=set(), _kvops_to_verify=[meta["ok"], meta["failed"]],
                           _kvops_loads={"later": (0.0, 0, meta["later"])},
                           _kvops_verify=lambda m: verified.append(m.request_id),
                           _kvops_canary_report=lambda m, kind: None)
    KVOpsOffloadConnector._kvops_verify_finished(half, {4, 6})  # type: ignore[arg-type]
    assert verified == ["ok"]
    assert half._kvops_failed_blocks == {4, 6}  # "later" is still loading: its failure counts
    half._kvops_loads, half._kvops_to_verify = {}, [meta["later"]]
    KVOpsOffloadConnector._kvops_verify_finished(half, set())  # type: ignore[arg-type]
    assert verified == ["ok"]
    assert half._kvops_failed_blocks == set()


@pytest.mark.parametrize(("l1_gib", "disk_gib", "expected_gib"), [(0.25, 2.0, 2.0), (4.0, None, 4.0), (4.0, 1.0, 4.0)])
def test_offload_capacity_is_the_larger_tier_not_their_sum(l1_gib, disk_gib, expected_gib):
    """LMCache's disk tier is inclusive of L1 (every chunk is written to it): the tiers together
    hold as much as the larger one."""
    from kvops.plugin import metrics
    from kvops.plugin.offload.prom import publish_capacity

    metrics.reset_for_tests()
    try:
        publish_capacity({"l1_gib": l1_gib, "disk_gib": disk_gib})
        value = metrics._registry().get_sample_value(
            "kvops_offload_capacity_bytes", {"model_name": metrics.bound_model_name()})
        assert value == expected_gib * (1 << 30)
    finally:
        metrics.reset_for_tests()


def test_the_worker_copy_is_reported_once_by_the_worker_that_chose_it():
    worker = OffloadStats()
    worker.set_worker_copy(True)
    merged = OffloadStats().aggregate(worker.clone_and_reset())
    assert merged.reduce()["kvops_worker_copy"] == 1
    assert worker.is_empty()  # sent with the first report, not every step
    lmcache_copy = OffloadStats()
    lmcache_copy.set_worker_copy(False)
    assert not lmcache_copy.is_empty()
    assert lmcache_copy.reduce()["kvops_worker_copy"] == 0
    assert "kvops_worker_copy" not in OffloadStats().reduce()  # lmcache_driven: never set
