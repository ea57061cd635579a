"""Checks that run in vLLM's front end before it waits on the LMCache server.

LMCache's MP connector waits up to ``lmcache.mp.mq_timeout`` (300 s) for a server that is down,
and hangs on a transfer-mode mismatch (research/lmcache.md §5 pitfalls a, b). Everything that
can be known from the server's HTTP API (/healthcheck, /config) and from this machine (disk
directory, /dev/shm) is checked here first and turned into one-line ``KvopsPluginError``s.

The checks are pure functions of the server's /config JSON and of paths, so unit tests feed them
recorded configs; ``fetch_server_config`` is the only network call.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import KvopsPluginError
from kvops.core.offload.l1_shm import reserved_bytes, served_l1
from kvops.core.offload.settings import OffloadSettings, digest_budget_bytes
from kvops.core.units import GIB

SHM_PATH = Path("/dev/shm")
SERVE_HINT = "start it with `kvops offload serve --config kvops.yaml`"


@dataclass(frozen=True)
class ServerConfig:
    """What the live LMCache server reports about itself (GET /config, /config/adapters)."""

    port: int
    chunk_size: int
    transfer_mode: str
    hash_algorithm: str
    adapters: tuple[dict[str, Any], ...]
    """L2 adapters: /config's adapter settings, each with ``type_name`` from /config/adapters."""
    l1_shm_asked: str = ""
    """The server's ``--shm-name`` ("" without it)."""
    l1_pool: str = ""
    """The /dev/shm segment its L1 lives in ("" when private: engine_driven loads pickle)."""

    @classmethod
    def from_json(cls, config: dict[str, Any], adapters: dict[str, Any]) -> ServerConfig:
        mp = config["mp"]
        settings = config["storage_manager"]["l2_adapter_config"]["adapters"]
        types = [a.get("type_name", "?") for a in adapters.get("adapters", [])]
        merged = tuple(
            {**entry, "type_name": types[i] if i < len(types) else "?"}
            for i, entry in enumerate(settings)
        )
        asked, pool = served_l1(config)
        return cls(
            port=int(mp["port"]), chunk_size=int(mp["chunk_size"]),
            transfer_mode=str(mp["supported_transfer_mode"]),
            hash_algorithm=str(mp["hash_algorithm"]), adapters=merged,
            l1_shm_asked=asked, l1_pool=pool,
        )


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - our URL
        return json.loads(resp.read().decode())


def fetch_server_config(settings: OffloadSettings) -> ServerConfig:
    """Health-check the LMCache server and read its configuration, within timeout_s."""
    base = settings.http_url
    try:
        health = _get_json(base + "/healthcheck", settings.timeout_s)
        config = _get_json(base + "/config", settings.timeout_s)
        adapters = _get_json(base + "/config/adapters", settings.timeout_s)
    except urllib.error.HTTPError as exc:
        raise KvopsPluginError(
            f"LMCache server at {base} is not healthy (HTTP {exc.code} from {exc.url}): "
            f"check its log or restart it ({SERVE_HINT})"
        ) from None
    except (OSError, ValueError) as exc:
        raise KvopsPluginError(
            f"LMCache server not reachable at {base} (kvops.offload.host/http_port): "
            f"{_reason(exc)}; {SERVE_HINT}"
        ) from None
    if health.get("status") != "healthy":
        raise KvopsPluginError(f"LMCache server at {base} reports {health}: check its log")
    try:
        return ServerConfig.from_json(config, adapters)
    except (KeyError, TypeError, ValueError) as exc:
        raise KvopsPluginError(
            f"LMCache server at {base} returned an unexpected /config ({exc!r}): "
            "kvops supports lmcache 0.5.6"
        ) from None


def check_still_serving(settings: dict[str, Any]) -> None:
    """In an engine process, just before LMCache's connector connects: the server the front
    end's preflight found still answers its health check (seconds, not LMCache's mq_timeout)."""
    if not settings:
        return
    offload = OffloadSettings.model_validate(settings)  # the front end's model_dump()
    http_url = offload.http_url
    try:
        health = _get_json(http_url + "/healthcheck", offload.timeout_s)
    except (OSError, ValueError) as exc:
        raise KvopsPluginError(f"{http_url}/healthcheck: {_reason(exc)}") from None
    if health.get("status") != "healthy":
        raise KvopsPluginError(f"{http_url}/healthcheck reports {health}")


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return " ".join(str(reason).split()) or type(exc).__name__


