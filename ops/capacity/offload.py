"""LMCache L1 (CPU DRAM) and disk sizes from the prefix working set.

Offload pays only for KV that is read again: the working set is the distinct shared prefixes ×
their KV bytes. LMCache stores KV in chunks of ``chunk_size`` tokens across every TP rank
(research/lmcache.md), so a prefix costs ``cdiv(tokens, chunk) × chunk × bytes/token × ranks``.
The recommendation holds the whole working set plus LRU headroom in L1 when host memory allows,
and spills the rest to disk. With no reuse (no prefixes given, or zero-length prefixes) it says
offload cannot help instead of sizing a cache that would never hit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvops.core.plan import OffloadAdvice
from kvops.ops.capacity.constants import GIB

LRU_HEADROOM = 1.25  # LRU evicts early under churn; keep a quarter more than the working set
LMCACHE_CHUNK_TOKENS = 256  # kvops.core.offload.settings.OffloadSettings.chunk_size default
GIB_STEP = 0.5  # sizes are rounded up to half a GiB


@dataclass(frozen=True)
class OffloadInputs:
    distinct_prefixes: int
    prefix_tokens: int
    kv_bytes_per_token_per_rank: int
    ranks: int
    gpu_kv_bytes: int  # the GPU KV pool of one rank, for the "already fits on GPU" check
    host_memory_gib: float | None = None  # L1 cap; the rest goes to disk
    chunk_tokens: int = LMCACHE_CHUNK_TOKENS


def _round_up(gib: float) -> float:
    return math.ceil(gib / GIB_STEP) * GIB_STEP


def recommend_offload(inp: OffloadInputs) -> OffloadAdvice:
    """``lmcache_cpu_gib``/``lmcache_disk_gib`` (None when offload cannot help) and why."""
    if inp.distinct_prefixes <= 0 or inp.prefix_tokens <= 0:
        return OffloadAdvice(lmcache_cpu_gib=None, lmcache_disk_gib=None, working_set_gib=0.0,
                             warning="no prefix reuse given (--distinct-prefixes/--prefix-tokens): offload "
                                     "cannot help a workload that never repeats a prefix; leave it off")
    chunks = math.ceil(inp.prefix_tokens / inp.chunk_tokens)
    per_prefix = chunks * inp.chunk_tokens * inp.kv_bytes_per_token_per_rank * inp.ranks
    working_set = inp.distinct_prefixes * per_prefix
    wanted = _round_up(working_set * LRU_HEADROOM / GIB)
    l1 = wanted if inp.host_memory_gib is None else min(wanted, _round_down(inp.host_memory_gib))
    # inclusive: LMCache writes every chunk to every tier (ops/capacity/tiers.py), so the disk
    # tier holds the whole working set, not the part beyond L1
    disk = wanted if wanted > l1 else None
    warning = None
    if working_set * 2 <= inp.gpu_kv_bytes * inp.ranks:
        warning = ("the working set fits in half of the GPU KV pool: vLLM's own prefix cache already "
                   "holds it; offload adds restart persistence and headroom under load, not hits")
    if l1 <= 0:
        warning = "--host-memory-gib leaves no L1; LMCache needs an L1 tier in front of disk"
    return OffloadAdvice(
        lmcache_cpu_gib=l1, lmcache_disk_gib=disk, working_set_gib=working_set / GIB,
        bytes_per_prefix=per_prefix, chunk_tokens=inp.chunk_tokens,
        why=(f"{inp.distinct_prefixes} prefixes × {chunks} chunks of {inp.chunk_tokens} tokens × "
             f"{inp.kv_bytes_per_token_per_rank * inp.ranks:,} B/token = {working_set / GIB:.2f} GiB, "
             f"× {LRU_HEADROOM} LRU headroom"),
        warning=warning)


def _round_down(gib: float) -> float:
    return math.floor(gib / GIB_STEP) * GIB_STEP
