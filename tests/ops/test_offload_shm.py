"""Stale zero-copy segments: only those whose owning process is gone are removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvops.ops.offload.shm import remove_stale_segments, stale_segments


def test_only_segments_of_dead_processes_are_removed(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f"lmcache_kv_{dead_pid}_0").write_bytes(b"x" * 100)
    (tmp_path / f"lmcache_kv_{os.getpid()}_0").write_bytes(b"y" * 10)
    (tmp_path / "other_segment").write_bytes(b"z")
    assert [p.name for p in stale_segments(tmp_path)] == [f"lmcache_kv_{dead_pid}_0"]
    assert remove_stale_segments(tmp_path) == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"lmcache_kv_{os.getpid()}_0", "other_segment"]


def test_exit_cleanup_waits_for_its_own_worker_then_removes_its_segment(tmp_path: Path):
    """A real child process owns a segment: the front end's exit hook waits for it to die (as a
    group SIGTERM makes it, a moment later) and then removes the segment."""
    import threading

    from kvops.core.offload.shm import descendants, remove_own_segments_at_exit

    worker = subprocess.Popen(["sleep", "30"])
    try:
        segment = tmp_path / f"lmcache_kv_{worker.pid}_0"
        segment.write_bytes(b"x" * 4096)
        assert worker.pid in descendants(os.getpid())
        threading.Timer(0.5, worker.kill).start()
        threading.Timer(0.6, worker.wait).start()
        assert remove_own_segments_at_exit(os.getpid(), wait_s=10, shm_dir=tmp_path) == 4096
        assert not segment.exists()
    finally:
        worker.kill()
        worker.wait()


def test_a_zombie_owner_is_stale(tmp_path: Path):
    """A killed worker that nobody has reaped yet keeps its pid but not its segment."""
    import time

    from kvops.core.offload.shm import _state

    child = subprocess.Popen(["true"])  # exits at once; not waited for: a zombie
    try:
        deadline = time.monotonic() + 10
        while _state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(child.pid) == "Z"
        (tmp_path / f"lmcache_kv_{child.pid}_0").write_bytes(b"x")
        assert [p.name for p in stale_segments(tmp_path)] == [f"lmcache_kv_{child.pid}_0"]
    finally:
        child.wait()


def test_exit_cleanup_takes_the_segment_of_a_worker_no_longer_below_it(tmp_path: Path):
    """vLLM's shutdown kills the engine core above the worker first: the worker, re-parented, is
    no descendant of the front end any more but still in its process group. Its segment must go
    too (a SIGTERM to the front end alone left /dev/shm/lmcache_kv_<worker>_0 behind)."""
    import signal
    import threading

    from kvops.core.offload.shm import descendants, remove_own_segments_at_exit

    shell = subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
                           capture_output=True, text=True, check=True)
    orphan = int(shell.stdout)  # its shell exited: re-parented, same process group as us
    try:
        assert orphan not in descendants(os.getpid())
        assert os.getpgid(orphan) == os.getpgid(os.getpid())
        segment = tmp_path / f"lmcache_kv_{orphan}_0"
        segment.write_bytes(b"x" * 4096)
        threading.Timer(0.5, os.kill, (orphan, signal.SIGKILL)).start()
        assert remove_own_segments_at_exit(os.getpid(), wait_s=10, shm_dir=tmp_path) == 4096
        assert not segment.exists()
    finally:
        try:
            os.kill(orphan, signal.SIGKILL)
        except ProcessLookupError:
            pass
