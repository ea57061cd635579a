"""vLLM's /metrics reduced to the handful of numbers the diagnoses need.

Both metric-name generations are known: ``vllm:kv_cache_usage_perc`` replaced
``vllm:gpu_cache_usage_perc`` (vLLM #18354) and ``vllm:prefix_cache_*`` replaced
``vllm:gpu_prefix_cache_*``. Counters and histogram sums are summed over engines (label
``engine``); usage is averaged. Counters are cumulative since server start, so every diagnosis
works on differences between two samples.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from kvops.core import http
from kvops.core.errors import KvopsError

# our key -> sample names, newest first
GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "external_prefix_queries": ("vllm:external_prefix_cache_queries_total",),
    "external_prefix_hits": ("vllm:external_prefix_cache_hits_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "requests_finished": ("vllm:request_success_total",),
}
HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    # one observation per evicted cached block of the sample vLLM tracks (--kv-cache-metrics,
    # --kv-cache-metrics-sample, 0.01 by default; absent without the flag)
    "evict_idle": "vllm:kv_block_idle_before_evict_seconds",
}
CACHE_INFO = "vllm:cache_config_info"


@dataclass
class MetricsSample:
    """One scrape: flat numbers (gauges, counters, ``<hist>_sum``/``<hist>_count``) at time ``t``."""

    t: float
    values: dict[str, float] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)
    ttft_buckets: list[tuple[float, float]] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    """A fleet reading's replicas missing from this query, standing in with their last reading
    (kvops.core.promql.FleetReadings): what they counted since reaches a later reading."""

    def get(self, key: str, default: float = 0.0) -> float:
        return self.values.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        out = {"t": self.t, "values": self.values, "cache_config": self.cache_config,
               "ttft_buckets": self.ttft_buckets}
        return {**out, "unread": self.unread} if self.unread else out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricsSample:
        return cls(t=float(data["t"]), values=dict(data.get("values", {})),
                   cache_config=dict(data.get("cache_config", {})),
                   ttft_buckets=[(float(a), float(b)) for a, b in data.get("ttft_buckets", [])],
                   unread=[str(i) for i in data.get("unread", [])])


Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples_by_name(text: str) -> Samples:
    """Every sample of a Prometheus text page, by sample name (``_total``, ``_sum``, ``_bucket``
    kept as exposed), read with prometheus_client's parser: every /metrics read goes through here.
    A page that is not Prometheus text is a KvopsError (the peer failed), not a crash."""
    by_name: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                by_name.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:  # the parser's errors on garbage
        raise KvopsError(f"a /metrics page that is not Prometheus text ({' '.join(str(exc).split())[:100]}): "
                         "is the URL the server's own?") from None
    return by_name


def selector_sum(by_name: Samples, selector: str) -> float:
    """Sum of the samples a ``name`` or ``name{label="value",...}`` selector picks (every sample
    of that name carrying those labels; 0.0 when none). The selector is read by the same parser."""
    wanted = next(iter(text_string_to_metric_families(selector + " 0\n"))).samples[0]
    return sum((value for labels, value in by_name.get(wanted.name, [])
                if all(labels.get(k) == v for k, v in wanted.labels.items())), 0.0)


def info_labels(by_name: Samples, name: str) -> dict[str, str] | None:
    """The labels of an info metric such as ``vllm:cache_config_info`` (its first sample)."""
    rows = by_name.get(name)
    return rows[0][0] if rows else None


def parse_metrics(text: str, t: float | None = None) -> MetricsSample:
    """Reduce a Prometheus text page to a MetricsSample."""
    by_name = samples_by_name(text)
    out = MetricsSample(t=time.time() if t is None else t)
    for key, names in GAUGES.items():
        for name in names:
            if name in by_name:
                vals = [v for _, v in by_name[name]]
                out.values[key] = sum(vals) / len(vals) if key == "kv_usage" else sum(vals)
                break
    for key, names in COUNTERS.items():
        for name in names:
            if name in by_name:
                out.values[key] = sum(v for _, v in by_name[name])
                break
    for key, name in HISTOGRAMS.items():
        for suffix in ("_sum", "_count"):
            if name + suffix in by_name:
                out.values[key + suffix] = sum(v for _, v in by_name[name + suffix])
    buckets: dict[float, float] = {}
    for labels, value in by_name.get(HISTOGRAMS["ttft"] + "_bucket", []):
        le = float(labels.get("le", "inf"))
        buckets[le] = buckets.get(le, 0.0) + value
    out.ttft_buckets = sorted(buckets.items())
    kvops = [(n, v) for n, rows in by_name.items() if n.startswith(("kvops_", "lmcache:"))
             for _, v in rows]
    for name, value in kvops:
        out.values[name] = out.values.get(name, 0.0) + value
    out.cache_config = info_labels(by_name, CACHE_INFO) or {}
    return out


def scrape(url: str, timeout_s: float = 5.0, headers: dict[str, str] | None = None) -> MetricsSample:
    """GET ``url``/metrics once; the sample is stamped at the midpoint of the request.

    ``headers``: what a proxy in front of the server wants (vLLM's own /metrics needs none).
    """
    start = time.time()
    try:
        resp = http.get(url.rstrip("/") + "/metrics", timeout_s, headers=headers)
        resp.raise_for_status()
    except requests.RequestException as exc:
        raise KvopsError(f"cannot read {url}/metrics: {exc}: is the server up and is the URL right?") from exc
    return parse_metrics(resp.text, t=(start + time.time()) / 2)


def delta(first: MetricsSample, last: MetricsSample, key: str) -> float:
    """Counter increase between two samples (0 if the server restarted and it went down)."""
    return max(0.0, last.get(key) - first.get(key))


def hist_mean(first: MetricsSample, last: MetricsSample, name: str) -> float | None:
    count = delta(first, last, name + "_count")
    return delta(first, last, name + "_sum") / count if count else None


def window(samples: Sequence[MetricsSample], start: float, end: float) -> list[MetricsSample]:
    return [s for s in samples if start <= s.t <= end]


def cache_int(sample: MetricsSample, key: str) -> int | None:
    value = sample.cache_config.get(key)
    try:
        return int(float(value)) if value not in (None, "None", "") else None
    except ValueError:
        return None


def prefix_caching_enabled(sample: MetricsSample) -> bool | None:
    value = sample.cache_config.get("enable_prefix_caching")
    return None if value is None else value == "True"


def bucket_quantile(first: MetricsSample, last: MetricsSample, q: float) -> float | None:
    """Quantile (0..1) of the TTFT histogram's increase, linear within a bucket, as PromQL's
    histogram_quantile does; vLLM's buckets are coarse, so this is an estimate."""
    before = dict(first.ttft_buckets)
    rows = [(le, count - before.get(le, 0.0)) for le, count in last.ttft_buckets]
    total = rows[-1][1] if rows else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le, cumulative in rows:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = le, cumulative
    return lower
