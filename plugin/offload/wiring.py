"""Front-end wiring: turn the kvops ``offload`` section into vLLM's kv_transfer_config.

Runs inside the platform config hook (vllm/config/vllm.py:1991), before any engine process
starts, so a wrong setup stops ``vllm serve`` at once instead of after LMCache's 300 s timeout.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvops.core.errors import KvopsPluginError
from kvops.core.offload.l1_shm import L1Transfer, describe_l1
from kvops.core.offload.preflight import (
    ServerConfig,
    TransferChoice,
    check_disk_dir,
    check_server,
    choose_transfer_mode,
    cpu_kv_cache_bytes,
    fetch_server_config,
)
from kvops.core.offload.settings import OffloadSettings
from kvops.plugin.offload import CONNECTOR_NAME
from kvops.plugin.offload.inprocess import (
    IN_PROCESS_CONNECTOR,
    apply_lmcache_env,
    kernels_problem,
    kernels_reason,
    names_in_process_connector,
    unsupported_reason,
)

logger = logging.getLogger("vllm.plugins.kvops.offload")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
IN_PROCESS_WARNED_ENV = "KVOPS_IN_PROCESS_WARNED"
KVOPS_EXTRA_KEY = "kvops.offload"
"""Extra-config key that carries the settings to the connector and its metrics (all processes)."""
L1_TRANSFER_KEY = "kvops.offload.l1_transfer"
"""Extra-config key with how engine_driven loads leave L1: shm or pickled ("" in lmcache_driven)."""


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def ensure_connector(
    vllm_config: Any, settings: OffloadSettings | None, device_type: str | None = None
) -> None:
    """With offload settings and no --kv-transfer-config, use our connector (one flag is enough).

    Must run before vLLM's platform hook: the CPU platform sizes its core reservation from the
    connector (vllm/platforms/cpu.py, "reserve one more core for nixl_connector").
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    device = device_type or _device_type()
    in_process_on_cpu = device == "cpu" and names_in_process_connector(transfer)
    if settings is None:
        if names_in_process_connector(transfer) and os.environ.get(IN_PROCESS_WARNED_ENV) != "1":
            # Without a kvops offload section the operator has not asked kvops to manage
            # offload, and the plugin changes nothing unasked (it is loaded into every vLLM
            # process): so no refusal, but one loud line instead of LMCache's silent degradation.
            # vLLM rebuilds the config in the engine core, which inherits this environment:
            # the marker keeps it to one line per server.
            # The front end builds the config first: it logs the line and sets the gauge its
            # /metrics serves (the issue: no degraded mode without a loud error AND a metric).
            reason = _unasked_degradation(device)
            if reason is not None:
                logger.warning("kvops: %s", reason)
                os.environ[IN_PROCESS_WARNED_ENV] = "1"
                from kvops.plugin.metrics import gauge

                gauge(
                    "kvops_offload_in_process_degraded",
                    "1 when vLLM's in-process LMCache connector runs degraded: LMCache has no KV "
                    "connector for the device (no caching) or its compiled CUDA kernels do not "
                    "load (torch copies); see the kvops warning in the log",
                ).set(1)
            return
        if transfer is not None and transfer.kv_connector == CONNECTOR_NAME:
            raise KvopsPluginError(
                f"--kv-transfer-config names {CONNECTOR_NAME} but the kvops settings have no "
                "'offload' section: add --additional-config '{\"kvops\": {\"offload\": {...}}}'"
            )
        return
    if in_process_on_cpu:
        raise KvopsPluginError(unsupported_reason(device))
    wanted = IN_PROCESS_CONNECTOR if settings.lmcache_mode == "in_process" else CONNECTOR_NAME
    if settings.lmcache_mode == "in_process" and device == "cpu":
        raise KvopsPluginError(unsupported_reason(device))
    if settings.lmcache_mode == "in_process" and device != "cuda":
        raise KvopsPluginError(
            f"kvops.offload.lmcache_mode in_process is configured for CUDA only, not {device}: "
            "set lmcache_mode: server (KVOpsOffloadConnector + `kvops offload serve`)"
        )
    if transfer is None:
        from vllm.config import KVTransferConfig

        vllm_config.kv_transfer_config = KVTransferConfig(kv_connector=wanted, kv_role="kv_both")
        return
    if settings.lmcache_mode == "in_process":
        if not names_in_process_connector(transfer):
            raise KvopsPluginError(
                f"kvops.offload.lmcache_mode is in_process but --kv-transfer-config uses "
                f'{transfer.kv_connector!r}: use "kv_connector":"{IN_PROCESS_CONNECTOR}" or drop '
                "--kv-transfer-config"
            )
        return
    if transfer.kv_connector != CONNECTOR_NAME:
        raise KvopsPluginError(
            f"kvops.offload is set but --kv-transfer-config uses {transfer.kv_connector!r}: use "
            f'"kv_connector":"{CONNECTOR_NAME}" or drop the offload section'
        )


def _unasked_degradation(device: str) -> str | None:
    """Why vLLM's in-process LMCache connector, configured without kvops, runs degraded on this
    device, or None."""
    if device == "cpu":
        return unsupported_reason(device)
    if device == "cuda":
        problem = kernels_problem()
        return None if problem is None else kernels_reason(problem)
    return None


