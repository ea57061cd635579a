"""Issue 43: who should copy an L1 load into vLLM's KV blocks, timed side by side in one process.

In lmcache_driven mode the `lmcache server` copies a load from its L1 object into vLLM's KV
segment (mapped from /dev/shm) the way its CPU fallback runs every transfer: a staging copy of
each 256-token object into a temp buffer, then one permuted ``index_copy_`` per layer and chunk
(lmcache/v1/multiprocess/object_group_transfer.py ``transfer_kv_per_object_group``, CPU branch;
lmcache/v1/platform/torch_ops/mp_mem_kernels.py ``_transfer_per_layer_fused``). The worker could
copy instead, if it could read the L1 object: LMCache's engine_driven mode with ``--shm-name``
puts L1 in POSIX shared memory and its worker scatters the slots itself
(lmcache/v1/multiprocess/transfer_context/base.py ``scatter_cpu_to_paged_kv``, the same per-layer
``index_copy_`` without the staging copy). kvops' own worker copy would be one strided torch copy
per layer and block: the object is token-major ([layer][token][head][K|V]), a vLLM CPU block
head-major ([head][token][K|V]), so each block is a transpose of 512-byte rows.

Each is timed on the reference load (8 layers, 32 KiB of KV per token, 2,048 tokens = 64 MiB,
block ids scattered over the KV as a real load's are) against a plain copy of the same bytes:
pre-faulted, and first-touch (the mapping the copying process shares with the other one has no
page-table entries yet, as after the LMCache server maps vLLM's segment, or a worker maps L1).
"""

from __future__ import annotations

import mmap
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

THREADS = (1, 2)
REPEATS = 5
FIRST_TOUCH_REPEATS = 3
BUDGET_S = 0.5
APPROACHES = {
    "lmcache_server": "LMCache's lmcache_driven transfer as its server runs it on CPU: staging copy, "
                      "then a permuted index_copy_ per layer and chunk (LMCache's own functions)",
    "lmcache_worker_scatter": "LMCache's engine_driven worker scatter from L1 shm slots "
                              "(scatter_cpu_to_paged_kv: the per-layer index_copy_, no staging)",
    "kvops_worker": "one torch copy per layer and block, object rows transposed into the block",
}
FIRST_TOUCH_SIDE = {"lmcache_server": "destination", "lmcache_worker_scatter": "source",
                    "kvops_worker": "source"}
"""The side a process maps from the other one: the server maps vLLM's KV, a worker maps L1."""


@dataclass(frozen=True)
class LoadShape:
    layers: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    block_tokens: int = 128
    chunk_tokens: int = 256
    tokens: int = 2048
    element_bytes: int = 2  # bf16

    @property
    def row_elems(self) -> int:
        """One token's K and V in one layer: every head's [K | V] (vLLM CPU keeps them fused)."""
        return self.kv_heads * 2 * self.head_dim

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_tokens

    @property
    def chunks(self) -> int:
        return self.tokens // self.chunk_tokens

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def object_bytes(self) -> int:
        return self.layers * self.chunk_tokens * self.row_elems * self.element_bytes

    @property
    def block_bytes(self) -> int:
        """One block of one layer."""
        return self.block_tokens * self.row_elems * self.element_bytes

    @property
    def load_bytes(self) -> int:
        return self.chunks * self.object_bytes


REFERENCE_LOAD = LoadShape()


def l1_objects(shape: LoadShape, flat: torch.Tensor) -> list[torch.Tensor]:
    """The load's L1 objects over ``flat`` (uint8): one per chunk, [1, layers, chunk_tokens,
    kv_heads x 2 x head_dim] as LMCache lays out vLLM CPU's KV (get_layout_desc →
    CPUCacheContext.get_kernel_group_shape_dtype: kv_size 1 for the fused K|V format)."""
    import torch

    typed = flat[:shape.load_bytes].view(torch.bfloat16)
    return list(typed.view(shape.chunks, 1, shape.layers, shape.chunk_tokens, shape.row_elems).unbind(0))


def kv_layers(shape: LoadShape, num_blocks: int, flat: torch.Tensor) -> list[torch.Tensor]:
    """vLLM CPU's KV over ``flat`` (uint8): per layer [num_blocks, kv_heads, block_tokens,
    2 x head_dim] (vllm/v1/attention/backends/cpu_attn.py get_kv_cache_shape, K and V fused)."""
    import torch

    typed = flat[:shape.layers * num_blocks * shape.block_bytes].view(torch.bfloat16)
    return list(typed.view(shape.layers, num_blocks, shape.kv_heads, shape.block_tokens,
                           2 * shape.head_dim).unbind(0))


