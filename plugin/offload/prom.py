"""``kvops_offload_*`` metrics in vLLM's /metrics (front-end process).

Two sources: the connector's per-step stats (``OffloadStats``, per engine) and, for what only
the LMCache server knows (hits by tier, usage, evictions), a background poll of the server's own
/metrics every few seconds, mirrored as gauges. Server-side figures are server-wide: when several
vLLM instances share one LMCache server they see the same numbers.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache.integration.vllm.lmcache_mp_metrics import LMCacheMPPromMetrics

from kvops.core.offload.canary import REPORT_KEYS
from kvops.core.units import GIB
from kvops.plugin.loops import ResilientLoop, count_internal_error
from kvops.plugin.metrics import gauge
from kvops.plugin.offload.diskwatch import DiskWatch
from kvops.plugin.offload.stats import (
    COUNTERS,
    DEGRADED,
    DIGEST_DEGRADED,
    ERRORS,
    INTERNAL,
    WORKER_COPY,
)

SERVER_POLL_S = 5.0
SERVER_POLL_TIMEOUT_S = 1.0
SERVER_POLL_MAX_BYTES = 4 << 20  # LMCache's page is a few KiB; more is not its /metrics
# LMCache MP server metric -> (our gauge, its tier label); research/lmcache.md §2 "MP metrics".
SERVER_METRICS: dict[str, tuple[str, str]] = {
    "lmcache_mp_lookup_hit_l1_tokens_total": ("kvops_offload_server_hit_tokens", "l1"),
    "lmcache_mp_lookup_hit_l2_tokens_total": ("kvops_offload_server_hit_tokens", "l2"),
    "lmcache_mp_l1_memory_usage_bytes": ("kvops_offload_server_usage_bytes", "l1"),
    "lmcache_mp_l2_usage_bytes": ("kvops_offload_server_usage_bytes", "l2"),
    "lmcache_mp_l2_evicted_objects_chunks_total": ("kvops_offload_server_evicted_chunks", "l2"),
}
# LMCache counts L2 stores submitted and stored, not failed (a failed store only logs a
# WARNING, storage_controllers/store_controller.py _finalize_store): the difference is what is
# in flight or failed, and it grows while the disk tier is full or read-only.
UNSTORED = ("kvops_offload_server_unstored_chunks", "l2")
STORE_BALANCE = {
    "lmcache_mp_l2_store_submitted_objects_chunks_total": 1.0,
    "lmcache_mp_l2_store_completed_objects_chunks_total": -1.0,
}
SERVER_DOCS = {
    "kvops_offload_server_hit_tokens": "Prompt tokens the LMCache server found, by tier (server-wide)",
    "kvops_offload_server_usage_bytes": "Bytes the LMCache server holds, by tier (server-wide)",
    "kvops_offload_server_evicted_chunks": "Chunks the LMCache server evicted, by tier (server-wide)",
    "kvops_offload_server_unstored_chunks": "Chunks submitted to a tier and not stored there: in "
                                            "flight or failed; growing = stores fail (server-wide)",
}


class OffloadPromMetrics(LMCacheMPPromMetrics):
    """Registers the kvops_offload_* metrics and records OffloadStats into them."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        self._degraded = self._per_engine(self._gauge_cls(
            name="kvops_offload_degraded", labelnames=names, multiprocess_mode="mostrecent",
            documentation="1 while the connector cannot reach LMCache and every request recomputes",
        ))
        self._counters = {
            key: self._per_engine(self._counter_cls(
                name=f"kvops_offload_{key.removeprefix('kvops_')}", labelnames=names,
                documentation=f"LMCache offload: {key.removeprefix('kvops_').replace('_', ' ')}",
            ))
            for key in COUNTERS
        }
        self._miss_tokens = self._per_engine(self._counter_cls(
            name="kvops_offload_miss_tokens", labelnames=names,
            documentation="Prompt tokens looked up in LMCache and not found",
        ))
        self._seconds = {
            key: self._per_engine(self._histogram_cls(
                name=f"kvops_offload_{key.removeprefix('kvops_')}", labelnames=names,
                documentation="Seconds a worker step spent handing KV to/from LMCache",
                buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
            ))
            for key in ("kvops_store_seconds", "kvops_load_seconds")
        }
        self._errors = self._counter_cls(
            name="kvops_offload_errors", labelnames=[*names, "kind"],
            documentation="LMCache offload errors by kind (unreachable, load, store, corrupt, held)",
        )
        self._digest_degraded = self._per_engine(self._gauge_cls(
            name="kvops_offload_digest_degraded", labelnames=names, multiprocess_mode="mostrecent",
            documentation="1 while the block digest file beside the disk tier refuses writes "
                          "(digests kept in memory only; serving continues)",
        ))
        self._worker_copy = self._gauge_cls(
            name="kvops_offload_worker_copy", labelnames=[*names, "copy"], multiprocess_mode="mostrecent",
            documentation="Which copy the engine_driven worker runs between LMCache's L1 and vLLM's KV "
                          "(1 on kvops' or lmcache's; no sample in lmcache_driven, where the server copies)",
        )
        for engine_idx in per_engine_labelvalues:
            self._degraded[engine_idx].set(0)
            self._digest_degraded[engine_idx].set(0)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings = extra["kvops.offload"]
        publish_capacity(settings)
        url = "http://{host}:{http_port}/metrics".format(**settings)
        _ServerPoller(url, local_disk_path(settings)).start()

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """vLLM calls this in its output handler: an exception here kills the API server (seen
        under preemption: a negative counter increment), so nothing may escape."""
        try:
            self._observe(transfer_stats_data, engine_idx)
        except Exception:  # counted and logged once, never raised into vLLM
            count_internal_error("offload_metrics")
            if not self._observe_failed:
                self._observe_failed = True
                from kvops.plugin._compat import plugin_logger

                plugin_logger().exception("kvops offload metrics: a stats report failed "
                                          "(counted in kvops_internal_errors_total; serving continues)")

    _observe_failed = False

    def _observe(self, transfer_stats_data: dict[str, Any], engine_idx: int) -> None:
        super().observe(transfer_stats_data, engine_idx)
        data = transfer_stats_data
        if DEGRADED in data:
            self._degraded[engine_idx].set(data[DEGRADED])
        if DIGEST_DEGRADED in data:
            self._digest_degraded[engine_idx].set(data[DIGEST_DEGRADED])
        if WORKER_COPY in data:
            values = self.per_engine_labelvalues[engine_idx]
            for copy, on in (("kvops", data[WORKER_COPY]), ("lmcache", 1 - data[WORKER_COPY])):
                self._worker_copy.labels(*values, copy).set(on)
        for component, count in data.get(INTERNAL, {}).items():
            count_internal_error(component, count)
        for key, counter in self._counters.items():
            value = data.get(key) or 0
            if value > 0:
                counter[engine_idx].inc(value)
            elif value < 0:  # a report that went backwards (preemption): not a count
                count_internal_error("offload_metrics")
        missed = data.get("kvops_lookup_tokens", 0) - data.get("kvops_hit_tokens", 0)
        if missed > 0:
            self._miss_tokens[engine_idx].inc(missed)
        for key, histogram in self._seconds.items():
            for seconds in data.get(key, ()):
                histogram[engine_idx].observe(seconds)
        reports = {key: int(data[key]) for key in REPORT_KEYS if data.get(key)}
        if reports:
            from kvops.plugin.offload.canary import TALLY

            TALLY.add(reports)
        labels = self.per_engine_labelvalues[engine_idx]
        for kind, count in data.get(ERRORS, {}).items():
            self._errors.labels(*labels, kind).inc(count)


