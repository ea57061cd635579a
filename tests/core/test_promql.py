"""Reading a fleet from Prometheus: a replica's series, as a query returns them, reduce to the
same numbers as a scrape of that replica; the fleet reading sums counts and counters and keeps
the fullest replica's KV usage; a load balancer is told apart from one process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvops.core.errors import BadInputError
from kvops.core.prom import MetricsSample, parse_metrics, samples_by_name
from kvops.core.promql import (
    FleetReadings,
    Series,
    answers_from_many,
    as_text,
    check_selector,
    fleet_sample,
    with_series,
)


def _page(usage: float, preemptions: int, blocks: int, waiting: int) -> str:
    """A replica's /metrics as prometheus_client (vLLM's library) writes it."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=reg).labels("m", "0").set(usage)
    Gauge("vllm:num_requests_waiting", "w", labels, registry=reg).labels("m", "0").set(waiting)
    Gauge("vllm:num_requests_running", "r", labels, registry=reg).labels("m", "0").set(2)
    Counter("vllm:num_preemptions", "p", labels, registry=reg).labels("m", "0").inc(preemptions)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=reg, buckets=(0.1, 1.0))
    ttft.labels("m", "0").observe(0.05)
    ttft.labels("m", "0").observe(0.5)
    Gauge("kvops_scheduler_max_num_seqs", "s", ["model_name"], registry=reg).labels("m").set(4)
    info = Gauge("vllm:cache_config_info", "i", ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
                 registry=reg)
    info.labels("16", str(blocks), "True").set(1)
    return generate_latest(reg).decode()


def _as_queried(page: str, instance: str) -> Series:
    """What an instant query returns for that replica: every sample, its name in __name__ and
    Prometheus' instance/job labels added."""
    return [({"__name__": name, **labels, "instance": instance, "job": "vllm"}, value)
            for name, rows in samples_by_name(page).items() for labels, value in rows]


def test_a_replica_read_through_prometheus_reduces_like_its_scrape() -> None:
    page = _page(usage=0.75, preemptions=3, blocks=17, waiting=1)
    direct = parse_metrics(page, t=1.0)
    queried = parse_metrics(as_text(_as_queried(page, "10.0.0.1:8000")), t=1.0)
    assert queried.values == direct.values
    assert queried.ttft_buckets == direct.ttft_buckets
    assert queried.cache_config["num_gpu_blocks"] == "17"


def test_the_fleet_reading_sums_counts_and_keeps_the_fullest_replica() -> None:
    a = parse_metrics(as_text(_as_queried(_page(0.25, 0, 17, 0), "a:1")), t=5.0)
    b = parse_metrics(as_text(_as_queried(_page(0.95, 4, 33, 3), "b:1")), t=5.0)
    fleet = fleet_sample({"a:1": a, "b:1": b}, t=5.0)
    assert fleet.get("kv_usage") == 0.95
    assert fleet.get("preemptions") == 4
    assert fleet.get("waiting") == 3
    assert fleet.get("running") == 4
    assert fleet.get("kvops_scheduler_max_num_seqs") == 8  # the fleet holds 4 + 4 sequences
    assert fleet.get("ttft_count") == 4
    assert dict(fleet.ttft_buckets)[0.1] == 2  # one fast request on each
    # usable blocks 16 + 32, plus the one null block the concurrency formula takes off again
    assert fleet.cache_config["num_gpu_blocks"] == "49"


def _replica(t: float, usage: float, preemptions: int) -> MetricsSample:
    return parse_metrics(as_text(_as_queried(_page(usage, preemptions, 17, 0), "x:1")), t=t)


def test_a_replica_missing_from_a_query_keeps_its_last_reading_in_the_fleet() -> None:
    """A failed scrape drops a replica's series from the instant query (Prometheus marks them
    stale): the fleet keeps its last counters, and its gauges for a while, instead of falling."""
    fleet = FleetReadings(hold_gauges_s=5.0)
    first = fleet.add({"a:1": _replica(0, 0.2, 3), "b:1": _replica(0, 0.9, 17)}, t=0)
    assert (first.get("preemptions"), first.get("kv_usage"), first.get("running")) == (20, 0.9, 4)
    gap = fleet.add({"a:1": _replica(1, 0.3, 4)}, t=1)  # b's scrape timed out
    assert (gap.get("preemptions"), gap.get("kv_usage"), gap.get("running")) == (21, 0.9, 4)
    assert gap.cache_config["num_gpu_blocks"] == "33"  # still two replicas' pools
    later = fleet.add({"a:1": _replica(7, 0.3, 4)}, t=7)  # b silent for 7 s: gauges gone, counts kept
    assert (later.get("preemptions"), later.get("kv_usage"), later.get("running")) == (21, 0.3, 2)
    back = fleet.add({"a:1": _replica(8, 0.3, 4), "b:1": _replica(8, 1.0, 19)}, t=8)
    assert (back.get("preemptions"), back.get("kv_usage")) == (23, 1.0)
    assert fleet.missed == {"a:1": 0, "b:1": 2}


def test_a_replica_that_joins_late_or_restarts_adds_only_what_it_counts_then() -> None:
    fleet = FleetReadings()
    assert fleet.add({"a:1": _replica(0, 0.2, 3)}, t=0).get("preemptions") == 3
    # b was missing from the first reading with 17 preemptions behind it: none of them are this run's
    assert fleet.add({"a:1": _replica(1, 0.2, 3), "b:1": _replica(1, 0.5, 17)}, t=1).get("preemptions") == 3
    assert fleet.add({"a:1": _replica(2, 0.2, 3), "b:1": _replica(2, 0.5, 18)}, t=2).get("preemptions") == 4
    # a restarted: its counters start again from zero, and the fleet's go on from 4
    restarted = fleet.add({"a:1": _replica(3, 0.1, 1), "b:1": _replica(3, 0.5, 18)}, t=3)
    assert restarted.get("preemptions") == 5
    assert restarted.get("ttft_count") == 2  # a's two; b's two were counted before it joined


def test_every_series_comes_in_one_query_under_the_selector() -> None:
    assert with_series('{job="vllm"}') == '{job="vllm",__name__=~"vllm:.*|kvops_.*|lmcache:.*"}'
    assert with_series("{}") == '{__name__=~"vllm:.*|kvops_.*|lmcache:.*"}'
    with pytest.raises(BadInputError, match="--selector"):
        check_selector('job="vllm"')


class _Pages(BaseHTTPRequestHandler):
    pages: list[str] = []
    served = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        cls = type(self)
        body = cls.pages[cls.served % len(cls.pages)].encode()
        cls.served += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def pages() -> Iterator[tuple[str, type[_Pages]]]:
    handler = type("Handler", (_Pages,), {"pages": [], "served": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def _identity(start: str, cpu: float) -> str:
    return f"process_start_time_seconds {start}\nprocess_cpu_seconds_total {cpu}\n"


def test_a_balancer_alternating_two_replicas_is_told_from_one_process(pages) -> None:
    url, handler = pages
    handler.pages = [_identity("100.0", 5.0 + i) for i in range(6)]  # one process, CPU rising
    assert answers_from_many(url) is False
    handler.pages, handler.served = [_identity("100.0", 9.0), _identity("100.0", 4.0)], 0  # same start
    assert answers_from_many(url) is True
    handler.pages, handler.served = [_identity("100.0", 1.0), _identity("200.0", 2.0)], 0
    assert answers_from_many(url) is True
