"""The ``offload`` section of kvops settings, shared by the plugin and ``kvops offload serve``.

One source of truth for both ends: the server flags that ``kvops offload serve`` derives and
the connector options the plugin derives come from the same fields, so a vLLM server and the
LMCache server started from one kvops.yaml agree on ports, chunk size and transfer mode.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvops.core.units import GIB

TransferMode = Literal["engine_driven", "lmcache_driven"]
TransferModeSetting = Literal["auto", "engine_driven", "lmcache_driven"]
ServerTransferMode = Literal["engine_driven", "lmcache_driven", "auto"]
LMCacheMode = Literal["server", "in_process"]

DIGEST_LINE_BYTES = 54
"""One line of the block digest file: 32 hex digits of key, a space, an xxh3_64 (<= 20 digits)."""
DIGEST_HEADER = "# kvops block digests: xxh3_64\n"
"""First line of a digest file; an earlier kvops wrote CRC32s without it: such a file is discarded."""
DIGEST_SHARE = 0.01
"""Block digests may take this share of disk_gib beside the disk tier (at least DIGEST_MIN_BYTES).
A block is >= 128 tokens of KV (kilobytes per token), a digest line 54 bytes, so 1% holds twice
the digests of a full tier even for tiny models (the file compacts at its budget)."""
DIGEST_MIN_BYTES = 1 << 20


def digest_budget_bytes(disk_gib: float | None) -> int:
    """Most bytes the block digest file beside a disk tier of ``disk_gib`` may hold."""
    share = 0 if disk_gib is None else int(disk_gib * GIB * DIGEST_SHARE)
    return max(DIGEST_MIN_BYTES, share)


class OffloadSettings(BaseModel):
    """Where the LMCache server is and how it stores KV (GiB are 2^30 bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf: never a setting

    lmcache_mode: LMCacheMode = "server"
    """Where LMCache runs. server: a separate ``lmcache server`` (``kvops offload serve``) and
    our KVOpsOffloadConnector over vLLM's LMCacheMPConnector; works on CPU and GPU. in_process:
    vLLM's LMCacheConnectorV1 inside the vLLM workers, sized from l1_gib, disk_path/disk_gib and
    chunk_size (kvops.plugin.offload.inprocess); CUDA only, refused elsewhere; no server needed,
    and host/ports/transfer modes/verify_kv/heartbeat_s and the kvops_offload_* metrics do not
    apply."""

    host: str = "127.0.0.1"
    """Host of the LMCache server (its ZMQ port and its HTTP API)."""
    port: int = Field(default=5555, ge=1, le=65535)
    """LMCache MP (ZMQ) port that vLLM's connector talks to."""
    http_port: int = Field(default=8080, ge=1, le=65535)
    """LMCache HTTP port: /healthcheck, /config, /status, /metrics, /cache/clear."""
    l1_gib: float = Field(default=4.0, gt=0)
    """L1 (CPU DRAM) size of the LMCache server."""
    disk_path: str | None = None
    """Directory of the fs_native disk tier (L2); no disk tier when unset."""
    disk_gib: float | None = Field(default=None, gt=0)
    """Cap of the disk tier; LRU eviction keeps usage under it. Required with disk_path."""
    eviction: Literal["LRU", "ARC"] = "LRU"
    """Eviction policy of L1 (the disk tier always evicts LRU)."""
    chunk_size: int = Field(default=256, gt=0)
    """Tokens per LMCache chunk; must be a multiple of vLLM's block size (128 on CPU)."""
    transfer_mode: TransferModeSetting = "auto"
    """How KV moves between vLLM and LMCache. engine_driven: the vLLM worker copies loads and
    stores itself; ``kvops offload serve`` puts L1 in /dev/shm where it has room for l1_gib and
    the worker copies from it (kvops' copy, 0.51-0.58 of memcpy: README "kvops' copy in the
    worker"), else L1 objects are pickled over ZMQ, said in one line (kvops.core.offload.l1_shm).
    lmcache_driven: zero-copy, the LMCache server copies into vLLM's KV cache mapped from
    /dev/shm (needs /dev/shm >= the KV cache; 0.12-0.14 of memcpy). auto: on a CPU, engine_driven
    where the server's L1 is shared with this worker, else lmcache_driven where the KV cache's
    size is known and fits the free /dev/shm and the server accepts it, else engine_driven
    (pickled); engine_driven on a GPU; the reason in one line
    (kvops.core.offload.preflight.choose_transfer_mode)."""
    worker_copy: Literal["kvops", "lmcache"] = "kvops"
    """Who copies engine_driven loads and stores between LMCache's L1 objects and vLLM's KV in
    the vLLM worker. kvops: one strided copy per layer and block (kvops.plugin.offload.worker_copy;
    vLLM CPU's fused K|V layout, anything else goes to LMCache's); lmcache: LMCache's own
    per-layer ``index_copy_``. Not used in lmcache_driven, where the server copies."""
    server_transfer_mode: ServerTransferMode = "auto"
    """What ``kvops offload serve`` lets the server accept ('auto' accepts both modes)."""
    timeout_s: float = Field(default=10.0, gt=0, le=300)
    """Preflight HTTP timeout and the connector's message-queue timeout (LMCache's is 300 s)."""
    shared_l2: str | None = Field(default=None, pattern=r"^(redis|valkey)://[^:/]+:\d+$")
    """A Redis/Valkey-protocol store (``redis://host:port``) used as a further L2 tier that
    several LMCache servers share, so vLLM instances reuse each other's prefixes."""
    verify_kv: bool = True
    """Checksum every block stored and check it on load, so a corrupt cache file is a miss
    (kvops.plugin.offload.integrity; CPU KV only)."""
    heartbeat_s: float = Field(default=2.0, gt=0, le=30)
    """How often the connector pings the server; a missed ping enters the degraded state."""
    load_wait_ms: float = Field(default=20.0, ge=0, le=1000)
    """How long the vLLM worker may sleep on a load LMCache has in flight, in a step that
    computes nothing (every scheduled request waits for its KV), instead of returning at once.
    vLLM steps every ~1.5 ms while loads run, and that spinning takes the CPU LMCache's copy
    needs on a machine with few cores (``kvops bench offload`` tuning row ``load_wait_ms=0``).
    The worker wakes as soon as the load is done; a request arriving meanwhile waits at most
    this long to be scheduled. 0: vLLM's own polling."""
    canary_interval_s: float = Field(default=300.0, ge=0)
    """Seconds between load-path canaries (kvops.plugin.offload.canary): the front end stores a
    synthetic one-chunk prefix, loads it back through the connector and checks it; the first
    runs at start-up, before the server answers; 0 turns both off (``kvops offload check``
    still runs it on demand)."""

    @model_validator(mode="after")
    def _disk_path_and_cap_together(self) -> OffloadSettings:
        if self.disk_gib is not None and self.disk_path is None:
            raise ValueError("disk_gib is set but disk_path is not: name the disk tier directory")
        if self.disk_path is not None and self.disk_gib is None:
            raise ValueError("disk_path is set but disk_gib is not: an uncapped disk tier fills "
                             "the disk; set disk_gib")
        return self

    @property
    def shared_l2_address(self) -> tuple[str, int] | None:
        if self.shared_l2 is None:
            return None
        host, _, port = self.shared_l2.split("://", 1)[1].rpartition(":")
        return host, int(port)

    @property
    def mp_url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"
