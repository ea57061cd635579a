"""engine_driven: a store or load whose LMCache RPC fails is dropped, never raised into vLLM's step.

In engine_driven the vLLM worker asks the LMCache server for room (PREPARE_STORE,
PREPARE_RETRIEVE) and reports the copy (COMMIT_*) inside the step, synchronously
(lmcache ``transfer_context/worker_transfer.py`` ``submit_store``/``submit_retrieve``). When the
server dies or freezes between two heartbeats those calls raise (``LMCacheTimeoutError`` after
``timeout_s``, a ZMQ error), and LMCache's adapter lets the exception out of
``wait_for_save``/``start_load_kv``: vLLM's engine core dies and every request in flight gets a
500 (seen live: SIGKILL to the LMCache server under a steady stream of requests). lmcache_driven
never called the server in the step, so it never showed there.

The guard wraps the worker adapter's ``submit_store_request``/``submit_retrieve_request`` and
handles a failure the way the adapter itself handles a call made while the server is marked
unhealthy (lmcache ``vllm_multi_process_adapter.py``, both methods' ``if not
self.is_healthy`` branches): a store is dropped (a later request recomputes that prefix), a load
is reported failed so vLLM recomputes its blocks (``kv_load_failure_policy: recompute``;
``kvops_offload_errors_total{kind="load"}``), a dropped store counts as ``kind="store"``. After
a failure every call is dropped at once for ``timeout_s`` (one stalled step, not one per
request), by which time the heartbeat has marked the server unhealthy and the adapter drops
calls itself until the server is back; the heartbeat's "back" ends the window at once.

The stalled step itself waits as long as LMCache's engine-driven context waits for a reply:
``mq_timeout`` (kvops' ``timeout_s``, 10 s), and every request in flight waits with it (a
SIGSTOP to the server stalled three streaming clients 11.5 s, against 1.3 s in lmcache_driven).
The in-step calls answer in 2.5-7 ms (100 ms on a box busy with other jobs: README "Where an L1
hit's time goes"), so the guard bounds their wait at STEP_TIMEOUT_S (or ``timeout_s`` when that
is shorter) on the context LMCache built, again after each re-registration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.plugins.kvops.offload")

STEP_TIMEOUT_S = 2.0
"""The longest an engine_driven store or load waits inside vLLM's step for the LMCache server."""


class TransferGuard:
    """Wraps one worker adapter's two submit methods (instance attributes, so LMCache's batched
    submits, which call ``self.submit_*_request``, go through them too)."""

    def __init__(self, adapter: Any, window_s: float, on_store_dropped: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._adapter = adapter
        self._window_s = window_s
        self._on_store_dropped = on_store_dropped
        self._clock = clock
        self._failed_at: float | None = None
        self._store = adapter.submit_store_request
        self._retrieve = adapter.submit_retrieve_request
        adapter.submit_store_request = self.submit_store_request
        adapter.submit_retrieve_request = self.submit_retrieve_request

    def submit_store_request(self, request_id: str, op: Any, *args: Any, **kwargs: Any) -> None:
        if self._went_through("store", self._store, request_id, op, args, kwargs):
            return
        adapter = self._adapter
        adapter.store_futures.pop(request_id, None)
        if getattr(adapter, "lazy_offload", False):  # one receipt per rank unpins its blocks
            adapter._completed_store_requests[request_id] = 1
            adapter._failed_store_requests.add(request_id)
        self._on_store_dropped()

    def submit_retrieve_request(self, request_id: str, op: Any, *args: Any, **kwargs: Any) -> None:
        if self._went_through("load", self._retrieve, request_id, op, args, kwargs):
            return
        adapter = self._adapter
        adapter.retrieve_futures.pop(request_id, None)
        adapter.error_block_ids.update(op.flat_block_ids)
        adapter._failed_request_ids.add(request_id)
        adapter._dropped_retrieves.add(request_id)  # counted as kind="load" with vLLM's failed blocks

    def _went_through(self, kind: str, submit: Callable[..., None], request_id: str, op: Any,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """LMCache's submit, unless the window is open; False: the caller drops the call."""
        self._bound_step_wait()
        if self._open():
            return False
        try:
            submit(request_id, op, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an exception here stops vLLM's engine core
            self._failed(kind, request_id, exc)
            return False
        return True

    def _bound_step_wait(self) -> None:
        """LMCache builds the engine-driven context with the adapter's mq_timeout, anew at each
        re-registration (lmcache ``worker_transfer.py``, ``EngineDrivenContext.mq_timeout``)."""
        context = getattr(getattr(self._adapter, "transfer_ctx", None), "_engine_driven_context", None)
        bound = min(STEP_TIMEOUT_S, self._window_s)
        if context is not None and getattr(context, "mq_timeout", 0) > bound:
            context.mq_timeout = bound

    def server_back(self) -> None:
        """The heartbeat saw the server return (and LMCache re-registered the worker): try again
        now rather than at the end of the window, or a hit right after the restart is dropped."""
        self._failed_at = None

    def _open(self) -> bool:
        """Whether calls are dropped without trying: within ``window_s`` of the last failure."""
        return self._failed_at is not None and self._clock() - self._failed_at < self._window_s

    def _failed(self, kind: str, request_id: str, exc: BaseException) -> None:
        self._failed_at = self._clock()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        logger.error("kvops offload: the %s of request %s failed in LMCache (%s: %s); vLLM "
                     "recomputes it, and the worker drops stores and loads for %.0f s while the "
                     "heartbeat decides whether LMCache is gone", kind, request_id,
                     type(exc).__name__, first, self._window_s)
