"""The worker sleeps on a load LMCache has in flight only in a step that computes nothing, wakes
when LMCache completes it, and never sleeps past load_wait_ms. The futures are LMCache's own
(``lmcache.v1.multiprocess.futures.MessagingFuture``), completed from another thread as its
receiver thread completes them; what the sleep buys is measured by ``kvops bench offload``
(tuning row ``load_wait_ms=0``), not here."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from lmcache.v1.multiprocess.futures import MessagingFuture

from kvops.core.offload.settings import OffloadSettings
from kvops.plugin.offload.connector import KVOpsOffloadConnector


def _half(wait_s: float, idle: bool, *futures: MessagingFuture) -> SimpleNamespace:
    in_flight = {f"req-{i}": (future, [i]) for i, future in enumerate(futures)}
    return SimpleNamespace(_kvops_load_wait_s=wait_s, _kvops_idle_step=idle, _kvops_hold=None,
                           worker_adapter=SimpleNamespace(retrieve_futures=in_flight))


def _wait(half: SimpleNamespace) -> float:
    started = time.monotonic()
    KVOpsOffloadConnector._kvops_wait_for_a_load(half)  # type: ignore[arg-type]
    return time.monotonic() - started


def test_an_idle_step_wakes_when_lmcache_completes_the_oldest_load():
    oldest, newer = MessagingFuture[bool](), MessagingFuture[bool]()
    timer = threading.Timer(0.2, oldest.set_result, args=(True,))
    timer.start()
    try:
        slept = _wait(_half(60.0, True, oldest, newer))
    finally:
        timer.cancel()
    assert oldest.query()
    assert not newer.query()
    assert 0.1 <= slept < 30.0  # woke on completion, far before the 60 s cap


def test_an_idle_step_sleeps_at_most_load_wait_ms_on_a_load_that_does_not_end():
    half = _half(0.15, True, MessagingFuture[bool]())
    assert _wait(half) >= 0.15
    assert half._kvops_idle_step is False  # the next step decides afresh


@pytest.mark.parametrize(("wait_s", "idle"), [(60.0, False), (0.0, True)],
                         ids=["step-with-a-forward", "load_wait_ms-0"])
def test_no_sleep_in_a_step_that_computes_or_with_the_wait_off(wait_s, idle):
    assert _wait(_half(wait_s, idle, MessagingFuture[bool]())) < 30.0


def test_no_loads_in_flight_no_sleep():
    assert _wait(_half(60.0, True)) < 30.0
    no_adapter = SimpleNamespace(_kvops_load_wait_s=60.0, _kvops_idle_step=True, _kvops_hold=None)
    assert _wait(no_adapter) < 30.0  # the scheduler half has no worker adapter


@pytest.mark.parametrize("bad", [-1.0, 1001.0])
def test_load_wait_ms_outside_0_to_1000_is_refused(bad):
    with pytest.raises(ValueError, match="load_wait_ms"):
        OffloadSettings(load_wait_ms=bad)
