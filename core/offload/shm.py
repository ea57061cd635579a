"""Zero-copy (lmcache_driven) leaves vLLM's KV segment in /dev/shm after vLLM exits
(research/offload_bench.md caveat 6: a 4 GiB /dev/shm/lmcache_kv_<pid>_0 stayed behind; a
server killed with -9 leaves it too). Segments are named after the vLLM worker's pid, so those
whose process is gone are garbage: the plugin removes them at start-up and at exit."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvops.core.proc import stat_fields

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
    """The process exists and is not a zombie (a killed worker whose new parent has not reaped
    it yet holds its pid but no longer its segment)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _state(pid) != "Z"


def _state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (None when it cannot be read)."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def descendants(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """Every live process below ``pid`` (Linux /proc children lists; empty elsewhere)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        for children in proc.glob(f"{current}/task/*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def remove_own_segments_at_exit(owner: int, wait_s: float = 5.0,
                                shm_dir: Path = Path("/dev/shm")) -> int:
    """At the front end's exit: the segments of its own workers once they are gone, and any
    stale segment. Returns the bytes freed.

    Its workers are its descendants and, once vLLM's shutdown has killed the engine core above
    them (a worker is then re-parented and no descendant any more), the segment owners still in
    its process group: a SIGTERM to the front end alone left the worker's segment behind."""
    import time

    mine = descendants(owner) | _in_group(_segment_owners(shm_dir), owner)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(
            _alive(pid) for pid in _segment_owners(shm_dir) & mine):
        time.sleep(0.1)
    return remove_stale_segments(shm_dir)


def _segment_owners(shm_dir: Path) -> set[int]:
    owners = set()
    for path in shm_dir.glob("lmcache_kv_*"):
        match = SEGMENT.match(path.name)
        if match:
            owners.add(int(match.group(1)))
    return owners


def _in_group(pids: set[int], owner: int) -> set[int]:
    """Those of ``pids`` in ``owner``'s process group."""
    try:
        group = os.getpgid(owner)
    except ProcessLookupError:
        return set()
    found = set()
    for pid in pids:
        try:
            if os.getpgid(pid) == group:
                found.add(pid)
        except ProcessLookupError:
            continue
    return found
