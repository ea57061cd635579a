"""Beyond one machine: two vLLM servers, each with its own LMCache server, share one
Redis-protocol L2 (Debian's redis-server on loopback). A prefix computed on one is a hit on
the other, with the same greedy output."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kvops.core.offload.settings import OffloadSettings
from kvops.core.proc import free_port
from kvops.ops.launch import ManagedServer
from kvops.ops.offload.server import lmcache_server

from .conftest import Want
from .test_offload_e2e import (
    CHUNK_TOKENS,
    cached_tokens,
    complete,
    metric,
    token_prompt,
    wait_for,
)

pytestmark = pytest.mark.e2e


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class Redis:
    """A real redis-server on loopback that a test can kill and start again on the same port."""

    def __init__(self, root: Path) -> None:
        executable = shutil.which("redis-server")
        assert executable, "redis-server is missing: apt-get install redis-server (make setup)"
        self.executable, self.root, self.port = executable, root, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.root / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - our argv
                [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.root)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        wait_for("redis-server", lambda: _pong(self.port), timeout_s=30)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    server = Redis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
            server.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def redis_port(redis: Redis) -> int:
    return redis.port


@pytest.fixture(scope="module")
def two_lmcache(redis_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[OffloadSettings, ManagedServer]]]:
    root = tmp_path_factory.mktemp("shared")
    pairs = []
    taken: set[int] = set()  # promised to the other server, not bound yet
    try:
        for name in ("a", "b"):
            port = free_port(taken=frozenset(taken))
            http_port = free_port(taken=frozenset({*taken, port}))
            taken |= {port, http_port}
            settings = OffloadSettings(port=port, http_port=http_port, l1_gib=0.25,
                                       shared_l2=f"redis://127.0.0.1:{redis_port}", heartbeat_s=1)
            server = lmcache_server(settings, log_path=root / f"lmcache-{name}.log", name=f"lmcache-{name}")
            server.launch()  # side by side: one start's time
            pairs.append((settings, server))
        for _, server in pairs:
            server.wait_ready("/healthcheck", 240)
            server.settle()
        yield pairs
    finally:
        for _, server in pairs:
            server.stop()


def test_prefix_computed_on_one_server_is_a_hit_on_the_other(vllm, tiny_model, two_lmcache):
    servers = vllm.many(*(  # side by side: one start's time
        Want(tiny_model, ("--max-model-len", "2048", "--enable-prompt-tokens-details",
                          "--additional-config", json.dumps({"kvops": {"offload": settings.model_dump()}})))
        for settings, _ in two_lmcache))
    (_, lmcache_a), (_, lmcache_b) = two_lmcache
    prompt = token_prompt(7)

    first = complete(servers[0].url, tiny_model, prompt)
    assert cached_tokens(first) == 0
    wait_for("server A to push the prefix to the shared L2", lambda: metric(
        lmcache_a.url, "lmcache_mp_l2_store_completed_objects_chunks_total") >= 2)
    shared_hits = metric(lmcache_b.url, "lmcache_mp_lookup_hit_l2_tokens_total")

    second = complete(servers[1].url, tiny_model, prompt)

    assert cached_tokens(second) == CHUNK_TOKENS
    assert metric(lmcache_b.url, "lmcache_mp_lookup_hit_l2_tokens_total") - shared_hits == CHUNK_TOKENS
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_redis_killed_mid_run_recomputes_says_so_and_a_restarted_lmcache_stores_again(
        vllm, tiny_model, two_lmcache, redis):
    """The shared L2 dies while serving: requests are still answered, with the same output as
    before; LMCache's stores to it stop completing and the plugin's
    kvops_offload_server_unstored_chunks{tier="l2"} says so; the engine and LMCache stay up.
    LMCache 0.5.6 does not reconnect to a Redis that comes back (measured: 100 new prefixes
    over two minutes after the restart, every store failed), so the runbook's remedy is a
    restart of the LMCache server, after which vLLM, not restarted, stores to it again."""
    (settings_a, lmcache_a), _ = two_lmcache
    server = vllm(tiny_model, "--max-model-len", "2048", "--enable-prompt-tokens-details",
                  "--additional-config", json.dumps({"kvops": {"offload": settings_a.model_dump()}}))
    stores = "lmcache_mp_l2_store_completed_objects_chunks_total"
    before = complete(server.url, tiny_model, token_prompt(7))["choices"][0]["text"]
    redis.kill()
    completed = metric(lmcache_a.url, stores)

    out = complete(server.url, tiny_model, token_prompt(8))  # a new prefix: its L2 store fails

    wait_for("the plugin to report chunks not stored in the dead L2", lambda: metric(
        server.url, "kvops_offload_server_unstored_chunks", tier="l2") > 0, timeout_s=60)
    assert metric(lmcache_a.url, stores) == completed
    assert out["choices"][0]["text"]
    assert complete(server.url, tiny_model, token_prompt(7))["choices"][0]["text"] == before
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert lmcache_a.returncode() is None

    redis.start()
    lmcache_a.stop()
    lmcache_a.start(health_path="/healthcheck", timeout_s=240)
    fresh = itertools.count(9_000)
    wait_for("a new prefix stored in the shared L2 by the restarted LMCache", lambda: bool(
        complete(server.url, tiny_model, token_prompt(next(fresh)), max_tokens=1))
        and metric(lmcache_a.url, stores) > 0, timeout_s=120)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