def check_server(settings: OffloadSettings, server: ServerConfig, block_size: int) -> None:
    """The server we reached is the one the settings describe, and vLLM can talk to it."""
    where = f"LMCache server at {settings.http_url}"
    if server.port != settings.port:
        raise KvopsPluginError(
            f"{where} serves KV on port {server.port} but kvops.offload.port is {settings.port}: "
            "make them equal"
        )
    if server.transfer_mode not in ("auto", settings.transfer_mode):
        raise KvopsPluginError(
            f"{where} accepts only transfer mode {server.transfer_mode!r} but "
            f"kvops.offload.transfer_mode is {settings.transfer_mode!r} (vLLM would hang for "
            "300 s): restart the server with --supported-transfer-mode auto or change the setting"
        )
    if server.chunk_size != settings.chunk_size:
        raise KvopsPluginError(
            f"{where} uses chunk size {server.chunk_size} but kvops.offload.chunk_size is "
            f"{settings.chunk_size}: make them equal"
        )
    if server.chunk_size % block_size:
        raise KvopsPluginError(
            f"{where} chunk size {server.chunk_size} is not a multiple of vLLM's block size "
            f"{block_size}: set kvops.offload.chunk_size to a multiple and restart the server"
        )
    if settings.disk_gib is not None:
        _check_evicting_disk_tier(settings, server, where)
    if settings.shared_l2_address is not None:
        host, port = settings.shared_l2_address
        if not any(a.get("type_name") == "resp" and (a.get("host"), a.get("port")) == (host, port)
                   for a in server.adapters):
            raise KvopsPluginError(
                f"{where} does not use the shared L2 {settings.shared_l2} "
                "(kvops.offload.shared_l2): restart it with `kvops offload serve` from the same "
                "settings"
            )


def _check_evicting_disk_tier(settings: OffloadSettings, server: ServerConfig, where: str) -> None:
    """A disk cap only holds when the server's L2 adapter evicts (plain `fs` never does)."""
    wanted = _resolved(settings.disk_path)
    for adapter in server.adapters:
        if _resolved(adapter.get("base_path")) != wanted:
            continue
        evicts = adapter.get("eviction_config") not in (None, "", "None")
        if adapter.get("type_name") != "fs_native" or not evicts:
            raise KvopsPluginError(
                f"{where} stores {wanted} with a {adapter.get('type_name')!r} adapter without "
                "eviction, so kvops.offload.disk_gib would not be respected: restart it with "
                "`kvops offload serve` (fs_native + LRU)"
            )
        cap = adapter.get("max_capacity_gb")
        if cap is None or abs(float(cap) - float(settings.disk_gib or 0)) > 1e-9:
            raise KvopsPluginError(
                f"{where} caps {wanted} at {cap} GiB but kvops.offload.disk_gib is "
                f"{settings.disk_gib}: make them equal"
            )
        return
    raise KvopsPluginError(
        f"{where} has no disk tier at {wanted} (kvops.offload.disk_path): restart it with "
        "`kvops offload serve` from the same settings"
    )


def _resolved(path: Any) -> str:
    return str(Path(str(path)).expanduser().resolve()) if path else ""


def check_disk_dir(path: str, cap_gib: float | None) -> None:
    """The disk tier's directory exists (or can be made), takes writes, and has room for the cap."""
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvopsPluginError(
            f"kvops.offload.disk_path {str(directory)!r} is not writable ({exc.strerror or exc}): "
            "choose a writable directory on a local SSD"
        ) from None
    problem = disk_write_problem(directory)
    if problem is not None:
        raise KvopsPluginError(
            f"kvops.offload.disk_path {str(directory)!r} is not writable ({problem}): "
            "choose a writable directory on a local SSD"
        )
    if cap_gib is None:
        return
    usage = shutil.disk_usage(directory)
    room_bytes = usage.free + _tree_bytes(directory) + _digest_bytes(directory)
    digests = digest_budget_bytes(cap_gib)  # the block digest file beside it (integrity.py)
    if room_bytes < cap_gib * GIB + digests:
        raise KvopsPluginError(
            f"kvops.offload.disk_gib is {cap_gib:g} GiB (plus {digests / (1 << 20):.0f} MiB of "
            f"block checksums beside it) but {str(directory)!r} has only "
            f"{room_bytes / GIB:.2f} GiB free (including what the cache already holds): lower "
            "disk_gib or free space"
        )


