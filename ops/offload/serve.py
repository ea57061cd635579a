"""``kvops offload serve``: run one ``lmcache server`` in the foreground until told to stop.

Starts it with flags derived from the settings, waits for its health check, forwards its log to
our stdout, and on SIGTERM/SIGINT stops its whole process group (SIGTERM, then SIGKILL after a
grace period). If the server dies on its own we exit with an error naming its exit code, so a
process supervisor (systemd, Kubernetes) restarts both together.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from kvops.core.errors import KvopsError
from kvops.core.offload.l1_shm import pool_name, remove_pool
from kvops.core.offload.preflight import check_disk_dir
from kvops.core.offload.settings import OffloadSettings
from kvops.core.proc import log_tail, port_holder, port_in_use
from kvops.core.units import GIB
from kvops.ops.launch import ManagedServer
from kvops.ops.offload.server import lmcache_server
from kvops.ops.offload.shm import remove_stale_segments

STOP_GRACE_S = 20.0


def serve(
    settings: OffloadSettings, log_path: Path, ready_timeout_s: float,
    on_ready: Callable[[ManagedServer], None],
) -> int:
    """Run until a signal arrives (returns 0) or the server dies (raises KvopsError)."""
    freed = remove_stale_segments()
    if freed:
        sys.stderr.write(f"kvops: removed {freed / GIB:.2f} GiB of stale LMCache KV "
                         "segments from /dev/shm\n")
    if settings.disk_path is not None:
        _check_disk(settings)
    if settings.shared_l2_address is not None:
        check_resp_server(*settings.shared_l2_address)
    check_ports_free(settings)
    stale = remove_pool(pool_name(settings.port))  # its port is free: no server maps it now
    if stale:
        sys.stderr.write(f"kvops: removed a stale L1 pool of {stale / GIB:.2f} GiB from /dev/shm\n")
    server = lmcache_server(settings, log_path=log_path)
    sys.stderr.write(f"kvops: L1 transfer for engine_driven loads: {server.l1.mode}: {server.l1.reason}\n")
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    forwarder = _LogForwarder(log_path)
    forwarder.start()
    try:
        server.start(health_path="/healthcheck", timeout_s=ready_timeout_s)
        on_ready(server)
        while not stop.wait(0.5):
            code = server.returncode()
            if code is not None:
                raise KvopsError(
                    f"lmcache server exited with code {code} (log {log_path}): "
                    f"{log_tail(log_path, 3)}"
                )
        return 0
    finally:
        server.stop(grace_s=STOP_GRACE_S)
        forwarder.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_ports_free(settings: OffloadSettings) -> None:
    """One line naming whoever holds our ports (typically an lmcache server orphaned by a
    supervisor killed before the parent-death signal existed), instead of LMCache's bind
    traceback after it has loaded."""
    for field, port in (("port", settings.port), ("http_port", settings.http_port)):
        if not port_in_use(settings.host, port):
            continue
        holder = port_holder(port)
        who = "another process" if holder is None else f"pid {holder[0]} ({holder[1][:100]})"
        hint = "" if holder is None else f"stop it (kill {holder[0]}) or "
        orphan = " an lmcache server left running by an earlier `kvops offload serve`?" if (
            holder is not None and "lmcache" in holder[1]) else ""
        raise KvopsError(
            f"kvops.offload.{field} {port} on {settings.host} is already taken by {who}:{orphan} "
            f"{hint}choose free ports"
        )


def _check_disk(settings: OffloadSettings) -> None:
    from kvops.core.errors import BadInputError, KvopsPluginError

    try:
        check_disk_dir(str(settings.disk_path), settings.disk_gib)
    except KvopsPluginError as exc:
        raise BadInputError(str(exc)) from None


def check_resp_server(host: str, port: int, timeout_s: float = 5.0) -> None:
    """The shared L2 answers PING (RESP protocol: Redis, Valkey) before LMCache depends on it."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(b"PING\r\n")
            reply = conn.recv(64)
    except OSError as exc:
        raise KvopsError(
            f"shared L2 redis://{host}:{port} (kvops.offload.shared_l2) is not reachable: "
            f"{exc.strerror or exc}; start redis-server/valkey-server there or fix the address"
        ) from None
    if not reply.startswith(b"+PONG"):
        raise KvopsError(
            f"shared L2 redis://{host}:{port} answered {reply[:40]!r} to PING: it must speak RESP "
            "without auth (Redis or Valkey)"
        )


class _LogForwarder(threading.Thread):
    """Copies the server's log file to our stdout as it grows (the file stays for later)."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="lmcache-log", daemon=True)
        self.path = path
        self._stop_event = threading.Event()

    def run(self) -> None:
        offset = self.path.stat().st_size if self.path.exists() else 0
        while True:
            stopping = self._stop_event.is_set()
            offset = self._copy_from(offset)
            if stopping:
                return
            time.sleep(0.2)

    def _copy_from(self, offset: int) -> int:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
        except OSError:
            return offset
        if chunk:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return offset + len(chunk)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
