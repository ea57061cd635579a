"""Loads the LMCache server may still write after LMCache's adapter gave up on them.

In lmcache_driven mode the server writes a load straight into vLLM's KV cache, whenever it gets
to it (lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py ``retrieve``: no check of the
request's age). When the adapter's heartbeat misses — a server frozen (SIGSTOP, a stalled host)
or only slow under load — its ``get_finished`` drains every load in flight as failed
(lmcache/integration/vllm/vllm_multi_process_adapter.py, the ``not self.is_healthy`` branch), and
vLLM frees the blocks of a load with no valid prefix at once (vllm/v1/core/sched/scheduler.py
``_update_waiting_for_remote_kv``: "No valid computed tokens, release allocated blocks") for the
next requests to fill. The server, once it runs again, writes the old load into blocks that now
hold another request's KV: a wrong answer that no checksum sees (those blocks were computed, not
loaded). This is the intermittent ``lmcache_stop`` wrong output of ``kvops bench chaos``.

``LoadHold`` keeps every load in flight out of the adapter's hands until the server has answered
it; a load the heartbeat missed keeps its request waiting for the remote KV (so its blocks stay
its own) until the server answers, or until it cannot any more: its process is gone (the port
refuses), or it has answered the heartbeat again for ``settle_s`` without answering the load
(a restarted server never got it). ``max_hold_s`` bounds the wait on a server that never comes
back; past it the load fails as LMCache would have failed it, and the residual risk (a server
frozen longer than that, then resumed) is the one left, said where it happens.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

InFlight = MutableMapping[str, tuple[Any, Any]]
"""The adapter's ``retrieve_futures``: request id -> (future, flat block ids)."""


@dataclass
class Held:
    future: Any
    block_ids: Any
    missed_at: float | None = None
    """When the heartbeat was first seen missing while this load was in flight."""


@dataclass(frozen=True)
class Released:
    answered: dict[str, tuple[Any, Any]]
    """Loads the server has answered: back to the adapter, which finishes them as usual."""
    failed: dict[str, Any]
    """Missed loads the server can no longer answer: request id -> block ids, to fail."""
    reasons: dict[str, str]


class LoadHold:
    def __init__(self, settle_s: float, max_hold_s: float, server_gone: Callable[[], bool]) -> None:
        self.settle_s = settle_s
        self.max_hold_s = max_hold_s
        self._server_gone = server_gone
        self.held: dict[str, Held] = {}
        self._last_missed: float | None = None

    def step(self, in_flight: InFlight, healthy: bool, now: float) -> Released:
        """Take the adapter's loads in flight; give back those answered, fail the lost ones."""
        for request_id in list(in_flight):
            future, block_ids = in_flight.pop(request_id)
            self.held[request_id] = Held(future, block_ids)
        if not healthy:
            self._last_missed = now
            for held in self.held.values():
                if held.missed_at is None:
                    held.missed_at = now
        answered = {rid: (h.future, h.block_ids) for rid, h in self.held.items() if h.future.query()}
        missed = [rid for rid, h in self.held.items() if rid not in answered and h.missed_at is not None]
        reasons = {rid: why for rid in missed if (why := self._lost(self.held[rid], healthy, now))}
        failed = {rid: self.held[rid].block_ids for rid in reasons}
        for request_id in (*answered, *failed):
            del self.held[request_id]
        return Released(answered, failed, reasons)

    def futures(self) -> list[Any]:
        return [held.future for held in self.held.values()]

    def _lost(self, held: Held, healthy: bool, now: float) -> str:
        assert held.missed_at is not None
        if healthy and self._last_missed is not None and now - self._last_missed >= self.settle_s:
            return f"the server answers again ({self.settle_s:g} s) but not this load: it never got it"
        if self._server_gone():
            return "the server's port refuses: its process is gone and cannot write"
        if now - held.missed_at >= self.max_hold_s:
            return (f"held {self.max_hold_s:g} s without an answer; a server frozen longer than "
                    f"that could still write this load when it resumes")
        return ""