def publish_capacity(settings: dict[str, Any]) -> None:
    """``kvops_offload_capacity_bytes``: the most KV the LMCache tiers hold, from the offload
    settings (the LMCache server is started from the same kvops.yaml): the larger of l1_gib and
    disk_gib, the disk tier being inclusive (ops/capacity/tiers.py). A trace replay divides it
    by the stored bytes per token to predict that tier's hits (loadtest/analysis/replay.py)."""
    tiers = [settings.get("l1_gib") or 0.0, settings.get("disk_gib") or 0.0]
    gauge("kvops_offload_capacity_bytes",
          "Most bytes of KV the LMCache tiers hold (max of l1_gib and the inclusive disk_gib)"
          ).set(max(tiers) * GIB)


def local_disk_path(settings: dict[str, Any]) -> Path | None:
    """The disk tier's directory when it is on this machine (a remote one is not ours to probe)."""
    from kvops.plugin.offload.wiring import LOCAL_HOSTS

    disk = settings.get("disk_path")
    if not disk or settings.get("host") not in LOCAL_HOSTS:
        return None
    return Path(disk).expanduser().resolve()


class _ServerPoller(ResilientLoop):
    """Mirrors a few LMCache server metrics into gauges and watches the local disk tier; never
    blocks vLLM's stat loop, and outlives any answer LMCache gives (garbage, truncated, huge)."""

    def __init__(self, url: str, disk_path: Path | None) -> None:
        self.url = url
        self.up = gauge("kvops_offload_server_up", "1 when the LMCache server answered the last poll")
        self.disk = None if disk_path is None else DiskWatch(disk_path, gauge(
            "kvops_offload_disk_degraded",
            "1 while the local disk tier refuses writes (full or read-only): LMCache stores fail",
        ))
        steps: dict[str, Callable[[], object]] = {"offload_poller": self.poll_once}
        if self.disk is not None:
            steps["offload_disk_watch"] = self.disk.check
        super().__init__("kvops-offload-poll", steps, SERVER_POLL_S)

    def poll_once(self) -> None:
        """up=0 when LMCache does not answer; an answer we cannot read is up=0 and raises (the
        loop counts it and backs off)."""
        try:
            with urllib.request.urlopen(self.url, timeout=SERVER_POLL_TIMEOUT_S) as resp:  # noqa: S310
                body = resp.read(SERVER_POLL_MAX_BYTES + 1)
                short = resp.length  # bytes its Content-Length promised and never sent
        except OSError:
            self.up.set(0)
            return
        except Exception:
            self.up.set(0)
            raise
        try:
            if len(body) > SERVER_POLL_MAX_BYTES:
                raise ValueError(f"/metrics page above {SERVER_POLL_MAX_BYTES} bytes")
            if short:
                raise ValueError(f"/metrics page cut short ({short} bytes missing)")
            values = server_values(body.decode())
        except Exception:
            self.up.set(0)
            raise
        self.up.set(1)
        for (name, tier), value in values.items():
            gauge(name, SERVER_DOCS[name], ("tier",)).labels(tier=tier).set(value)


def server_values(text: str) -> dict[tuple[str, str], float]:
    """Sum LMCache's samples (any labels) into our (gauge name, tier) pairs."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            target = SERVER_METRICS.get(sample.name)
            if target is not None:
                values[target] = values.get(target, 0.0) + float(sample.value)
            sign = STORE_BALANCE.get(sample.name)
            if sign is not None:
                values[UNSTORED] = values.get(UNSTORED, 0.0) + sign * float(sample.value)
    return values
