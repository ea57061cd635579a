"""kvops' own copy between LMCache's L1 objects and vLLM's CPU KV blocks, in the worker (issue 43).

In engine_driven mode LMCache's worker adapter copies every load out of the server's L1 slots
(POSIX shared memory with ``--shm-name``, or objects pickled over ZMQ) into vLLM's KV blocks, and
every store the other way, with ``scatter_cpu_to_paged_kv`` / ``gather_paged_kv_to_cpu``
(lmcache ``v1/multiprocess/transfer_context/base.py``; called from ``worker_transfer.py``'s
``submit_retrieve`` / ``submit_store``). On CPU they run LMCache's Python fallback: per object
and layer, a slice of the object copied whole into a temporary, then a permuted ``index_copy_``
(``v1/platform/torch_ops/mp_mem_kernels.py`` ``_transfer_per_layer_fused``). An L1 object is
token-major (``[layers, chunk tokens, heads x (K|V)]``), a vLLM CPU block head-major
(``[heads, block tokens, K|V]``, vllm ``v1/attention/backends/cpu_attn.py``), so each block of
each layer is a transpose of rows of ``2 x head_dim`` elements: one strided torch copy straight
between the two, no temporary and no index tensor (``kvops bench offload``'s ``worker_copy``
part times both on the reference load).

``install`` puts these in place of LMCache's two functions in the worker adapter's module, only
where vLLM's KV is CPU tensors of that fused layout; any other layout (GPU, split K/V, an MLA
model) goes to LMCache's own functions, unchanged. Same arguments, same semantics (the block ids
an object covers, ``skip_first_n_tokens`` skipping whole leading blocks over the flat list, the
``out`` / ``chunk_indices`` of a store); ``tests/plugin/test_offload_worker_copy.py`` holds them
to LMCache's functions byte for byte. Tied to lmcache 0.5.6's module layout (internals, not an
API): if the names are not there, nothing is replaced and the connector says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("vllm.plugins.kvops.offload")

_TRANSFER_MODULE = "lmcache.v1.multiprocess.transfer_context.worker_transfer"
_SCATTER, _GATHER = "scatter_cpu_to_paged_kv", "gather_paged_kv_to_cpu"


def fused_cpu_layers(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """vLLM CPU's per-layer KV ``[blocks, kv heads, block tokens, 2 x head_dim]`` (K and V fused
    in the last axis), contiguous, one shape and dtype for every layer; None for anything else."""
    layers = list(kv_caches.values())
    if not layers:
        return None
    first = layers[0]
    for layer in layers:
        if (layer.device.type != "cpu" or layer.dim() != 4 or layer.shape != first.shape
                or layer.dtype != first.dtype or not layer.is_contiguous()):
            return None
    return layers


def _object_rows(obj: torch.Tensor, layers: list[torch.Tensor]) -> torch.Tensor | None:
    """An L1 object as ``[layers, chunk tokens, kv heads, 2 x head_dim]`` over its own storage,
    or None where its bytes do not hold whole tokens of every layer in the KV's dtype."""
    _, heads, _, width = layers[0].shape
    per_token = len(layers) * heads * width
    if obj.dtype != layers[0].dtype or not obj.is_contiguous() or obj.numel() % per_token:
        return None
    return obj.view(len(layers), obj.numel() // per_token, heads, width)


def scatter(layers: list[torch.Tensor], block_ids: list[int], chunks: list[torch.Tensor],
            blocks_per_chunk: int, skip_first_n_tokens: int = 0) -> bool:
    """A load: object ``i`` fills the blocks ``block_ids[i*bpc:(i+1)*bpc]``, but for the leading
    ``skip_first_n_tokens // block_tokens`` blocks of the whole list (vLLM holds them). False,
    having written nothing, where an object is not of the KV's layout (the caller falls back)."""
    block_tokens = layers[0].shape[2]
    rows = [_object_rows(obj, layers) for obj in chunks]
    if any(r is None or r.shape[1] < blocks_per_chunk * block_tokens for r in rows):
        return False
    skip_blocks = skip_first_n_tokens // block_tokens
    total = min(len(block_ids), len(chunks) * blocks_per_chunk)
    for flat in range(skip_blocks, total):
        obj = rows[flat // blocks_per_chunk]
        assert obj is not None
        start = (flat % blocks_per_chunk) * block_tokens
        block = block_ids[flat]
        for layer, dst in enumerate(layers):
            dst[block].copy_(obj[layer, start:start + block_tokens].transpose(0, 1))
    return True


def gather(layers: list[torch.Tensor], block_ids: list[int], blocks_per_chunk: int,
           out: list[torch.Tensor] | None = None,
           chunk_indices: list[int] | None = None) -> list[torch.Tensor] | None:
    """A store: the objects of the chunks ``chunk_indices`` (all whole chunks of ``block_ids``
    without it), each from its ``blocks_per_chunk`` blocks, into ``out`` (LMCache's L1 slots) or
    new tensors ``[layers, chunk tokens, heads x 2 x head_dim]``; None, having written nothing,
    where ``out`` is short or a buffer is not of the KV's layout (the caller falls back)."""
    _, heads, block_tokens, width = layers[0].shape
    indices = list(chunk_indices) if chunk_indices is not None else list(range(len(block_ids) // blocks_per_chunk))
    chunk_tokens = blocks_per_chunk * block_tokens
    if out is None:
        objects = [torch.empty((len(layers), chunk_tokens, heads * width), dtype=layers[0].dtype)
                   for _ in indices]
    elif len(out) < len(indices):
        return None  # LMCache raises its own ValueError for this: keep its message
    else:
        objects = out if len(out) == len(indices) else out[:len(indices)]
    rows = [_object_rows(obj, layers) for obj in objects]
    if any(r is None or r.shape[1] < chunk_tokens for r in rows):
        return None
    for obj, chunk in zip(rows, indices, strict=True):
        assert obj is not None
        for j, block in enumerate(block_ids[chunk * blocks_per_chunk:(chunk + 1) * blocks_per_chunk]):
            start = j * block_tokens
            for layer, src in enumerate(layers):
                obj[layer, start:start + block_tokens].copy_(src[block].transpose(0, 1))
    return objects


def install() -> str | None:
    """Put kvops' copy in place of LMCache's in its worker adapter's module (once per process).
    Returns None when in place, else why not (one line for the connector's log)."""
    import importlib

    try:
        module = importlib.import_module(_TRANSFER_MODULE)
    except ImportError as exc:
        return f"LMCache's worker transfer module is not importable ({exc})"
    scatter_original, gather_original = getattr(module, _SCATTER, None), getattr(module, _GATHER, None)
    if scatter_original is None or gather_original is None:
        return f"{_TRANSFER_MODULE} has no {_SCATTER}/{_GATHER} (another LMCache version)"
    if getattr(scatter_original, "_kvops", False):
        return None
    setattr(module, _SCATTER, _scatter_or(scatter_original))
    setattr(module, _GATHER, _gather_or(gather_original))
    return None


def _scatter_or(original: Callable[..., None]) -> Callable[..., None]:
    def kvops_scatter(kv_caches: dict[str, torch.Tensor], block_ids: list[int], chunks: list[torch.Tensor],
                      blocks_per_chunk: int, skip_first_n_tokens: int = 0, **kwargs: Any) -> None:
        layers = fused_cpu_layers(kv_caches)
        # too few block ids for the objects: LMCache raises its own ValueError, keep its message
        if (layers is None or not chunks or len(block_ids) < len(chunks) * blocks_per_chunk
                or not scatter(layers, list(block_ids), chunks, blocks_per_chunk, skip_first_n_tokens)):
            original(kv_caches, block_ids, chunks, blocks_per_chunk,
                     skip_first_n_tokens=skip_first_n_tokens, **kwargs)

    kvops_scatter._kvops = True  # type: ignore[attr-defined]
    return kvops_scatter


def _gather_or(original: Callable[..., list[torch.Tensor]]) -> Callable[..., list[torch.Tensor]]:
    def kvops_gather(kv_caches: dict[str, torch.Tensor], block_ids: list[int], blocks_per_chunk: int,
                     **kwargs: Any) -> list[torch.Tensor]:
        layers = fused_cpu_layers(kv_caches)
        if layers is not None:
            objects = gather(layers, list(block_ids), blocks_per_chunk, out=kwargs.get("out"),
                             chunk_indices=kwargs.get("chunk_indices"))
            if objects is not None:
                return objects
        return original(kv_caches, block_ids, blocks_per_chunk, **kwargs)

    kvops_gather._kvops = True  # type: ignore[attr-defined]
    return kvops_gather