def configure(vllm_config: Any, settings: OffloadSettings) -> None:
    """Preflight against the live server, then write the connector's extra config."""
    if settings.lmcache_mode == "in_process":
        configure_in_process(vllm_config, settings)
        return
    block_size = int(vllm_config.cache_config.block_size)
    if settings.disk_path is not None and settings.host in LOCAL_HOSTS:
        check_disk_dir(settings.disk_path, settings.disk_gib)
    server = fetch_server_config(settings)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    settings = resolve_transfer_mode(vllm_config, settings, server, extra)
    check_server(settings, server, block_size)
    logger.info("kvops offload: LMCache server %s passed the preflight (transfer mode %s, "
                "chunk size %d)", settings.http_url, settings.transfer_mode, server.chunk_size)
    from kvops.plugin._compat import arm_engine_refusal

    arm_engine_refusal()  # LMCache can still die before the engine connects
    derived: dict[str, Any] = {
        "lmcache.mp.host": f"tcp://{settings.host}",
        "lmcache.mp.port": settings.port,
        "lmcache.mp.mq_timeout": settings.timeout_s,
        "lmcache.mp.heartbeat_interval": settings.heartbeat_s,
        "lmcache.mp.mp_transfer_mode": settings.transfer_mode,
        "lmcache.mp.hash_algorithm": server.hash_algorithm,
    }
    for key, value in derived.items():
        if key in extra and extra[key] != value:
            raise KvopsPluginError(
                f"kv_connector_extra_config {key}={extra[key]!r} contradicts the kvops offload "
                f"settings ({value!r}): remove it and set kvops.offload instead"
            )
        extra[key] = value
    extra[KVOPS_EXTRA_KEY] = settings.model_dump()
    # An offload tier is a cache: a failed load must recompute, not fail the request
    # (vllm/config/kv_transfer.py kv_load_failure_policy defaults to "fail").
    vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
    from kvops.plugin.offload.canary import install

    install(settings)  # the load-path canary: POST /kvops/offload/check and the periodic check


def resolve_transfer_mode(vllm_config: Any, settings: OffloadSettings, server: ServerConfig,
                          extra: dict[str, Any]) -> OffloadSettings:
    """transfer_mode auto -> the mode this server uses, said in one line (and in kvops_info's
    offload_transfer_mode and offload_l1_transfer labels, read from the extra config written
    here and below). The engine core rebuilds the config from the front end's: a mode already
    written there is kept (the front end's /dev/shm check decided it)."""
    decided = extra.get("lmcache.mp.mp_transfer_mode")
    if settings.transfer_mode == "auto" and decided in ("engine_driven", "lmcache_driven"):
        return settings.model_copy(update={"transfer_mode": decided})
    kv_bytes = cpu_kv_cache_bytes(
        getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None), dict(os.environ))
    l1 = describe_l1(server.l1_pool, server.l1_shm_asked, local=settings.host in LOCAL_HOSTS)
    choice = with_l1_transfer(
        choose_transfer_mode(settings.transfer_mode, server.transfer_mode, kv_bytes, _device_type(),
                             shared_l1=l1.shm_name),
        l1, extra)
    logger.info("kvops offload: transfer mode %s (%s: %s)", choice.mode, settings.transfer_mode,
                choice.reason)
    if choice.mode == "lmcache_driven":
        _clean_stale_segments()
    return settings.model_copy(update={"transfer_mode": choice.mode})


def with_l1_transfer(choice: TransferChoice, l1: L1Transfer, extra: dict[str, Any]) -> TransferChoice:
    """engine_driven: whether its loads read L1 from the server's /dev/shm segment or get it
    pickled, added to the reason line and written for kvops_info (never a silent slow path)."""
    if choice.mode != "engine_driven":
        extra[L1_TRANSFER_KEY] = ""
        return choice
    extra[L1_TRANSFER_KEY] = l1.mode
    if l1.shm_name is None:
        logger.warning("kvops offload: engine_driven %s", l1.reason)
    return TransferChoice(choice.mode, f"{choice.reason}; {l1.reason}")


def _clean_stale_segments() -> None:
    """Segments of servers that died (kill -9) hold /dev/shm: free them now, and our workers'
    at exit (waiting a moment for them: a SIGTERM to the group reaches them with us)."""
    import atexit

    from kvops.core.offload.shm import remove_own_segments_at_exit, remove_stale_segments

    freed = remove_stale_segments()
    if freed:
        logger.warning("kvops offload: removed %.2f GiB of stale LMCache KV segments from "
                       "/dev/shm (servers that did not exit cleanly)", freed / (1 << 30))
    atexit.register(remove_own_segments_at_exit, os.getpid())


def configure_in_process(vllm_config: Any, settings: OffloadSettings) -> None:
    """LMCacheConnectorV1 (CUDA): LMCache's compiled kernels must load, the same disk preflight,
    then LMCache's sizes as LMCACHE_* variables the engine processes inherit."""
    problem = kernels_problem()
    if problem is not None:
        raise KvopsPluginError(kernels_reason(problem))
    if settings.disk_path is not None:
        check_disk_dir(settings.disk_path, settings.disk_gib)
    apply_lmcache_env(os.environ, settings)
    logger.info("kvops offload: in-process LMCache (%s), L1 %.3g GiB, chunk size %d",
                IN_PROCESS_CONNECTOR, settings.l1_gib, settings.chunk_size)
    vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
