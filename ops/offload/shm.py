"""Zero-copy (lmcache_driven) leaves vLLM's KV segment in /dev/shm after vLLM exits
(research/offload_bench.md caveat 6: a 4 GiB /dev/shm/lmcache_kv_<pid>_0 stayed behind).
Segments are named after the vLLM worker's pid, so those whose process is gone are garbage."""

from __future__ import annotations

import os
import re
from pathlib import Path

SEGMENT = re.compile(r"^lmcache_kv_(\d+)_\d+$")


def stale_segments(shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """LMCache KV segments whose owning process no longer exists."""
    stale = []
    for path in sorted(shm_dir.glob("lmcache_kv_*")):
        match = SEGMENT.match(path.name)
        if match and not _alive(int(match.group(1))):
            stale.append(path)
    return stale


def remove_stale_segments(shm_dir: Path = Path("/dev/shm")) -> int:
    """Unlink stale segments; returns the bytes freed."""
    freed = 0
    for path in stale_segments(shm_dir):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        freed += size
    return freed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
