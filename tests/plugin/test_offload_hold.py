"""A load in flight when LMCache misses its heartbeat keeps its blocks until the server answers
it or cannot any more (kvops.plugin.offload.hold).

The race it closes cannot be produced on demand: the server must freeze between taking a load
and writing it, a window of milliseconds that a SIGSTOP from outside hits only by chance (seven
`kvops bench chaos --faults none,lmcache_stop` runs here, 335 requests under the freeze, never
hit it; the issue's machine hit it once in three). So these tests drive the real pieces by hand:
LMCache's own worker adapter (its ``get_finished`` and error getters, the code that drains loads
when the heartbeat misses), LMCache's own futures, our connector's step, and the heartbeat's
event set and cleared as LMCache's heartbeat thread does. Time is passed in, not slept.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPWorkerAdapter
from lmcache.v1.multiprocess.futures import MessagingFuture

from kvops.plugin.offload import connector as connector_module
from kvops.plugin.offload.connector import KVOpsOffloadConnector
from kvops.plugin.offload.hold import Held, LoadHold
from kvops.plugin.offload.stats import OffloadStats

SETTLE_S, MAX_HOLD_S = 6.0, 60.0


def lmcache_adapter() -> Any:
    """LMCache's worker adapter without a server: only the state its get_finished reads."""
    adapter: Any = object.__new__(LMCacheMPWorkerAdapter)
    adapter.dispatcher = None
    adapter._health_event = threading.Event()
    adapter._health_event.set()
    for name in ("store_futures", "retrieve_futures", "store_events", "retrieve_events",
                 "_pending_store_kv_events"):
        setattr(adapter, name, {})
    for name in ("error_block_ids", "_failed_request_ids", "_dropped_retrieves", "finished_stores",
                 "_returned_finished", "previously_finished"):
        setattr(adapter, name, set())
    return adapter


def load(adapter: Any, request_id: str, blocks: list[int]) -> MessagingFuture[bool]:
    future = MessagingFuture[bool]()
    adapter.retrieve_futures[request_id] = (future, blocks)
    return future


class Worker:
    """Our connector's worker half around a real adapter: the hold's step, then LMCache's."""

    def __init__(self, adapter: Any, gone: bool = False) -> None:
        self.gone = gone
        self.half = SimpleNamespace(worker_adapter=adapter, _kvops_stats=OffloadStats(),
                                    _kvops_hold=LoadHold(SETTLE_S, MAX_HOLD_S, lambda: self.gone))

    def step(self, now: float, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], set[int]]:
        monkeypatch.setattr(connector_module.time, "monotonic", lambda: now)
        KVOpsOffloadConnector._kvops_hold_loads(self.half)  # type: ignore[arg-type]
        adapter = self.half.worker_adapter
        _, receiving = adapter.get_finished(set())
        return set(receiving or ()), adapter.get_block_ids_with_load_errors()


def test_without_the_hold_lmcache_frees_a_frozen_servers_loads_at_once():
    """The race itself: LMCache's adapter reports the load finished with its blocks failed, so
    vLLM frees them (no valid prefix) while the frozen server still holds the request."""
    adapter = lmcache_adapter()
    load(adapter, "a", [7, 8])
    adapter._health_event.clear()  # the heartbeat missed
    receiving = adapter.get_finished(set())[1]
    assert receiving == {"a"}
    assert adapter.get_block_ids_with_load_errors() == {7, 8}


def test_a_missed_load_keeps_its_blocks_until_the_server_answers(monkeypatch):
    adapter = lmcache_adapter()
    worker = Worker(adapter)
    future = load(adapter, "a", [7, 8])
    assert worker.step(0.0, monkeypatch) == (set(), set())
    adapter._health_event.clear()
    for now in (1.0, 10.0, 59.0):  # frozen, port still accepting: held
        assert worker.step(now, monkeypatch) == (set(), set())
    assert worker.half._kvops_stats.data["kvops_errors"] == {"held": 1}
    future.set_result(True)  # SIGCONT: the server writes the load, then answers
    adapter._health_event.set()
    assert worker.step(59.5, monkeypatch) == ({"a"}, set())  # finished as any load, no recompute


