"""LMCache's L1 pool in /dev/shm, so the vLLM worker copies engine_driven loads itself.

``lmcache server --shm-name NAME`` puts L1 in the POSIX segment NAME (lmcache
``v1/multiprocess/engine_context.py:327-345``); an engine_driven worker maps it once and scatters
each loaded object from it (``transfer_context/worker_transfer.py:859-1007``). Without it every
L1 object is pickled through ZMQ (``modules/server_transfer.py:66``): 1-1.5% of memcpy and ~49k
server page faults per hit against 1-10 with it (README "Who should copy a load").

The segment is sparse: tmpfs counts its pages only as they fill, so free space alone would let
two pools (or a pool and vLLM's zero-copy KV segment) promise the same room twice, and the one
that fills last dies of SIGBUS. What a live pool has not filled yet counts as taken here.
LMCache unlinks the segment when it closes and replaces a stale one of its name at start; a
server killed with -9 leaves it behind, so ``kvops offload serve`` removes ours on both ends.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.offload.settings import OffloadSettings
from kvops.core.units import GIB

SHM_PATH = Path("/dev/shm")
POOL_PREFIX = "lmcache_l1_pool_"
"""LMCache prefixes every L1 segment name with it (lmcache ``l1_memory_manager.py:72-79``)."""
PICKLED_COST = "each L1 object is pickled through ZMQ (1-1.5% of memcpy)"


@dataclass(frozen=True)
class L1Transfer:
    """How engine_driven loads leave L1: from a shared segment or pickled, and why."""

    shm_name: str | None
    """``--shm-name`` for the server; None: L1 stays private memory."""
    reason: str

    @property
    def mode(self) -> str:
        return "shm" if self.shm_name else "pickled"


def pool_name(port: int) -> str:
    """One segment per server: two servers on one host cannot share a ZMQ port."""
    return f"{POOL_PREFIX}kvops_{port}"


def l1_bytes(l1_gib: float) -> int:
    """L1's size as LMCache computes it from --l1-size-gb (lmcache ``distributed/config.py``)."""
    return int(l1_gib * GIB)


def choose_l1_transfer(settings: OffloadSettings, shm: Path = SHM_PATH) -> L1Transfer:
    """Share L1 when the mode is engine_driven or auto and ``shm`` has room for the whole pool
    beside what other pools there have reserved; otherwise L1 stays private, with the reason.

    Under auto a shared pool is what makes vLLM's CPU worker pick engine_driven and copy loads
    itself (kvops.core.offload.preflight.choose_transfer_mode: 0.51-0.58 of memcpy against
    zero-copy's 0.12-0.14, README "kvops' copy in the worker"); without room, auto goes on to
    zero-copy (lmcache_driven), which needs no pool."""
    mode = settings.transfer_mode
    if mode == "lmcache_driven":
        return L1Transfer(None, "lmcache_driven: the server copies into vLLM's KV segment itself")
    name = pool_name(settings.port)
    need = l1_bytes(settings.l1_gib)
    room = shm_room_bytes(shm, replacing=name)
    if room < need:
        then = ("so a CPU vLLM under auto takes zero-copy (lmcache_driven) where /dev/shm holds its "
                f"KV cache, else engine_driven with {PICKLED_COST}" if mode == "auto" else
                f"so {PICKLED_COST}")
        return L1Transfer(None, (
            f"{shm} has {room / GIB:.2f} GiB free beside the L1 pools there and L1 needs "
            f"{need / GIB:.2f} GiB, {then}: enlarge {shm} (docker --shm-size) or lower l1_gib"))
    return L1Transfer(name, (
        f"L1 ({need / GIB:.2f} GiB) shared through {shm / name} ({room / GIB:.2f} GiB free "
        "there): the vLLM worker copies loads from it"
        + (" (a CPU vLLM under auto takes engine_driven for it)" if mode == "auto" else "")))


def shm_room_bytes(shm: Path = SHM_PATH, replacing: str | None = None) -> int:
    """Free bytes of ``shm`` less what live L1 pools there have reserved but not filled; the
    pool named ``replacing`` is stale (LMCache unlinks it before creating its own) and counts
    as free."""
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return 0
    held = 0
    for path in shm.glob(POOL_PREFIX + "*"):
        size, filled = _sizes(path)
        if path.name == replacing:
            free += filled
        else:
            held += max(0, size - filled)
    return max(0, free - held)


def reserved_bytes(shm: Path = SHM_PATH) -> int:
    """What L1 pools in ``shm`` will still fill (the zero-copy KV check subtracts it)."""
    return sum(max(0, size - filled) for size, filled in map(_sizes, shm.glob(POOL_PREFIX + "*")))


def _sizes(path: Path) -> tuple[int, int]:
    """Apparent size and bytes filled of a tmpfs file (0, 0 when it vanished)."""
    try:
        stat = path.stat()
    except OSError:
        return 0, 0
    return stat.st_size, stat.st_blocks * 512


def remove_pool(name: str, shm: Path = SHM_PATH) -> int:
    """Unlink our pool once its server is gone (LMCache unlinks it on a clean close; a SIGKILL
    leaves it); returns the bytes it held."""
    path = shm / name
    _size, filled = _sizes(path)
    try:
        path.unlink()
    except OSError:
        return 0
    return filled


def served_l1(config: dict[str, Any]) -> tuple[str, str]:
    """From an LMCache server's /config: the segment name it asked for (``mp.shm_name``) and
    the one its L1 uses ("" when private: LMCache drops the name where /dev/shm lacks room,
    lmcache ``v1/multiprocess/server.py:436-460``, and ignores it for a lazy L1)."""
    asked = str(config.get("mp", {}).get("shm_name") or "")
    managers = config.get("storage_manager", {}).get("l1_manager_configs") or []
    if len(managers) != 1:
        return asked, ""
    memory = managers[0].get("memory_config") or {}
    if memory.get("use_lazy") or memory.get("devdax_path"):
        return asked, ""
    name = str(memory.get("shm_name") or "").lstrip("/")
    if name and not name.startswith(POOL_PREFIX):
        name = POOL_PREFIX + name
    return asked, name


def describe_l1(server_pool: str, server_asked: str, local: bool, shm: Path = SHM_PATH) -> L1Transfer:
    """What an engine_driven worker of vLLM will get from the server it reached: ``shm`` when
    the server's L1 is a segment this machine sees, ``pickled`` with the reason otherwise
    (LMCache's worker falls back to pickle where it cannot map it, with only a log line)."""
    if server_pool:
        if local and (shm / server_pool).exists():
            return L1Transfer(server_pool, f"L1 shared through {shm / server_pool}: the worker "
                              "copies loads from it")
        where = "another host" if not local else f"a {shm} this process does not see"
        return L1Transfer(None, f"L1 pickled: the server's pool {server_pool} is on {where}, "
                          f"so {PICKLED_COST}")
    if server_asked:
        return L1Transfer(None, f"L1 pickled: the server asked for {server_asked} but LMCache "
                          f"found too little room in {shm} and keeps L1 private, so "
                          f"{PICKLED_COST}")
    return L1Transfer(None, (
        "L1 pickled: the server runs without --shm-name (`kvops offload serve` adds it for "
        f"transfer_mode auto and engine_driven where {shm} has room for L1, and logs why not), "
        f"so {PICKLED_COST}"))