def _digest_bytes(directory: Path) -> int:
    """What the block digest files beside the tier (``<dir>.kvops-digests.rankN``) hold now."""
    resolved = directory.resolve()
    total = 0
    for file in resolved.parent.glob(glob.escape(resolved.name) + ".kvops-digests.*"):
        try:
            total += file.stat().st_size
        except OSError:
            continue
    return total


def disk_write_problem(directory: Path, probe_bytes: int = 4096) -> str | None:
    """Why a small synced write into ``directory`` fails (its strerror), or None when it works.

    The same probe serves the preflight and the watch while serving (prom.py): a full disk or a
    read-only remount shows here as ENOSPC/EROFS, exactly what LMCache's own writes would get.
    """
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvops-probe-") as probe:
            probe.write(b"k" * probe_bytes)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def _tree_bytes(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def check_shm(kv_cache_bytes: int | None, shm: Path = SHM_PATH) -> None:
    """lmcache_driven moves vLLM's whole KV cache into one /dev/shm segment."""
    if kv_cache_bytes is None:
        raise KvopsPluginError(
            "kvops.offload.transfer_mode lmcache_driven needs a known KV cache size to check "
            "/dev/shm: set --kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE)"
        )
    free = _free(shm)
    if free < kv_cache_bytes:
        raise KvopsPluginError(
            f"kvops.offload.transfer_mode lmcache_driven needs {kv_cache_bytes / GIB:.2f} GiB in "
            f"{shm} but {free / GIB:.2f} GiB are free: enlarge {shm} (docker --shm-size) or "
            "use transfer_mode engine_driven"
        )


@dataclass(frozen=True)
class TransferChoice:
    """The transfer mode the connector will use, and one line saying why."""

    mode: str
    reason: str


def choose_transfer_mode(wanted: str, server_mode: str, kv_cache_bytes: int | None,
                         device: str, shm: Path = SHM_PATH, shared_l1: str | None = None) -> TransferChoice:
    """Resolve ``transfer_mode``: an explicit mode is kept (its own checks refuse what cannot
    work). auto on a CPU KV cache takes engine_driven where the server's L1 is a /dev/shm segment
    this worker maps (``shared_l1``: kvops.core.offload.l1_shm.describe_l1's line), so the worker
    copies loads itself (README "kvops' copy in the worker": 0.51-0.58 of memcpy, L1 hits 0.02 of
    a cold prefill, against zero-copy's 0.12-0.14 and 0.03); else zero-copy lmcache_driven
    wherever it can work; else engine_driven with L1 pickled."""
    if wanted != "auto":
        if wanted == "lmcache_driven":
            check_shm(kv_cache_bytes, shm)
            return TransferChoice(wanted, "set in kvops.offload.transfer_mode; " + huge_pages_note(shm))
        return TransferChoice(wanted, "set in kvops.offload.transfer_mode")
    if shared_l1 and device == "cpu" and server_mode != "lmcache_driven":
        return TransferChoice("engine_driven", (
            "the server's L1 is shared with this worker, so it copies loads itself (0.51-0.58 of "
            "memcpy against zero-copy's 0.12-0.14, README \"kvops' copy in the worker\")"))
    fallback = _no_zero_copy(server_mode, kv_cache_bytes, device, shm)
    if fallback is None:
        assert kv_cache_bytes is not None
        return TransferChoice("lmcache_driven", (
            f"zero-copy: the KV cache ({kv_cache_bytes / GIB:.2f} GiB) fits the free space of "
            f"{shm} ({_free(shm) / GIB:.2f} GiB) and {_why_not_shared(shared_l1, server_mode)}; "
            f"{huge_pages_note(shm)}"))
    if server_mode == "lmcache_driven":
        raise KvopsPluginError(
            f"the LMCache server accepts only lmcache_driven but it cannot work here ({fallback}): "
            "restart it with --supported-transfer-mode auto (`kvops offload serve` does)")
    return TransferChoice("engine_driven", fallback)


def _why_not_shared(shared_l1: str | None, server_mode: str) -> str:
    """Why auto did not take engine_driven from a shared L1 (the CPU case zero-copy serves)."""
    if shared_l1 and server_mode == "lmcache_driven":
        return "the server accepts only lmcache_driven, so its shared L1 goes unused"
    return "the server's L1 is not shared with this worker (its loads would be pickled)"


SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def shm_huge_pages(shm: Path = SHM_PATH, mounts: Path = Path("/proc/mounts"),
                   shmem_enabled: Path = SHMEM_ENABLED) -> str | None:
    """The ``huge=`` policy of the tmpfs holding ``shm`` ("never" when the mount names none, as
    tmpfs defaults; the kernel's ``deny`` or ``force`` overrides every mount), or None when it
    is not a tmpfs or the mount table cannot be read."""
    try:
        override = re.search(r"\[(deny|force)\]", shmem_enabled.read_text())
    except OSError:
        override = None
    try:
        table = mounts.read_text()
    except OSError:
        return None
    target, best = str(shm.resolve()) if shm.exists() else str(shm), None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (
                best is None or len(point) >= len(best[0])):
            best = (point, fields[2], fields[3])
    if best is None or best[1] != "tmpfs":
        return None
    if override:
        return override.group(1)
    options = dict(option.partition("=")[::2] for option in best[2].split(","))
    return options.get("huge") or "never"


NO_HUGE_PAGES = ("never", "deny", "advise")
"""Policies under which vLLM's KV segment gets 4 KiB pages (advise counts: neither vLLM nor
LMCache asks for huge pages)."""


def huge_pages_note(shm: Path = SHM_PATH, mounts: Path = Path("/proc/mounts"),
                    shmem_enabled: Path = SHMEM_ENABLED) -> str:
    """What zero-copy loads pay for the pages of vLLM's KV segment in ``shm``, in a few words."""
    policy = shm_huge_pages(shm, mounts, shmem_enabled)
    if policy is None:
        return f"huge pages of {shm}: unknown (not a tmpfs, or /proc/mounts unreadable)"
    if policy not in NO_HUGE_PAGES:
        return f"{shm} uses huge pages (huge={policy})"
    return f"{shm} has no huge pages (huge={policy}): {huge_pages_fix(policy, shm)}"


def huge_pages_fix(policy: str, shm: Path = SHM_PATH) -> str:
    """Why a policy of NO_HUGE_PAGES slows zero-copy loads, and what gives ``shm`` huge pages."""
    fix = ("the kernel's transparent_hugepage/shmem_enabled is deny" if policy == "deny" else
           f"`mount -o remount,huge=within_size {shm}` gives it 2 MiB pages")
    return (f"the LMCache server's first load into each 4 KiB page of vLLM's KV faults it in; "
            f"{fix} (faster loads: kvops bench offload)")


def _no_zero_copy(server_mode: str, kv_cache_bytes: int | None, device: str,
                  shm: Path) -> str | None:
    """Why lmcache_driven cannot be used here, or None when it can."""
    if server_mode == "engine_driven":
        return "the LMCache server accepts only engine_driven"
    if device != "cpu":
        return (f"the KV cache is on {device}: zero-copy through {shm} is for a CPU KV cache "
                "(the only one measured here)")
    if kv_cache_bytes is None:
        return (f"the KV cache size is unknown, so {shm} cannot be checked: set "
                "--kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE) for zero-copy")
    free = _free(shm)
    if free < kv_cache_bytes:
        return (f"{shm} has {free / GIB:.2f} GiB free and the KV cache needs "
                f"{kv_cache_bytes / GIB:.2f} GiB (enlarge it: docker --shm-size)")
    return None


def _free(shm: Path) -> int:
    """Free bytes less what LMCache L1 pools there will still fill (kvops.core.offload.l1_shm)."""
    try:
        return max(0, shutil.disk_usage(shm).free - reserved_bytes(shm))
    except OSError:
        return 0


def cpu_kv_cache_bytes(kv_cache_memory_bytes: int | None, env: dict[str, str]) -> int | None:
    """The CPU KV cache size vLLM will allocate: --kv-cache-memory-bytes, else
    VLLM_CPU_KVCACHE_SPACE (GiB), else unknown (vLLM sizes it from free memory)."""
    if kv_cache_memory_bytes:
        return int(kv_cache_memory_bytes)
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    try:
        gib = float(space)
    except ValueError:
        return None
    return int(gib * GIB) if gib > 0 else None
