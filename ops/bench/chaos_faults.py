"""The faults ``kvops bench chaos`` produces for real around a vLLM + kvops offload server.

Each fault has an inject and a clear step acting on real processes and a real file system: the
``lmcache server`` killed (then restarted on the same ports and directory) or frozen with
SIGSTOP (then SIGCONT), the disk tier (a small tmpfs that also holds the block digest file) made
full, read-only, or deleted, and clients hanging up at every phase of a request. The disk faults
need root (mount -t tmpfs; chmod does not stop root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvops.core.errors import BadInputError, KvopsError
from kvops.core.offload.settings import OffloadSettings
from kvops.ops.launch import ManagedServer
from kvops.ops.offload.server import lmcache_server

TMPFS_MIB = 24
"""Room for the disk cap the preflight checks (16 MiB) and the digest file beside it."""
HANG_UP_PHASES = ("before_headers", "prefill", "mid_stream", "non_streaming")


@dataclass
class Rig:
    """The live processes and paths the faults act on."""

    root: Path
    settings: OffloadSettings
    lmcache: ManagedServer
    vllm: ManagedServer
    model: str
    mount: Path | None = None
    lmcache_starts: int = 1
    hang_ups_stop: threading.Event = field(default_factory=threading.Event)
    hang_up_thread: threading.Thread | None = None

    @property
    def disk(self) -> Path:
        assert self.settings.disk_path is not None
        return Path(self.settings.disk_path)

    def restart_lmcache(self) -> None:
        self.lmcache.stop(grace_s=5)
        self.lmcache_starts += 1
        self.lmcache = lmcache_server(self.settings, log_path=self.root / f"lmcache-{self.lmcache_starts}.log")
        self.lmcache.start(health_path="/healthcheck", timeout_s=240)


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[Rig], None]
    clear: Callable[[Rig], None]
    needs_root: bool = False
    why: str = ""


def _lmcache_pid(rig: Rig) -> int:
    process = rig.lmcache.process
    if process is None or process.poll() is not None:
        raise KvopsError(f"the lmcache server is not running before the fault (log {rig.lmcache.log_path})")
    return process.pid


def _kill_lmcache(rig: Rig) -> None:
    os.killpg(_lmcache_pid(rig), signal.SIGKILL)
    assert rig.lmcache.process is not None
    rig.lmcache.process.wait(timeout=30)


def _stop_lmcache(rig: Rig) -> None:
    os.killpg(_lmcache_pid(rig), signal.SIGSTOP)


def _cont_lmcache(rig: Rig) -> None:
    os.killpg(_lmcache_pid(rig), signal.SIGCONT)


def _filler(rig: Rig) -> Path:
    return rig.disk.parent / "chaos-filler"


def _fill_disk(rig: Rig) -> None:
    """Write until the tmpfs has no byte left (unbuffered: close() must not raise ENOSPC)."""
    with open(_filler(rig), "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * (1 << 20))
        except OSError:
            pass


def _free_disk(rig: Rig) -> None:
    _filler(rig).unlink(missing_ok=True)


def remount(mount: Path, mode: str) -> None:
    """`mount -o remount,ro` fails with EBUSY while a file is open for writing: retry briefly."""
    for _ in range(50):
        done = _run("mount", "-o", f"remount,{mode}", str(mount))
        if done.returncode == 0:
            return
        time.sleep(0.2)
    raise KvopsError(f"mount -o remount,{mode} {mount}: {done.stderr.strip()}")


def _read_only(rig: Rig) -> None:
    assert rig.mount is not None
    remount(rig.mount, "ro")


def _read_write(rig: Rig) -> None:
    assert rig.mount is not None
    remount(rig.mount, "rw")


def _delete_disk(rig: Rig) -> None:
    shutil.rmtree(rig.disk)


def _recreate_disk(rig: Rig) -> None:
    rig.disk.mkdir(parents=True, exist_ok=True)


def _start_hang_ups(rig: Rig) -> None:
    rig.hang_ups_stop.clear()
    rig.hang_up_thread = threading.Thread(target=_hang_up_loop, args=(rig,), daemon=True, name="chaos-hang-ups")
    rig.hang_up_thread.start()


def _stop_hang_ups(rig: Rig) -> None:
    rig.hang_ups_stop.set()
    if rig.hang_up_thread is not None:
        rig.hang_up_thread.join(timeout=120)


def _hang_up_loop(rig: Rig) -> None:
    count = 0
    while not rig.hang_ups_stop.is_set():
        try:
            hang_up(rig.vllm.host, rig.vllm.port, rig.model, HANG_UP_PHASES[count % len(HANG_UP_PHASES)])
        except OSError:
            time.sleep(0.1)  # the server refused: the load's own requests say what that cost
        count += 1


def hang_up(host: str, port: int, model: str, phase: str) -> None:
    """One client that goes away at ``phase`` (the socket closed, as a killed client does)."""
    stream = phase == "mid_stream"
    prompt = "the cache holds keys and values for every token " * (60 if phase == "prefill" else 1)
    data = json.dumps({"model": model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True,
                       "stream": stream}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n").encode() + data
    with socket.create_connection((host, port), timeout=60) as conn:
        if phase == "before_headers":
            conn.sendall(request[: request.index(b"\r\n") + 2])
            return
        conn.sendall(request)
        if phase == "mid_stream":
            conn.recv(65536)
        elif phase == "non_streaming":
            time.sleep(0.05)


def _nothing(rig: Rig) -> None:
    """The control: the same load and probes with no fault, so a fault's counts compare with
    what this machine gives without one."""


FAULTS: dict[str, Fault] = {fault.name: fault for fault in (
    Fault("none", _nothing, _nothing, why="no fault: the control run of the same load"),
    Fault("lmcache_kill", _kill_lmcache, Rig.restart_lmcache,
          why="lmcache server SIGKILLed, restarted on the same ports and disk"),
    Fault("lmcache_stop", _stop_lmcache, _cont_lmcache, why="lmcache server SIGSTOPped, then SIGCONT"),
    Fault("disk_full", _fill_disk, _free_disk, needs_root=True,
          why="the disk tier's tmpfs (digest file included) filled to ENOSPC, then freed"),
    Fault("disk_read_only", _read_only, _read_write, needs_root=True,
          why="the disk tier's tmpfs remounted read-only, then read-write"),
    Fault("disk_deleted", _delete_disk, _recreate_disk, needs_root=True,
          why="the disk tier's directory deleted while serving, then made again"),
    Fault("client_disconnects", _start_hang_ups, _stop_hang_ups,
          why="clients hanging up before headers, during prefill, mid-stream and non-streaming"),
)}


def choose(names: str) -> list[Fault]:
    """The faults a ``--faults a,b`` option names (empty: all), in the order given."""
    wanted = [n.strip() for n in names.split(",") if n.strip()] or list(FAULTS)
    unknown = [n for n in wanted if n not in FAULTS]
    if unknown:
        raise BadInputError(f"--faults: unknown fault {unknown[0]!r}: choose from {', '.join(FAULTS)}")
    chosen = [FAULTS[n] for n in dict.fromkeys(wanted)]
    if any(f.needs_root for f in chosen) and os.geteuid() != 0:
        raise BadInputError("--faults: the disk faults need root (mount -t tmpfs, remount ro): run as root "
                            "or leave out " + ", ".join(f.name for f in chosen if f.needs_root))
    return chosen


def mount_tmpfs(mount: Path) -> None:
    mount.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m", "kvops-chaos", str(mount))
    if done.returncode != 0:
        raise KvopsError(f"mount -t tmpfs {mount}: {done.stderr.strip()}")


def unmount(mount: Path) -> None:
    _run("mount", "-o", "remount,rw", str(mount))
    _run("umount", "-l", str(mount))


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
