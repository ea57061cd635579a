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
