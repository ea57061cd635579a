"""kvops.plugin.offload.transfer_guard: a failed engine_driven store or load is dropped the way
LMCache's adapter drops calls made while its server is unhealthy, never raised.

The live fault (SIGKILL to the LMCache server under load; before the guard vLLM's engine core
died with LMCacheTimeoutError from PREPARE_STORE) is tests/e2e/test_offload_e2e.py's
``test_lmcache_killed_while_serving_degrades_then_recovers_from_disk``. Here a stand-in adapter
with the attributes the adapter's own unhealthy branches touch (lmcache 0.5.6
``vllm_multi_process_adapter.py`` submit_store_request / submit_retrieve_request) times the
window and the lazy-offload receipt, which a live run cannot time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvops.plugin.offload.transfer_guard import TransferGuard


class Adapter:
    """The state LMCache's worker adapter keeps per request, and submits that fail on demand."""

    def __init__(self, lazy: bool = False) -> None:
        self.lazy_offload = lazy
        self.store_futures: dict[str, Any] = {}
        self.retrieve_futures: dict[str, Any] = {}
        self.error_block_ids: set[int] = set()
        self._failed_request_ids: set[str] = set()
        self._dropped_retrieves: set[str] = set()
        self._completed_store_requests: dict[str, int] = {}
        self._failed_store_requests: set[str] = set()
        self.fail: Exception | None = None
        self.calls: list[str] = []

    def submit_store_request(self, request_id: str, op: Any, event: Any = None) -> None:
        self.calls.append(f"store {request_id}")
        if self.fail:
            raise self.fail
        self.store_futures[request_id] = "future"

    def submit_retrieve_request(self, request_id: str, op: Any, event: Any = None) -> None:
        self.calls.append(f"load {request_id}")
        if self.fail:
            raise self.fail
        self.retrieve_futures[request_id] = ("future", op.flat_block_ids)

    def batched_submit_store_requests(self, request_ids: list[str], ops: list[Any], event: Any) -> None:
        for request_id, op in zip(request_ids, ops, strict=True):  # as LMCache's: self.submit_…
            self.submit_store_request(request_id, op, event)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def op(*blocks: int) -> SimpleNamespace:
    return SimpleNamespace(flat_block_ids=list(blocks))


def guarded(lazy: bool = False) -> tuple[Adapter, Clock, list[str]]:
    adapter, clock, dropped = Adapter(lazy), Clock(), []
    TransferGuard(adapter, 10.0, lambda: dropped.append("store"), clock)
    return adapter, clock, dropped


def test_healthy_calls_pass_through_unchanged():
    adapter, _clock, dropped = guarded()
    adapter.submit_store_request("a", op(1))
    adapter.submit_retrieve_request("b", op(2, 3), None)
    assert adapter.store_futures == {"a": "future"}
    assert adapter.retrieve_futures == {"b": ("future", [2, 3])}
    assert (adapter.error_block_ids, dropped) == (set(), [])


def test_a_failed_load_is_reported_failed_for_vllm_to_recompute():
    adapter, _clock, _dropped = guarded()
    adapter.fail = TimeoutError("PREPARE_RETRIEVE timed out after 10.0s")
    adapter.submit_retrieve_request("r", op(4, 5))
    assert adapter.error_block_ids == {4, 5}
    assert "r" in adapter._failed_request_ids
    assert "r" in adapter._dropped_retrieves
    assert "r" not in adapter.retrieve_futures


@pytest.mark.parametrize("lazy", [False, True])
def test_a_failed_store_is_dropped_with_a_receipt_where_lazy_offload_waits_for_one(lazy):
    adapter, _clock, dropped = guarded(lazy)
    adapter.fail = RuntimeError("zmq: Resource temporarily unavailable")
    adapter.batched_submit_store_requests(["s1", "s2"], [op(1), op(2)], None)
    assert dropped == ["store", "store"]
    assert adapter.store_futures == {}
    assert adapter._completed_store_requests == ({"s1": 1, "s2": 1} if lazy else {})
    assert adapter._failed_store_requests == ({"s1", "s2"} if lazy else set())


def test_after_a_failure_calls_are_dropped_without_trying_for_the_window_then_tried_again():
    adapter, clock, dropped = guarded()
    adapter.fail = TimeoutError("PREPARE_STORE timed out")
    adapter.submit_store_request("s1", op(1))
    adapter.fail = None
    clock.now += 9.9
    adapter.submit_store_request("s2", op(2))
    adapter.submit_retrieve_request("r", op(7))
    assert adapter.calls == ["store s1"]  # one stalled call, not one per request
    assert (dropped, adapter.error_block_ids) == (["store", "store"], {7})
    clock.now += 0.2
    adapter.submit_store_request("s3", op(3))
    assert adapter.calls == ["store s1", "store s3"]
    assert adapter.store_futures == {"s3": "future"}


def test_the_server_coming_back_ends_the_window_at_once():
    adapter, clock, _dropped = Adapter(), Clock(), []
    guard = TransferGuard(adapter, 10.0, lambda: None, clock)
    adapter.fail = TimeoutError("PREPARE_STORE timed out")
    adapter.submit_store_request("s1", op(1))
    adapter.fail = None
    guard.server_back()
    adapter.submit_retrieve_request("r", op(7))
    assert adapter.calls == ["store s1", "load r"]
    assert adapter.retrieve_futures == {"r": ("future", [7])}


def test_the_wait_inside_the_step_is_bounded_on_each_context_lmcache_builds():
    """LMCache's engine-driven context waits mq_timeout (timeout_s) for each in-step reply; a
    re-registration builds a new one with the long timeout again."""
    adapter, _clock, _dropped = guarded()
    adapter.transfer_ctx = SimpleNamespace(_engine_driven_context=SimpleNamespace(mq_timeout=10.0))
    adapter.submit_store_request("s", op(1))
    assert adapter.transfer_ctx._engine_driven_context.mq_timeout == 2.0
    adapter.transfer_ctx = SimpleNamespace(_engine_driven_context=SimpleNamespace(mq_timeout=10.0))
    adapter.submit_retrieve_request("r", op(2))
    assert adapter.transfer_ctx._engine_driven_context.mq_timeout == 2.0
    short = Adapter()
    TransferGuard(short, 0.5, lambda: None)
    short.transfer_ctx = SimpleNamespace(_engine_driven_context=SimpleNamespace(mq_timeout=0.5))
    short.submit_store_request("s", op(1))
    assert short.transfer_ctx._engine_driven_context.mq_timeout == 0.5  # timeout_s below the bound
