"""The default transfer mode on a CPU (issue 43): under transfer_mode auto `kvops offload serve`
starts the server with --shm-name, vLLM resolves auto to engine_driven because that L1 is shared
with its worker, the worker maps the pool and copies an L1 hit from it with kvops' per-block
copy, and the output is the plugin-free server's; the segment is gone once serve stops. Zero-copy
(lmcache_driven, auto's choice before) still serves right when set explicitly.

Oracles are external: LMCache's /config and its worker's own log lines (which context it built),
LMCache's L1 hit counter, vLLM's cached-token count and the greedy output of a server without
the plugin.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kvops.ops.launch import ManagedServer

from .conftest import STOCK
from .test_offload_e2e import (
    CHUNK_TOKENS,
    Lmcache,
    cached_tokens,
    complete,
    metric,
    offload_want,
    reset_vllm_prefix_cache,
    token_prompt,
    wait_for,
)

pytestmark = pytest.mark.e2e
SERVERS = (STOCK,)


@pytest.fixture(scope="module")
def shm_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    server = Lmcache(tmp_path_factory.mktemp("l1shm"))  # transfer_mode auto: the default
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def zero_copy_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    server = Lmcache(tmp_path_factory.mktemp("zero-copy"), transfer_mode="lmcache_driven")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shm_vllm(vllm, tiny_model, shm_lmcache) -> ManagedServer:
    offload, _stock = vllm.many(offload_want(tiny_model, shm_lmcache), STOCK.on(tiny_model))
    return offload


@pytest.fixture(scope="module")
def stock_output(vllm, tiny_model) -> str:
    stock = vllm(tiny_model, "--max-model-len", "2048", env={"VLLM_PLUGINS": "none"})
    return str(complete(stock.url, tiny_model, token_prompt(1))["choices"][0]["text"])


def pool(lmcache: Lmcache) -> Path:
    return Path("/dev/shm") / f"lmcache_l1_pool_kvops_{lmcache.settings['port']}"


def assert_l1_hit_is_stock(server: ManagedServer, lmcache: Lmcache, model: Path, stock_output: str) -> None:
    """A prompt computed once, dropped from vLLM's own cache, then served as an L1 hit of its two
    chunks (LMCache's counter, vLLM's cached tokens) with the plugin-free server's text."""
    prompt = token_prompt(1)
    cold = complete(server.url, model, prompt)
    wait_for("LMCache to hold the prefix in L1",
             lambda: metric(lmcache.url, "lmcache_mp_l1_write_chunks_total") >= 2)
    reset_vllm_prefix_cache(server)
    l1_hits = metric(lmcache.url, "lmcache_mp_lookup_hit_l1_tokens_total")
    hit = complete(server.url, model, prompt)

    assert cached_tokens(hit) == CHUNK_TOKENS
    assert metric(lmcache.url, "lmcache_mp_lookup_hit_l1_tokens_total") - l1_hits == CHUNK_TOKENS
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"] == stock_output
    assert metric(server.url, "kvops_offload_errors_total", kind="corrupt") == 0


def test_engine_driven_hit_is_copied_from_the_shared_l1_with_identical_output(
    shm_vllm, tiny_model, shm_lmcache, stock_output
):
    assert shm_lmcache.serve is not None
    serve_out = shm_lmcache.serve.log_path.read_text()
    assert "L1 transfer for engine_driven loads: shm" in serve_out, serve_out[-2000:]
    config = requests.get(shm_lmcache.url + "/config", timeout=10).json()
    assert config["mp"]["shm_name"] == pool(shm_lmcache).name
    assert pool(shm_lmcache).exists()
    log = shm_vllm.log_path.read_text(errors="replace")
    assert ("kvops offload: transfer mode engine_driven (auto: the server's L1 is shared with this "
            "worker, so it copies loads itself") in log, log[-3000:]
    assert "Creating EngineDrivenContextShm" in log, log[-3000:]
    assert "falling back to pickle" not in log
    # the worker copies with kvops' per-block copy (plugin/offload/worker_copy.py), and the
    # start-up canary's load through it returned the bytes stored (checksums per block)
    assert "engine_driven loads and stores copy with kvops' per-block copy" in log, log[-3000:]
    wait_for("the start-up canary", lambda: metric(
        shm_vllm.url, "kvops_offload_load_path_last_check_timestamp_seconds") > 0)
    assert metric(shm_vllm.url, "kvops_offload_load_path_ok") == 1
    info = metric(shm_vllm.url, "kvops_info", offload_transfer_mode="engine_driven",
                  offload_l1_transfer="shm")
    assert info == 1
    assert metric(shm_vllm.url, "kvops_offload_worker_copy", copy="kvops") == 1
    assert metric(shm_vllm.url, "kvops_offload_worker_copy", copy="lmcache") == 0

    assert_l1_hit_is_stock(shm_vllm, shm_lmcache, tiny_model, stock_output)


def test_engine_driven_disk_hit_goes_through_the_shared_l1_with_identical_output(
    shm_vllm, tiny_model, shm_lmcache, stock_output
):
    wait_for("the prefix on disk", lambda: metric(
        shm_lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total") >= 2)
    requests.post(shm_lmcache.url + "/cache/clear", timeout=30).raise_for_status()
    reset_vllm_prefix_cache(shm_vllm)
    l2_hits = metric(shm_lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total")

    hit = complete(shm_vllm.url, tiny_model, token_prompt(1))

    assert cached_tokens(hit) == CHUNK_TOKENS
    assert metric(shm_lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total") - l2_hits == CHUNK_TOKENS
    assert hit["choices"][0]["text"] == stock_output
    assert metric(shm_vllm.url, "kvops_offload_errors_total", kind="corrupt") == 0
    assert "falling back to pickle" not in shm_vllm.log_path.read_text(errors="replace")


def test_zero_copy_set_explicitly_serves_an_l1_hit_with_identical_output(
    vllm, tiny_model, zero_copy_lmcache, stock_output
):
    """lmcache_driven: no L1 pool; vLLM's KV cache lives in a /dev/shm segment of its worker that
    the LMCache server copies loads into."""
    import psutil

    server, _stock = vllm.many(offload_want(tiny_model, zero_copy_lmcache), STOCK.on(tiny_model))
    log = server.log_path.read_text(errors="replace")
    assert ("kvops offload: transfer mode lmcache_driven (lmcache_driven: set in "
            "kvops.offload.transfer_mode") in log, log[-3000:]
    assert not pool(zero_copy_lmcache).exists()
    assert server.process is not None
    pids = {server.process.pid} | {p.pid for p in psutil.Process(server.process.pid).children(recursive=True)}
    segments = [p.name for p in Path("/dev/shm").glob("lmcache_kv_*") if int(p.name.split("_")[2]) in pids]
    assert segments, sorted(p.name for p in Path("/dev/shm").glob("lmcache_*"))
    assert metric(server.url, "kvops_info", offload_transfer_mode="lmcache_driven") == 1

    assert_l1_hit_is_stock(server, zero_copy_lmcache, tiny_model, stock_output)
    # the LMCache server copies here: no worker copy to name
    assert "kvops_offload_worker_copy{" not in requests.get(server.url + "/metrics", timeout=10).text

    # SIGTERM to the front end alone (as Kubernetes sends it): the workers' segments go with them
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0
    wait_for("the workers' KV segments to be removed", lambda: not any(
        (Path("/dev/shm") / name).exists() for name in segments), timeout_s=30)


def test_the_l1_pool_is_removed_when_serve_stops(shm_lmcache):
    assert pool(shm_lmcache).exists()
    shm_lmcache.stop()
    assert not pool(shm_lmcache).exists()
