"""Beyond one machine: two vLLM servers, each with its own LMCache server, share one
Redis-protocol L2 (Debian's redis-server on loopback). A prefix computed on one is a hit on
the other, with the same greedy output."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest

from kvops.ops.launch import ManagedServer, free_port, lmcache_server
from kvops.plugin.offload.settings import OffloadSettings

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


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    executable = shutil.which("redis-server")
    assert executable, "redis-server is missing: apt-get install redis-server (make setup)"
    port = free_port()
    root = tmp_path_factory.mktemp("redis")
    with open(root / "redis.log", "wb") as log:
        proc = subprocess.Popen(  # noqa: S603 - our argv
            [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(root)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_for("redis-server", lambda: _pong(port), timeout_s=30)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def two_lmcache(redis_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[OffloadSettings, ManagedServer]]]:
    root = tmp_path_factory.mktemp("shared")
    pairs = []
    try:
        for name in ("a", "b"):
            settings = OffloadSettings(port=free_port(), http_port=free_port(), l1_gib=0.25,
                                       shared_l2=f"redis://127.0.0.1:{redis_port}", heartbeat_s=1)
            server = lmcache_server(settings, log_path=root / f"lmcache-{name}.log", name=f"lmcache-{name}")
            server.start(health_path="/healthcheck", timeout_s=240)
            pairs.append((settings, server))
        yield pairs
    finally:
        for _, server in pairs:
            server.stop()


def test_prefix_computed_on_one_server_is_a_hit_on_the_other(vllm, tiny_model, two_lmcache):
    servers = [
        vllm(tiny_model, "--max-model-len", "2048", "--enable-prompt-tokens-details",
             "--additional-config", json.dumps({"kvops": {"offload": settings.model_dump()}}))
        for settings, _ in two_lmcache
    ]
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
