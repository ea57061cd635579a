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
from kvops.core.prom import parse_metrics, samples_by_name
from kvops.core.promql import (
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
