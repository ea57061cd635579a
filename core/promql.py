"""Reading a fleet's metrics from Prometheus instead of one URL's /metrics.

Behind a load balancer successive scrapes of the balanced address come from different replicas,
so counters go backwards and rates mean nothing. Prometheus scrapes each replica by its own
address and labels it ``instance``; one instant query per tick returns every replica's series,
and each replica's are reduced by the same code as a direct scrape (kvops.core.prom.parse_metrics)
before they are combined for a fleet-wide reading.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import requests

from kvops.core import http
from kvops.core.errors import BadInputError, KvopsError
from kvops.core.prom import COUNTERS, MetricsSample, parse_metrics

DEFAULT_SELECTOR = '{job="vllm"}'
_SELECTOR = re.compile(r"^\{.*\}$", re.DOTALL)
# the series parse_metrics reads: vLLM's, the plugin's, LMCache's
SERIES = r'__name__=~"vllm:.*|kvops_.*|lmcache:.*"'
IDENTITY_READS = 6
HOLD_GAUGES_S = 10.0
"""How long a replica missing from the query keeps its last gauges in the fleet reading."""
_START_TIME = re.compile(r"^process_start_time_seconds (\S+)$", re.MULTILINE)
_CPU_SECONDS = re.compile(r"^process_cpu_seconds_total (\S+)$", re.MULTILINE)

Series = list[tuple[dict[str, str], float]]


class Prometheus:
    """Instant queries against Prometheus' HTTP API (/api/v1/query)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query(self, promql: str) -> Series:
        try:
            resp = http.get(self.url + "/api/v1/query", self.timeout_s, params={"query": promql})
        except requests.RequestException as exc:
            raise KvopsError(f"cannot reach Prometheus at {self.url}: {exc}") from exc
        try:
            body = resp.json()
        except ValueError:
            raise KvopsError(f"{self.url} did not answer like Prometheus (HTTP {resp.status_code}, "
                             "not JSON): pass Prometheus' base URL, e.g. http://host:9090") from None
        if not isinstance(body, dict):
            raise KvopsError(f"{self.url} answered JSON that is not Prometheus': pass its base URL")
        if body.get("status") != "success":
            raise BadInputError(f"Prometheus refused the query {promql!r}: {body.get('error')} "
                                "(check --selector)")
        try:
            return [(dict(r["metric"]), float(r["value"][1])) for r in body["data"]["result"]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise KvopsError(f"{self.url} answered a query result Prometheus would not "
                             f"({type(exc).__name__}): pass Prometheus' base URL") from None

    def by_instance(self, promql: str) -> dict[str, float]:
        return {labels.get("instance", ""): value for labels, value in self.query(promql)}

    def scrape_errors(self) -> dict[str, dict[str, Any]]:
        """Per ``instance`` of an active target whose last scrape failed: Prometheus' own
        ``lastError``, ``lastScrapeDuration`` and ``scrapeTimeout`` (/api/v1/targets). Empty when
        the API does not answer so (a proxy that passes only queries): the caller then knows
        only ``up == 0``."""
        try:
            body = http.get(self.url + "/api/v1/targets", self.timeout_s, params={"state": "active"}).json()
            targets = body["data"]["activeTargets"]
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return {}
        out: dict[str, dict[str, Any]] = {}
        for target in targets if isinstance(targets, list) else []:
            if not isinstance(target, dict) or target.get("health") != "down":
                continue
            instance = (target.get("labels") or {}).get("instance", "")
            out[instance] = {"last_error": str(target.get("lastError", "")),
                             "last_scrape_duration_s": target.get("lastScrapeDuration"),
                             "scrape_timeout": target.get("scrapeTimeout")}
        return out


def check_selector(selector: str) -> str:
    if not _SELECTOR.match(selector.strip()):
        raise BadInputError(f"--selector {selector!r}: give label matchers in braces, "
                            "e.g. '{job=\"vllm\"}'")
    return selector.strip()


def with_series(selector: str) -> str:
    """``{job="vllm"}`` -> ``{job="vllm",__name__=~"vllm:.*|..."}``: every series we read, one query."""
    inner = selector.strip()[1:-1].strip().rstrip(",")
    return "{" + (inner + "," if inner else "") + SERIES + "}"


def answers_from_many(url: str, headers: dict[str, str] | None = None, reads: int = IDENTITY_READS) -> bool:
    """True when ``url``/metrics is answered by more than one server process (a load balancer).

    One process keeps one start time and a CPU-seconds counter that never goes down; replicas
    started in the same 10 ms share a start time, but alternating between them sends the counter
    backwards. False when the page publishes no process identity or cannot be read (the caller's
    own read says why)."""
    starts: set[str] = set()
    cpu: list[float] = []
    for _ in range(reads):
        try:
            text = http.get(url.rstrip("/") + "/metrics", 5.0, headers=headers).text
        except requests.RequestException:
            return False
        start, used = _START_TIME.search(text), _CPU_SECONDS.search(text)
        if start is None or used is None:
            return False
        try:
            cpu.append(float(used.group(1)))
        except ValueError:
            return False
        starts.add(start.group(1))
    return len(starts) > 1 or any(b < a for a, b in zip(cpu, cpu[1:], strict=False))


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def as_text(series: Series) -> str:
    """Series from a query as a Prometheus text page (no TYPE lines: sample names stay as
    exposed, ``_total``/``_bucket`` included, which is what parse_metrics looks up)."""
    lines = []
    for labels, value in series:
        name = labels.get("__name__", "")
        rest = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items()) if k != "__name__")
        lines.append(f"{name}{{{rest}}} {value!r}" if rest else f"{name} {value!r}")
    return "\n".join(lines) + "\n"