def test_an_answer_while_the_heartbeat_still_misses_is_a_failed_load(monkeypatch):
    """Once answered the server is done with the blocks: LMCache's drain may fail it safely."""
    adapter = lmcache_adapter()
    worker = Worker(adapter)
    future = load(adapter, "a", [3])
    adapter._health_event.clear()
    assert worker.step(0.0, monkeypatch) == (set(), set())
    future.set_result(True)
    assert worker.step(1.0, monkeypatch) == ({"a"}, {3})


def test_a_server_back_without_answering_never_got_the_load(monkeypatch):
    """A restarted server answers the heartbeat, never the old load: failed settle_s later,
    reported once by LMCache's own path for dropped loads."""
    adapter = lmcache_adapter()
    worker = Worker(adapter)
    load(adapter, "a", [4, 5])
    adapter._health_event.clear()
    assert worker.step(0.0, monkeypatch) == (set(), set())
    adapter._health_event.set()
    assert worker.step(1.0, monkeypatch) == (set(), set())
    assert worker.step(SETTLE_S - 0.5, monkeypatch) == (set(), set())
    assert worker.step(SETTLE_S + 0.5, monkeypatch) == ({"a"}, {4, 5})
    assert worker.step(SETTLE_S + 1.0, monkeypatch) == (set(), set())  # exactly once


def test_a_dead_server_fails_its_loads_at_once(monkeypatch):
    """A killed server's port refuses: no process is left to write the load."""
    adapter = lmcache_adapter()
    worker = Worker(adapter, gone=True)
    load(adapter, "a", [9])
    assert worker.step(0.0, monkeypatch) == (set(), set())  # heartbeat fine: never asked
    adapter._health_event.clear()
    assert worker.step(0.5, monkeypatch) == ({"a"}, {9})


@pytest.mark.parametrize(("now", "failed"), [(MAX_HOLD_S - 1, False), (MAX_HOLD_S, True)],
                         ids=["within-max-hold", "past-max-hold"])
def test_a_frozen_server_holds_its_loads_at_most_max_hold(monkeypatch, now, failed):
    adapter = lmcache_adapter()
    worker = Worker(adapter)
    load(adapter, "a", [9])
    adapter._health_event.clear()
    assert worker.step(0.0, monkeypatch) == (set(), set())
    assert worker.step(now, monkeypatch) == (({"a"}, {9}) if failed else (set(), set()))


def test_a_slow_load_while_the_heartbeat_holds_is_lmcaches_to_finish(monkeypatch):
    adapter = lmcache_adapter()
    worker = Worker(adapter)
    future = load(adapter, "a", [1])
    for now in (0.0, 100.0, 1000.0):
        assert worker.step(now, monkeypatch) == (set(), set())
    future.set_result(False)  # LMCache's own failure: its path, as without the hold
    assert worker.step(1001.0, monkeypatch) == ({"a"}, {1})


def test_an_idle_step_waits_on_a_held_load_too():
    future = MessagingFuture[bool]()
    hold = LoadHold(SETTLE_S, MAX_HOLD_S, lambda: False)
    hold.held["a"] = Held(future, [1])
    threading.Timer(0.1, future.set_result, args=(True,)).start()
    half = SimpleNamespace(_kvops_load_wait_s=30.0, _kvops_idle_step=True, _kvops_hold=hold,
                           worker_adapter=SimpleNamespace(retrieve_futures={}))
    KVOpsOffloadConnector._kvops_wait_for_a_load(half)  # type: ignore[arg-type]
    assert future.query()


def test_only_lmcache_driven_holds():
    """engine_driven copies in the worker when a load finishes: a dropped load is never copied."""
    def hold_for(mode: str) -> LoadHold | None:
        return connector_module._load_hold({"lmcache.mp.mp_transfer_mode": mode,
                                            "lmcache.mp.heartbeat_interval": 1.0}, lambda: False)
    assert hold_for("engine_driven") is None
    held = hold_for("lmcache_driven")
    assert held is not None
    assert held.settle_s == 5.0


def test_the_adapter_state_the_hold_writes_is_lmcaches():
    """What _kvops_hold_loads touches exists in the installed LMCache, so an upgrade that renames
    it fails here rather than in a frozen server's aftermath."""
    source = inspect.getsource(LMCacheMPWorkerAdapter)
    for name in ("retrieve_futures", "error_block_ids", "_failed_request_ids", "_dropped_retrieves"):
        assert f"self.{name}" in source, name
    assert isinstance(LMCacheMPWorkerAdapter.is_healthy, property)