def worker_copy(shape: LoadShape, objects: list[torch.Tensor], layers: list[torch.Tensor],
                block_ids: list[int]) -> None:
    """kvops' copy: for each layer and block, the block's tokens of the object (token-major) into
    the block (head-major) as one strided torch copy; no staging buffer, no index tensor."""
    bt = shape.block_tokens
    for chunk, obj in enumerate(objects):
        for layer, dst in enumerate(layers):
            rows = obj[0, layer].view(shape.blocks_per_chunk, bt, shape.kv_heads, 2 * shape.head_dim)
            for j in range(shape.blocks_per_chunk):
                dst[block_ids[chunk * shape.blocks_per_chunk + j]].copy_(rows[j].transpose(0, 1))


class _L1Object:
    """What LMCache's staging copy reads of an L1 MemoryObj (gpu_connector/gpu_ops.py
    lmcache_memcpy_async_h2d): its raw tensor (flat bytes), its size, its allocator (not a lazy
    one)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        import torch

        self.raw_tensor = tensor.reshape(-1).view(torch.uint8)

    def get_size(self) -> int:
        return int(self.raw_tensor.nbytes)

    def parent(self) -> None:
        return None


class _Wrapped:
    """What CPUCacheContext unwraps a registered KV tensor from (``to_tensor``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to_tensor(self) -> torch.Tensor:
        return self.tensor


def lmcache_server_copy(shape: LoadShape, layers: list[torch.Tensor]) -> Callable[
        [list[torch.Tensor], list[int]], None]:
    """LMCache's lmcache_driven transfer of one load, as its server runs it: a CPUCacheContext
    over vLLM's layers (the server builds one at registration) and the CPU branch of
    ``transfer_kv_per_object_group`` (no native object-group or batch-memcpy op on CPU)."""
    import torch
    from lmcache.lmcache_native import TransferDirection
    from lmcache.v1.multiprocess.object_group_transfer import transfer_kv_per_object_group
    from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext

    context = CPUCacheContext([_Wrapped(t) for t in layers],
                              lmcache_tokens_per_chunk=shape.chunk_tokens)

    def copy(objects: list[torch.Tensor], block_ids: list[int]) -> None:
        transfer_kv_per_object_group(
            context, [torch.tensor(block_ids, dtype=torch.long)],
            [_L1Object(o) for o in objects],
            object_group_id=0, batch_size=context.max_batch_size, skip_first_n_tokens=0,
            direction=TransferDirection.H2D, transfer_key="bench")

    return copy


def lmcache_worker_scatter(shape: LoadShape, objects: list[torch.Tensor], layers: list[torch.Tensor],
                           block_ids: list[int]) -> None:
    """LMCache's engine_driven worker copy from shm slot views into the paged KV."""
    from lmcache.v1.multiprocess.transfer_context.base import scatter_cpu_to_paged_kv

    scatter_cpu_to_paged_kv({f"layer.{i}": t for i, t in enumerate(layers)}, block_ids, objects,
                            shape.blocks_per_chunk)


@contextmanager
def _mapped(nbytes: int) -> Iterator[tuple[mmap.mmap, torch.Tensor]]:
    """A shared mapping of a /dev/shm file, as vLLM's KV segment and LMCache's L1 pool are,
    filled through this mapping (so the pages exist) and viewed as uint8."""
    import torch

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=folder) as handle:
        handle.truncate(nbytes)
        mapping = mmap.mmap(handle.fileno(), nbytes)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        flat.fill_(1)
        yield mapping, flat
        del flat  # the tensor exports the mapping's buffer: drop it first (gc may hold views)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_s(run: Callable[[], None], before: Callable[[], None] = lambda: None,
            repeats: int = REPEATS) -> float:
    """Best of ``repeats``, or of 2 once they have taken BUDGET_S (a copy that runs 20x slower
    than the others, as LMCache's on 2 threads beside a busy core, would otherwise take the
    bench's time)."""
    best, spent = float("inf"), 0.0
    for done in range(1, repeats + 1):
        before()
        started = time.perf_counter()
        run()
        took = time.perf_counter() - started
        best, spent = min(best, took), spent + took
        if done >= 2 and spent > BUDGET_S:
            break
    return best


