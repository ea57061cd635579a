"""``kvops offload status``: what an LMCache server holds and how well it is hit.

Reads the server's own HTTP API: /status (L1 and L2 usage and capacity), /metrics (lookup,
hit and eviction counters, research/lmcache.md §2 "MP metrics") and /config (whether L1 is a
/dev/shm segment engine_driven workers copy from, or private memory they get pickled objects of).
"""

from __future__ import annotations

from typing import Any

import requests

from kvops.core import http
from kvops.core.errors import KvopsError
from kvops.core.offload.l1_shm import PICKLED_COST, served_l1
from kvops.core.prom import samples_by_name, selector_sum
from kvops.core.units import GIB

COUNTERS: dict[str, str] = {
    "lookup_tokens": "lmcache_mp_lookup_requested_tokens_total",
    "hit_tokens_l1": "lmcache_mp_lookup_hit_l1_tokens_total",
    "hit_tokens_l2": "lmcache_mp_lookup_hit_l2_tokens_total",
    "l1_write_chunks": "lmcache_mp_l1_write_chunks_total",
    "l1_read_chunks": "lmcache_mp_l1_read_chunks_total",
    "l1_evicted_chunks": "lmcache_mp_l1_evicted_chunks_total",
    "l2_stored_chunks": "lmcache_mp_l2_store_completed_objects_chunks_total",
    "l2_evicted_chunks": "lmcache_mp_l2_evicted_objects_chunks_total",
}


def fetch_status(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """One JSON-able summary of the server at ``url`` (its HTTP API base)."""
    base = url.rstrip("/")
    try:
        status = http.get(base + "/status", timeout_s)
        metrics = http.get(base + "/metrics", timeout_s)
        config = http.get(base + "/config", timeout_s)
    except requests.RequestException as exc:
        raise KvopsError(
            f"LMCache server not reachable at {base}: {type(exc).__name__}; start it with "
            "`kvops offload serve`"
        ) from None
    if status.status_code != 200:
        raise KvopsError(f"LMCache server at {base} answered /status with HTTP {status.status_code}")
    try:
        document = status.json()
    except ValueError:
        raise KvopsError(f"{base}/status did not answer JSON: is it the LMCache server's HTTP port?") from None
    if not isinstance(document, dict):
        raise KvopsError(f"{base}/status answered JSON that is not LMCache's status document")
    try:
        return summarize(base, document, metrics.text, _json_or_empty(config))
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise KvopsError(f"{base} answered a /status LMCache would not ({type(exc).__name__}): "
                         "is it the LMCache server's HTTP port?") from None


def _json_or_empty(resp: requests.Response) -> dict[str, Any]:
    try:
        document = resp.json() if resp.status_code == 200 else {}
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def l1_transfer(config: dict[str, Any]) -> dict[str, str]:
    """``transfer`` shm or pickled for engine_driven loads, the ``pool`` segment and why."""
    if "mp" not in config:
        return {"transfer": "unknown", "pool": "", "reason": "the server's /config did not answer"}
    asked, pool = served_l1(config)
    if pool:
        return {"transfer": "shm", "pool": pool,
                "reason": f"L1 lives in /dev/shm/{pool}: engine_driven workers (auto's choice on a "
                          "CPU beside it) copy loads from it"}
    why = (f"the server asked for {asked} but LMCache found too little room in /dev/shm" if asked
           else "the server runs without --shm-name")
    return {"transfer": "pickled", "pool": "", "reason": f"{why}, so for engine_driven {PICKLED_COST}"}


def summarize(url: str, status: dict[str, Any], metrics_text: str,
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pure: the summary from a /status document, a /metrics text and a /config document."""
    manager = status.get("storage_manager", {})
    l1 = manager.get("l1_manager", {})
    l2 = [
        {
            "path": adapter.get("base_path"),
            "type": adapter.get("type"),
            "used_bytes": evict.get("total_bytes_used"),
            "capacity_bytes": evict.get("total_capacity_bytes"),
        }
        for adapter, evict in zip(
            manager.get("l2_adapters", []),
            _padded(manager.get("l2_eviction_controller", {}).get("adapters", []),
                    len(manager.get("l2_adapters", []))),
            strict=True,
        )
    ]
    counters = counter_values(metrics_text)
    lookups = counters["lookup_tokens"]
    hits = counters["hit_tokens_l1"] + counters["hit_tokens_l2"]
    return {
        "url": url,
        "healthy": bool(status.get("is_healthy")),
        "chunk_size": status.get("chunk_size"),
        "l1": {
            "used_bytes": l1.get("memory_used_bytes"),
            "capacity_bytes": l1.get("memory_total_bytes"),
            "objects": l1.get("total_object_count"),
            **l1_transfer(config or {}),
        },
        "l2": l2,
        "counters": counters,
        "hit_ratio": (hits / lookups) if lookups else None,
    }


def _padded(items: list[dict[str, Any]], length: int) -> list[dict[str, Any]]:
    return [*items[:length], *([{}] * (length - len(items)))]


def counter_values(metrics_text: str) -> dict[str, float]:
    """Our names for LMCache's counters, summed over their labels; absent counters are 0."""
    by_name = samples_by_name(metrics_text)
    return {ours: selector_sum(by_name, metric) for ours, metric in COUNTERS.items()}


def render(summary: dict[str, Any]) -> str:
    """Human-readable lines for a terminal."""
    gib = float(GIB)
    l1 = summary["l1"]
    lines = [
        f"LMCache server {summary['url']}: {'healthy' if summary['healthy'] else 'UNHEALTHY'}, "
        f"chunk {summary['chunk_size']} tokens",
        f"  L1 (DRAM): {(l1['used_bytes'] or 0) / gib:.3f} / {(l1['capacity_bytes'] or 0) / gib:.3f}"
        f" GiB, {l1['objects']} chunks",
        f"  L1 transfer for engine_driven loads: {l1['transfer']}: {l1['reason']}",
    ]
    for tier in summary["l2"]:
        lines.append(
            f"  L2 ({tier['type']} {tier['path']}): {(tier['used_bytes'] or 0) / gib:.3f} / "
            f"{(tier['capacity_bytes'] or 0) / gib:.3f} GiB"
        )
    c = summary["counters"]
    ratio = summary["hit_ratio"]
    lines.append(
        f"  lookups: {c['lookup_tokens']:.0f} tokens, hits L1 {c['hit_tokens_l1']:.0f} + "
        f"L2 {c['hit_tokens_l2']:.0f} tokens"
        + (f" ({ratio:.1%})" if ratio is not None else "")
    )
    lines.append(
        f"  evicted chunks: L1 {c['l1_evicted_chunks']:.0f}, L2 {c['l2_evicted_chunks']:.0f}"
    )
    return "\n".join(lines)