def replica_samples(prom: Prometheus, selector: str, t: float | None = None) -> dict[str, MetricsSample]:
    """Each replica's latest series (by ``instance``), reduced as a direct scrape of it would be."""
    by_instance: dict[str, Series] = {}
    for labels, value in prom.query(with_series(selector)):
        by_instance.setdefault(labels.get("instance", ""), []).append((labels, value))
    now = time.time() if t is None else t
    return {instance: parse_metrics(as_text(rows), t=now) for instance, rows in sorted(by_instance.items())}


def fleet_sample(replicas: dict[str, MetricsSample], t: float | None = None) -> MetricsSample:
    """One reading for the fleet: counts, counters and histograms summed over replicas; KV usage
    the fullest replica's (one full replica preempts whatever the others hold); the KV pool the
    replicas' usable blocks together (each keeps block 0 as vLLM's null block), so a predicted
    concurrency is the fleet's."""
    out = MetricsSample(t=time.time() if t is None else t)
    buckets: dict[float, float] = {}
    for sample in replicas.values():
        for key, value in sample.values.items():
            if key == "kv_usage":
                out.values[key] = max(out.values.get(key, 0.0), value)
            else:
                out.values[key] = out.values.get(key, 0.0) + value
        for le, count in sample.ttft_buckets:
            buckets[le] = buckets.get(le, 0.0) + count
        if not out.cache_config and sample.cache_config:
            out.cache_config = dict(sample.cache_config)
    out.ttft_buckets = sorted(buckets.items())
    blocks = [_int(s.cache_config.get("num_gpu_blocks")) for s in replicas.values()]
    if out.cache_config and blocks and all(b is not None and b > 0 for b in blocks):
        out.cache_config["num_gpu_blocks"] = str(sum(b - 1 for b in blocks if b is not None) + 1)
    free = [free_blocks(s) for s in replicas.values()]
    if any(f is not None for f in free):
        out.values[FREE_BLOCKS_MIN] = min(f for f in free if f is not None)
    return out


FREE_BLOCKS_MIN = "kv_free_blocks_min"
"""A fleet reading's fewest free KV blocks in any one replica (its usable blocks times 1 − its
usage): what the next request routed to the fullest replica must fit in."""


def free_blocks(sample: MetricsSample) -> float | None:
    """Free KV blocks in a reading: a fleet's fewest in any replica, else num_gpu_blocks − 1
    usable (vLLM's block 0 is its null block, and its usage is over the rest) times 1 − usage.
    None without both numbers."""
    if FREE_BLOCKS_MIN in sample.values:
        return sample.values[FREE_BLOCKS_MIN]
    blocks = _int(sample.cache_config.get("num_gpu_blocks"))
    if not blocks or "kv_usage" not in sample.values:
        return None
    return round((1.0 - sample.values["kv_usage"]) * (blocks - 1), 6)


