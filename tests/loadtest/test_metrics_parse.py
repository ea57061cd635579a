"""/metrics pages written by prometheus_client itself (the library vLLM uses) reduce to the
numbers our diagnoses read, under both metric-name generations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvops.core.prom import delta, hist_mean, parse_metrics, prefix_caching_enabled


def _page(usage_name: str, prefix: str, engines: int = 2) -> str:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    usage = Gauge(usage_name, "kv", labels, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=reg)
    queries = Counter(f"vllm:{prefix}prefix_cache_queries", "q", labels, registry=reg)
    hits = Counter(f"vllm:{prefix}prefix_cache_hits", "h", labels, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=reg,
                     buckets=(0.01, 0.1, 1.0))
    info = Gauge("vllm:cache_config_info", "i", ["block_size", "num_gpu_blocks",
                                                  "enable_prefix_caching"], registry=reg)
    info.labels("128", "12", "False").set(1)
    for e in range(engines):
        lab = ("m", str(e))
        usage.labels(*lab).set(0.5 + 0.25 * e)
        waiting.labels(*lab).set(3)
        queries.labels(*lab).inc(1000)
        hits.labels(*lab).inc(250)
        ttft.labels(*lab).observe(0.02)
        ttft.labels(*lab).observe(0.04)
    return generate_latest(reg).decode()


@pytest.mark.parametrize(("usage_name", "prefix"), [
    ("vllm:kv_cache_usage_perc", ""), ("vllm:gpu_cache_usage_perc", "gpu_")])
def test_both_name_generations(usage_name, prefix):
    s = parse_metrics(_page(usage_name, prefix), t=1.0)
    assert s.get("kv_usage") == pytest.approx(0.625)  # averaged over the two engines
    assert s.get("waiting") == 6  # summed
    assert s.get("prefix_queries") == 2000
    assert s.get("prefix_hits") == 500
    assert s.get("ttft_count") == 4
    assert s.get("ttft_sum") == pytest.approx(0.12)
    assert s.cache_config["num_gpu_blocks"] == "12"
    assert prefix_caching_enabled(s) is False


def test_deltas_and_histogram_means():
    a = parse_metrics(_page("vllm:kv_cache_usage_perc", "", engines=1), t=0.0)
    b = parse_metrics(_page("vllm:kv_cache_usage_perc", "", engines=2), t=1.0)
    assert delta(a, b, "prefix_hits") == 250
    assert hist_mean(a, b, "ttft") == pytest.approx(0.03)
    assert delta(b, a, "prefix_hits") == 0  # a restarted server never gives negative increases


def test_bucket_quantile_interpolates_inside_the_bucket():
    from kvops.core.prom import bucket_quantile

    before = parse_metrics(_page("vllm:kv_cache_usage_perc", "", engines=1), t=0.0)
    after = parse_metrics(_page("vllm:kv_cache_usage_perc", "", engines=2), t=1.0)
    # the increase is two observations (0.02, 0.04), both in the (0.01, 0.1] bucket: the
    # median rank 1 of 2 lies halfway through it, as PromQL's histogram_quantile puts it
    assert bucket_quantile(before, after, 0.5) == pytest.approx(0.01 + 0.09 * 0.5)
    assert bucket_quantile(after, after, 0.5) is None
