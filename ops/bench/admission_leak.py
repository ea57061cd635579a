"""Clients that hang up at each phase of a request, and what they leave behind in the server.

A killed client closes its socket at one of four moments: before its request's headers are
complete, while the engine computes the prompt, in the middle of a stream, or while it waits for
a non-streamed answer. Each must leave nothing behind in the API server: no in-flight request,
no tenant slot, no memory that grows with the number of such clients. ``hang_up`` sends one;
``leak_check`` measures the API server's RSS before and after (on Linux, /proc) and what
vLLM's and the plugin's gauges still count. The e2e test and ``kvops bench admission`` both use
it, on real servers.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from kvops.core.errors import KvopsError
from kvops.ops.bench.admission_load import scrape_counter

PHASES = ("before_headers", "prefill", "mid_stream", "non_streaming")
LONG_PROMPT = "the cache holds keys and values for every token " * 60  # ~600 tokens
WARM_UP = 20
"""Hang-ups per phase before the first RSS reading: first-use caches and allocator arenas are
not leaks."""
BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "kvops_admission_tenant_in_flight")
MIB = 1 << 20


def _raw_request(url: str, path: str, body: dict[str, Any], tenant: str) -> tuple[socket.socket, bytes]:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"x-kvops-tenant: {tenant}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    return socket.create_connection((host, int(port)), timeout=60), head + data


def hang_up(url: str, model: str, phase: str, tenant: str = "leaky") -> None:
    """One client that goes away at ``phase`` (the socket closed, as a killed client does)."""
    if phase not in PHASES:
        raise KvopsError(f"unknown hang-up phase {phase!r} (known: {', '.join(PHASES)})")
    stream = phase == "mid_stream"
    body = {"model": model, "prompt": LONG_PROMPT if phase == "prefill" else "hello",
            "max_tokens": 200, "ignore_eos": True, "stream": stream}
    conn, request = _raw_request(url, "/v1/completions", body, tenant)
    with conn:
        if phase == "before_headers":
            conn.sendall(request[: request.index(b"\r\n") + 2])  # the request line, no headers
            return
        conn.sendall(request)
        if phase == "mid_stream":
            if b"data:" not in conn.recv(65536) and b"data:" not in conn.recv(65536):
                raise KvopsError(f"{url}: a streamed completion sent no event before the hang-up")
        elif phase == "non_streaming":
            time.sleep(0.05)  # accepted and decoding, no byte of the answer sent yet
        # prefill: gone right after sending, while the engine computes the prompt


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KvopsError(f"/proc/{pid}/status has no VmRSS line: is {pid} a live process on Linux?")


def busy(url: str) -> float:
    """What vLLM and the plugin still count as running, waiting or holding a tenant slot."""
    return sum(scrape_counter(url, name) for name in BUSY_GAUGES)


def wait_idle(url: str, timeout_s: float = 180) -> float:
    """Seconds until nothing is counted busy; raises when that never happens."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if busy(url) == 0:
            return time.monotonic() - began
        time.sleep(1)
    raise KvopsError(f"{url}: requests of hung-up clients still counted after {timeout_s:.0f} s")


def leak_check(url: str, model: str, pid: int, per_phase: int) -> dict[str, Any]:
    """``per_phase`` hang-ups at every phase after a warm-up; RSS growth of the API server
    (process ``pid``) and the requests still counted once the server settled."""
    for phase in PHASES:
        for _ in range(WARM_UP):
            hang_up(url, model, phase)
    wait_idle(url)
    before = rss_bytes(pid)
    began = time.monotonic()
    for phase in PHASES:
        for _ in range(per_phase):
            hang_up(url, model, phase)
    sent_s = time.monotonic() - began
    settle_s = wait_idle(url)
    return {
        "hang_ups_per_phase": per_phase,
        "phases": list(PHASES),
        "rss_growth_mib": (rss_bytes(pid) - before) / MIB,
        "still_busy": busy(url),
        "send_s": sent_s,
        "settle_s": settle_s,
    }