def is_counter(key: str) -> bool:
    """A MetricsSample key that only grows while its server lives (summed histogram parts too)."""
    return key in COUNTERS or key.endswith(("_total", "_sum", "_count", "_bucket"))


_K = TypeVar("_K", str, float)


def _count_on(before: dict[_K, float], now: dict[_K, float], offsets: dict[_K, float]) -> dict[_K, float]:
    """Counters as read ``now``, one missing from it keeping its value ``before``; one that went
    down (its server restarted) adds what it had counted to its offset."""
    for key, value in before.items():
        if now.get(key, value) < value:
            offsets[key] = offsets.get(key, 0.0) + value
    return {**before, **now}


@dataclass
class _Held:
    last: MetricsSample
    offsets: dict[str, float] = field(default_factory=dict)
    """Added to the replica's counters: minus what it had counted when it joined late, plus
    what it had counted before each restart."""
    bucket_offsets: dict[float, float] = field(default_factory=dict)


class FleetReadings:
    """Fleet readings (fleet_sample) that stay whole while replicas drop out of the query.

    A scrape that fails (a replica too busy to answer within scrape_timeout: under KV load, the
    moment that matters) makes Prometheus mark all its series stale, so the next instant query
    lacks that replica; summed as it came, the fleet's counters fell (one run's preemptions went
    17 -> 0 -> 20 and its step counted none) and its KV usage was the other replica's. So each
    replica's last reading stands in while it is missing: counters always (a replica gone for good
    has stopped counting), gauges for ``hold_gauges_s``. A replica first seen after the first
    reading adds only what it counts from then on, and one whose counters went down (a restart)
    counts on from where it was: the fleet's counters never go backwards or jump.
    """

    def __init__(self, hold_gauges_s: float = HOLD_GAUGES_S) -> None:
        self.hold_gauges_s = hold_gauges_s
        self.held: dict[str, _Held] = {}
        self.missed: dict[str, int] = {}
        """Readings each replica was missing from, after it was first seen."""
        self.readings = 0

    def add(self, replicas: dict[str, MetricsSample], t: float | None = None) -> MetricsSample:
        now = time.time() if t is None else t
        for instance, sample in replicas.items():
            held = self.held.get(instance)
            if held is None:
                held = self.held[instance] = _Held(sample)
                self.missed[instance] = 0
                if self.readings:
                    held.offsets = {k: -v for k, v in sample.values.items() if is_counter(k)}
                    held.bucket_offsets = {le: -count for le, count in sample.ttft_buckets}
                continue
            counted = {k: v for k, v in held.last.values.items() if is_counter(k)}
            buckets = _count_on(dict(held.last.ttft_buckets), dict(sample.ttft_buckets), held.bucket_offsets)
            held.last = MetricsSample(t=sample.t, values=_count_on(counted, sample.values, held.offsets),
                                      cache_config=sample.cache_config or held.last.cache_config,
                                      ttft_buckets=sorted(buckets.items()))
        unread = sorted(self.held.keys() - replicas.keys())
        for instance in unread:
            self.missed[instance] += 1
        self.readings += 1
        out = fleet_sample({instance: self._reading(held, now) for instance, held in sorted(self.held.items())},
                           t=now)
        out.unread = unread
        return out

    def _reading(self, held: _Held, now: float) -> MetricsSample:
        last, fresh = held.last, now - held.last.t <= self.hold_gauges_s
        values = {key: value + held.offsets.get(key, 0.0) if is_counter(key) else value
                  for key, value in last.values.items() if fresh or is_counter(key)}
        buckets = [(le, count + held.bucket_offsets.get(le, 0.0)) for le, count in last.ttft_buckets]
        return MetricsSample(t=last.t, values=values, cache_config=last.cache_config, ttft_buckets=buckets)


def _int(value: Any) -> int | None:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None