def measure(shape: LoadShape = REFERENCE_LOAD, threads: tuple[int, ...] = THREADS,
            repeats: int = REPEATS, seed: int = 0) -> dict[str, Any]:
    """Each approach's best-of-``repeats`` time for one load and its share of a plain copy of the
    same bytes (numpy, pre-faulted, as the bench's ``memcpy_gb_per_s``), per torch thread count;
    ``first_touch_*`` with the shared side's page-table entries dropped before every repeat."""
    started = time.monotonic()
    num_blocks = 2 * shape.blocks + 8
    block_ids = random.Random(seed).sample(range(1, num_blocks), shape.blocks)
    kv_bytes = shape.layers * num_blocks * shape.block_bytes
    with _mapped(shape.load_bytes) as (l1_map, l1_flat), _mapped(kv_bytes) as (kv_map, kv_flat):
        memcpy_s, memcpy_first_touch_s = _memcpy_s(l1_map, kv_map, shape.load_bytes, repeats)
        approaches = _time_approaches(
            shape, _Load(l1_objects(shape, l1_flat), kv_layers(shape, num_blocks, kv_flat), block_ids),
            {"source": l1_map, "destination": kv_map}, threads, repeats, memcpy_s)
        del l1_flat, kv_flat  # views of the mappings: gone before they close
    best_name, best_threads = max(((n, t) for n in approaches for t in approaches[n]["ms"]),
                                  key=lambda nt: approaches[nt[0]]["fraction_of_memcpy"][nt[1]])
    return {
        "load_mib": shape.load_bytes / (1 << 20),
        "threads": list(threads),
        "memcpy_ms": memcpy_s * 1e3,
        "memcpy_first_touch_ms": memcpy_first_touch_s * 1e3,
        "approaches": approaches,
        "best": best_name,
        "best_threads": int(best_threads),
        "best_fraction_of_memcpy": approaches[best_name]["fraction_of_memcpy"][best_threads],
        "seconds": time.monotonic() - started,
    }


@dataclass(frozen=True)
class _Load:
    objects: list[torch.Tensor]
    layers: list[torch.Tensor]
    block_ids: list[int]


def _memcpy_s(l1_map: mmap.mmap, kv_map: mmap.mmap, nbytes: int, repeats: int) -> tuple[float, float]:
    """A plain copy of the load's bytes out of L1: into private pre-faulted memory, and into the
    KV mapping with its page-table entries dropped first."""
    import numpy as np

    source = np.frombuffer(l1_map, dtype=np.uint8)[:nbytes]
    into_private = np.zeros(nbytes, dtype=np.uint8)
    into_shared = np.frombuffer(kv_map, dtype=np.uint8)[:nbytes]
    warm = _best_s(lambda: np.copyto(into_private, source), repeats=repeats)
    cold = _best_s(lambda: np.copyto(into_shared, source), _dropper(kv_map), min(repeats, FIRST_TOUCH_REPEATS))
    return warm, cold


def _dropper(mapping: mmap.mmap) -> Callable[[], None]:
    """Drops the mapping's page-table entries (the tmpfs pages stay): the next touch faults each
    4 KiB page back in, as in a process that has just mapped the other one's memory."""
    return lambda: mapping.madvise(mmap.MADV_DONTNEED)


def _time_approaches(shape: LoadShape, load: _Load, shared: dict[str, mmap.mmap],
                     threads: tuple[int, ...], repeats: int, memcpy_s: float) -> dict[str, dict[str, Any]]:
    server = lmcache_server_copy(shape, load.layers)
    runs: dict[str, Callable[[], None]] = {
        "lmcache_server": lambda: server(load.objects, load.block_ids),
        "lmcache_worker_scatter": lambda: lmcache_worker_scatter(shape, load.objects, load.layers,
                                                                 load.block_ids),
        "kvops_worker": lambda: worker_copy(shape, load.objects, load.layers, load.block_ids),
    }
    approaches: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        drop = _dropper(shared[FIRST_TOUCH_SIDE[name]])
        warm: dict[str, float] = {}
        cold: dict[str, float] = {}
        for count in threads:
            with _threads(count):
                run()
                warm[str(count)] = _best_s(run, repeats=repeats)
                cold[str(count)] = _best_s(run, drop, min(repeats, FIRST_TOUCH_REPEATS))
        approaches[name] = _figures(APPROACHES[name], FIRST_TOUCH_SIDE[name], warm, cold, memcpy_s)
    return approaches


def _figures(what: str, side: str, warm: dict[str, float], cold: dict[str, float],
             memcpy_s: float) -> dict[str, Any]:
    return {
        "what": what,
        "first_touch_side": side,
        "ms": {k: s * 1e3 for k, s in warm.items()},
        "fraction_of_memcpy": {k: memcpy_s / s for k, s in warm.items()},
        "first_touch_ms": {k: s * 1e3 for k, s in cold.items()},
        "first_touch_fraction_of_memcpy": {k: memcpy_s / s for k, s in cold.items()},
    }
