"""A small open-loop load client for the admission bench and e2e tests.

Each request is one streaming ``/v1/completions`` call on its own thread, read line by line from
the raw socket (research/loadgen_bench.md: this reads TTFT within a few ms of the server's own,
where buffered readers add tens of ms). Arrivals follow a fixed schedule so that the stock and
the kvops servers receive the same offered load. Every request ends in exactly one Outcome:
an HTTP status with its body, or ``lost`` (no answer, a broken stream, a timeout).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvops.core.prom import samples_by_name, selector_sum


@dataclass(frozen=True)
class Outcome:
    status: int
    """HTTP status; 0 when no status arrived (connection refused, reset, timed out)."""
    ttft_s: float | None
    e2e_s: float
    output_tokens: int
    finished: bool
    """A 200 stream that reached ``data: [DONE]`` with a finish_reason."""
    retry_after: str | None = None
    error: str = ""

    @property
    def lost(self) -> bool:
        return self.status == 0 or (self.status == 200 and not self.finished)


def stream_completion(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> Outcome:
    """POST a streaming completion and read it to the end."""
    parts = urlsplit(url)
    start = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        payload = json.dumps(
            {**body, "stream": True, "stream_options": {"include_usage": True}}
        ).encode()
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            return Outcome(resp.status, None, time.perf_counter() - start, 0, False,
                           resp.getheader("Retry-After"), text[:500])
        return _read_stream(resp, start)
    except (OSError, http.client.HTTPException) as exc:
        return Outcome(0, None, time.perf_counter() - start, 0, False, None, repr(exc))
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, start: float) -> Outcome:
    ttft: float | None = None
    tokens = 0
    finish_reason = None
    done = False
    while True:
        raw = resp.readline()
        if not raw:
            break
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return Outcome(200, ttft, time.perf_counter() - start, tokens, False, None,
                           str(chunk["error"])[:500])
        if chunk.get("usage"):
            tokens = int(chunk["usage"].get("completion_tokens") or 0)
        for choice in chunk.get("choices", []):
            if ttft is None:
                ttft = time.perf_counter() - start
            finish_reason = choice.get("finish_reason") or finish_reason
    return Outcome(200, ttft, time.perf_counter() - start, tokens, done and finish_reason is not None)


def open_loop(
    url: str, bodies: Sequence[dict[str, Any]], arrivals_s: Sequence[float], timeout_s: float = 300.0
) -> list[Outcome]:
    """Send ``bodies[i]`` at ``arrivals_s[i]`` seconds after the start, whatever the server does."""
    results: list[Outcome | None] = [None] * len(bodies)

    def one(i: int) -> None:
        results[i] = stream_completion(url, bodies[i], timeout_s)

    threads = []
    t0 = time.perf_counter()
    for i, at in enumerate(arrivals_s):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout_s + 30)
    return [r if r is not None else Outcome(0, None, timeout_s, 0, False, None, "client thread hung")
            for r in results]


def scrape_counter(url: str, name: str) -> float:
    """Sum of a Prometheus counter/gauge's samples on a server's /metrics (0.0 when absent)."""
    return scrape_sums(url, (name,))[name]


def scrape_sums(url: str, names: Sequence[str]) -> dict[str, float]:
    """``scrape_counter`` for several names (or ``name{label="value"}`` selectors) from one read
    of /metrics."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    by_name = samples_by_name(text)
    return {name: selector_sum(by_name, name) for name in names}


def closed_loop(
    url: str, make_body: Callable[[int], dict[str, Any]], concurrency: int, per_worker: int,
    timeout_s: float = 300.0,
) -> tuple[list[Outcome], float]:
    """``concurrency`` workers each send ``per_worker`` requests back to back (request k gets
    ``make_body(k)``); returns the outcomes and the wall time, for throughput at a load the
    server can carry."""
    results: list[Outcome] = []
    lock = threading.Lock()

    def worker(first: int) -> None:
        for k in range(first, first + per_worker):
            outcome = stream_completion(url, make_body(k), timeout_s)
            with lock:
                results.append(outcome)

    threads = [
        threading.Thread(target=worker, args=(w * per_worker,), daemon=True)
        for w in range(concurrency)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(per_worker * timeout_s)
    return results, time.perf_counter() - start
