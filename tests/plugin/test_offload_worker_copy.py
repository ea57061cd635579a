"""kvops' worker copy (plugin/offload/worker_copy.py) against LMCache's own engine_driven copy
functions, byte for byte: LMCache's ``scatter_cpu_to_paged_kv`` and ``gather_paged_kv_to_cpu``
(its CPU fallback, the functions kvops stands in for) are the oracle, run on the same random KV,
objects and block ids, with vLLM CPU's fused layout and with layouts kvops leaves to LMCache."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from lmcache.v1.multiprocess.transfer_context.base import (
    gather_paged_kv_to_cpu,
    scatter_cpu_to_paged_kv,
)

from kvops.plugin.offload import worker_copy

LAYERS, HEADS, BLOCK, HEAD_DIM, BLOCKS = 3, 2, 16, 8, 40
BPC = 2  # blocks per LMCache chunk: 32-token chunks of 16-token blocks


def kv(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM CPU's per-layer KV: [blocks, kv heads, block tokens, 2 x head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=g).to(dtype)
            for i in range(LAYERS)}


def objects(count: int, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> list[torch.Tensor]:
    """L1 objects as LMCache shapes them for a fused format: [layers, chunk tokens, heads x 2D]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYERS, BPC * BLOCK, HEADS * 2 * HEAD_DIM, generator=g).to(dtype) for _ in range(count)]


def blocks(count: int, seed: int = 2) -> list[int]:
    return random.Random(seed).sample(range(1, BLOCKS), count)


def clone(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in caches.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("chunks", "ids", "skip_tokens"), [
    (3, 6, 0),            # whole chunks
    (3, 6, BLOCK),        # vLLM holds the first block
    (3, 6, 3 * BLOCK),    # ... the first chunk and a block of the second
    (2, 7, 0),            # more block ids than the objects cover: the rest untouched
    (3, 6, 6 * BLOCK),    # everything held: nothing written
])
def test_load_writes_what_lmcache_writes(dtype, chunks, ids, skip_tokens):
    caches, objs, block_ids = kv(dtype), objects(chunks, dtype), blocks(ids)
    theirs, ours = clone(caches), clone(caches)
    scatter_cpu_to_paged_kv(theirs, block_ids, objs, BPC, skip_first_n_tokens=skip_tokens)
    assert worker_copy.scatter(worker_copy.fused_cpu_layers(ours), block_ids, objs, BPC, skip_tokens)
    assert same(ours, theirs)
    if skip_tokens < min(ids, chunks * BPC) * BLOCK:
        assert not same(ours, caches)  # it wrote something


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("indices", [None, [0, 2], [1]])
def test_store_reads_what_lmcache_reads(dtype, indices):
    caches, block_ids = kv(dtype), blocks(6)
    count = 3 if indices is None else len(indices)
    theirs = gather_paged_kv_to_cpu(clone(caches), block_ids, BPC, chunk_indices=indices)
    ours = worker_copy.gather(worker_copy.fused_cpu_layers(clone(caches)), block_ids, BPC,
                              chunk_indices=indices)
    assert ours is not None
    assert len(ours) == len(theirs) == count
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # into LMCache's slots (out): the same buffers come back, filled, extra ones untouched
    slots = [torch.zeros(LAYERS, BPC * BLOCK, HEADS * 2 * HEAD_DIM, dtype=dtype) for _ in range(count + 1)]
    filled = worker_copy.gather(worker_copy.fused_cpu_layers(caches), block_ids, BPC, out=slots,
                                chunk_indices=indices)
    assert filled is not None
    assert all(f is s for f, s in zip(filled, slots, strict=False))
    assert all(torch.equal(f, t) for f, t in zip(filled, theirs, strict=True))
    assert not slots[-1].any()


def test_store_then_load_into_other_blocks_moves_every_byte():
    source, target = kv(seed=3), kv(seed=4)
    stored_ids, loaded_ids = blocks(6, seed=5), blocks(6, seed=6)
    objs = worker_copy.gather(worker_copy.fused_cpu_layers(source), stored_ids, BPC)
    assert objs is not None
    assert worker_copy.scatter(worker_copy.fused_cpu_layers(target), loaded_ids, objs, BPC)
    for name in source:
        assert torch.equal(target[name][loaded_ids], source[name][stored_ids])


@pytest.fixture
def installed(monkeypatch):
    """kvops' copy installed in LMCache's worker transfer module, restored afterwards."""
    module = importlib.import_module(worker_copy._TRANSFER_MODULE)
    monkeypatch.setattr(module, worker_copy._SCATTER, getattr(module, worker_copy._SCATTER))
    monkeypatch.setattr(module, worker_copy._GATHER, getattr(module, worker_copy._GATHER))
    assert worker_copy.install() is None
    assert worker_copy.install() is None  # once: a second install wraps nothing twice
    scatter = getattr(module, worker_copy._SCATTER)
    assert scatter._kvops
    assert scatter.__name__ == "kvops_scatter"
    return module


def test_installed_copy_serves_the_fused_cpu_layout(installed, monkeypatch):
    """LMCache's worker adapter calls the module's names: after install they run kvops' copy
    (spied) and write what LMCache's own function writes."""
    calls = []
    real = worker_copy.scatter
    monkeypatch.setattr(worker_copy, "scatter", lambda *a, **k: calls.append(1) or real(*a, **k))
    caches, objs, block_ids = kv(), objects(2), blocks(4)
    theirs, ours = clone(caches), clone(caches)
    scatter_cpu_to_paged_kv(theirs, block_ids, objs, BPC, skip_first_n_tokens=BLOCK)
    getattr(installed, worker_copy._SCATTER)(ours, block_ids, objs, BPC, skip_first_n_tokens=BLOCK,
                                            layout_hints=None, engine_kv_format=None)
    assert calls
    assert same(ours, theirs)


def test_other_layouts_and_bad_calls_go_to_lmcache(installed):
    """A split-K/V layout (vLLM's GPU shape, here on CPU tensors), objects of another dtype and
    too few block ids are LMCache's to handle: its results, its errors."""
    g = torch.Generator().manual_seed(7)
    split = {f"l{i}": torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
             for i in range(LAYERS)}
    assert worker_copy.fused_cpu_layers(split) is None
    block_ids = blocks(4)
    theirs = gather_paged_kv_to_cpu(clone(split), block_ids, BPC)
    via = getattr(installed, worker_copy._GATHER)(clone(split), block_ids, BPC)
    assert all(torch.equal(a, b) for a, b in zip(via, theirs, strict=True))
    # float32 objects for a bf16 cache: not the KV's layout, so kvops writes nothing itself
    caches = kv()
    assert not worker_copy.scatter(worker_copy.fused_cpu_layers(clone(caches)), block_ids,
                                   objects(2, torch.float32), BPC)
    with pytest.raises(ValueError, match="block_ids length"):
        getattr(installed, worker_copy._SCATTER)(clone(caches), block_ids[:3], objects(2), BPC)
    with pytest.raises(ValueError, match="out length"):
        getattr(installed, worker_copy._GATHER)(clone(caches), block_ids, BPC, out=objects(1),
                                               chunk_indices=[0, 1])


def test_install_says_why_not_without_lmcache_names(monkeypatch):
    module = importlib.import_module(worker_copy._TRANSFER_MODULE)
    monkeypatch.delattr(module, worker_copy._SCATTER)
    reason = worker_copy.install()
    assert reason is not None
    assert worker_copy._SCATTER in reason
