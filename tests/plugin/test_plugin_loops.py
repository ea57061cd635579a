"""Background loops outlive their faults: the offload poller against a real local HTTP server
that answers garbage, then a truncated page, then valid LMCache metrics."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from kvops.plugin import metrics
from kvops.plugin.loops import ResilientLoop, backoff_s
from kvops.plugin.offload.prom import _ServerPoller

VALID = b"# TYPE lmcache_mp_l1_memory_usage_bytes gauge\nlmcache_mp_l1_memory_usage_bytes 42.0\n"


class _Peer(http.server.BaseHTTPRequestHandler):
    body = b""
    truncate = False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body) + (100 if self.truncate else 0)))
        self.end_headers()
        self.wfile.write(self.body)
        if self.truncate:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def peer() -> Iterator[tuple[str, type[_Peer]]]:
    handler = type("Peer", (_Peer,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _fresh_metrics() -> Iterator[None]:
    metrics.reset_for_tests()
    yield
    metrics.reset_for_tests()


def _sample(name: str, **labels: str) -> float | None:
    value: float | None = metrics._registry().get_sample_value(
        name, {"model_name": metrics.bound_model_name(), **labels})
    return value


def test_the_poller_survives_garbage_and_truncation_and_recovers(peer):
    url, handler = peer
    poller = _ServerPoller(url, None)
    handler.body = VALID
    assert poller.run_once()
    assert _sample("kvops_offload_server_up") == 1
    assert _sample("kvops_offload_server_usage_bytes", tier="l1") == 42

    handler.body = b"\xff\xfe{not prometheus at all"
    assert not poller.run_once()
    assert _sample("kvops_offload_server_up") == 0
    handler.body, handler.truncate = VALID, True  # the peer hangs up 100 bytes short
    assert not poller.run_once()
    assert poller.streak == 2
    assert _sample("kvops_internal_errors_total", component="offload_poller") == 2

    handler.truncate = False
    assert poller.run_once()
    assert _sample("kvops_offload_server_up") == 1
    assert poller.streak == 0


def test_a_failing_step_does_not_stop_the_others_and_backs_off():
    seen: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    loop = ResilientLoop("t", {"broken": broken, "fine": lambda: seen.append("x")}, 1.0,
                         max_backoff_s=8.0)
    for _ in range(5):
        loop.run_once()
    assert seen == ["x"] * 5
    assert [backoff_s(1.0, n, 8.0) for n in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert _sample("kvops_internal_errors_total", component="broken") == 5


def test_a_failing_stats_report_never_reaches_vllms_output_handler(monkeypatch):
    """vLLM calls observe() in the API server's output handler, where an exception kills the
    server (seen in staging: a negative counter increment under preemption). The failure itself
    is stood in for by a raising _observe: LMCache's state behind it cannot be built here."""
    from kvops.plugin.offload.prom import OffloadPromMetrics

    def broken(self, data, engine_idx):
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    monkeypatch.setattr(OffloadPromMetrics, "_observe", broken)
    before = _sample("kvops_internal_errors_total", component="offload_metrics") or 0.0
    report = OffloadPromMetrics.__new__(OffloadPromMetrics)
    report.observe({"kvops_hit_tokens": -5})
    report.observe({"kvops_hit_tokens": -5})
    assert _sample("kvops_internal_errors_total", component="offload_metrics") == before + 2
