"""Start, wait for and stop real local servers (``vllm serve``, ``lmcache server``).

Used by the demo, the benches and the e2e tests alike, so that every one of them drives the
same real processes. Servers get a free loopback port chosen at run time, a log file, their own
process group (so stop() takes their children too) and a readiness timeout whose error carries
the tail of the log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from kvops.ops.errors import KvopsError

if TYPE_CHECKING:
    from kvops.plugin.offload.settings import OffloadSettings

DEFAULT_READY_TIMEOUT_S = 480.0
CPU_TEST_ENV: Mapping[str, str] = {
    # One of the two cores is reserved for the front end unless told otherwise.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class ServerStartError(KvopsError):
    """A server did not become ready; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def vllm_executable() -> str:
    """The `vllm` next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("vllm")
    if local.exists():
        return str(local)
    found = shutil.which("vllm")
    if not found:
        raise KvopsError("the `vllm` command is not installed: run `make setup`")
    return found


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


@dataclass
class ManagedServer:
    """One server process we started."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str]
    host: str = "127.0.0.1"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, health_path: str = "/health", timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(  # noqa: S603 - argv built by us
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )
        self.wait_ready(health_path, timeout_s)

    def wait_ready(self, health_path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.returncode()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {code} before it was ready "
                    f"(log {self.log_path}):\n{log_tail(self.log_path)}"
                )
            try:
                if requests.get(self.url + health_path, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"{self.name} was not ready after {timeout_s:.0f}s (log {self.log_path}):\n"
            f"{log_tail(self.log_path)}"
        )

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL after grace_s; returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers left in the group
        return proc.returncode


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def vllm_server(
    model: Path | str,
    args: Sequence[str] = (),
    *,
    log_path: Path,
    kv_cache_bytes: int | None = 1 << 30,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    name: str = "vllm",
) -> ManagedServer:
    """A not-yet-started `vllm serve` for the CPU build, eager mode, on a free port.

    The KV space is given in bytes with --kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE (whole
    GiB only) would override it (vllm/platforms/cpu.py), so it is removed from the environment.
    ``kv_cache_bytes=None`` leaves the flag out: vLLM then sizes KV from --gpu-memory-utilization
    minus what the worker holds (vllm/v1/worker/cpu_worker.py:233-258), which is what a
    calibration (kvops verify --calibration-out) measures.
    """
    chosen = port or free_port()
    full_env = {**os.environ, **CPU_TEST_ENV, **(env or {})}
    full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv = [
        vllm_executable(), "serve", str(model), "--host", "127.0.0.1", "--port", str(chosen),
        "--enforce-eager",
        *(["--kv-cache-memory-bytes", str(kv_cache_bytes)] if kv_cache_bytes is not None else []), *args,
    ]
    return ManagedServer(name=name, argv=argv, port=chosen, log_path=log_path, env=full_env)


def lmcache_executable() -> str:
    """The `lmcache` next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("lmcache")
    if local.exists():
        return str(local)
    found = shutil.which("lmcache")
    if not found:
        raise KvopsError("the `lmcache` command is not installed: run `make setup` (lmcache 0.5.6)")
    return found


def lmcache_server(
    settings: OffloadSettings,
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    name: str = "lmcache",
) -> ManagedServer:
    """A not-yet-started `lmcache server` for these offload settings; start() waits for
    GET /healthcheck on its HTTP port (the ZMQ port takes no HTTP)."""
    from kvops.ops.offload.server import LMCACHE_ENV, server_args

    full_env = {**os.environ, **LMCACHE_ENV, **(env or {})}
    argv = [lmcache_executable(), "server", *server_args(settings)]
    return ManagedServer(
        name=name, argv=argv, port=settings.http_port, log_path=log_path, env=full_env,
        host=settings.host,
    )
