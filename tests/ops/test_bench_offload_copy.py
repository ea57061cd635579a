"""The worker-side copy of issue 43 (ops/bench/offload_copy.py): each token's K and V must land in
its block's slot, as LMCache's own transfers put them; no speed is asserted."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvops.ops.bench.offload_copy import (  # noqa: E402
    APPROACHES,
    LoadShape,
    kv_layers,
    l1_objects,
    lmcache_server_copy,
    lmcache_worker_scatter,
    measure,
    worker_copy,
)

SMALL = LoadShape(layers=3, kv_heads=2, head_dim=4, block_tokens=4, chunk_tokens=8, tokens=32)
NUM_BLOCKS = 2 * SMALL.blocks + 3


def _load(seed: int = 0) -> tuple[list, list, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    l1 = torch.randn(SMALL.load_bytes // 2, generator=generator).to(torch.bfloat16).view(torch.uint8)
    kv = torch.zeros(SMALL.layers * NUM_BLOCKS * SMALL.block_bytes, dtype=torch.uint8)
    block_ids = random.Random(seed).sample(range(1, NUM_BLOCKS), SMALL.blocks)
    return l1_objects(SMALL, l1), kv_layers(SMALL, NUM_BLOCKS, kv), block_ids


def _naive(objects: list, block_ids: list[int]) -> list:
    """Token by token: token t of the load is row t % chunk_tokens of object t // chunk_tokens,
    and lands in slot t % block_tokens of block block_ids[t // block_tokens], head by head."""
    expected = [torch.zeros(NUM_BLOCKS, SMALL.kv_heads, SMALL.block_tokens, 2 * SMALL.head_dim,
                            dtype=torch.bfloat16) for _ in range(SMALL.layers)]
    width = 2 * SMALL.head_dim
    for token in range(SMALL.tokens):
        row = objects[token // SMALL.chunk_tokens][0, :, token % SMALL.chunk_tokens]
        block, slot = block_ids[token // SMALL.block_tokens], token % SMALL.block_tokens
        for layer in range(SMALL.layers):
            for head in range(SMALL.kv_heads):
                expected[layer][block, head, slot] = row[layer, head * width:(head + 1) * width]
    return expected


def _assert_equal(layers: list, expected: list) -> None:
    for got, want in zip(layers, expected, strict=True):
        assert torch.equal(got, want)


def test_the_worker_copy_puts_each_tokens_kv_in_its_block_slot_and_touches_no_other_block():
    objects, layers, block_ids = _load()
    worker_copy(SMALL, objects, layers, block_ids)
    _assert_equal(layers, _naive(objects, block_ids))


@pytest.mark.parametrize("copy", ["lmcache_server", "lmcache_worker_scatter"])
def test_lmcaches_own_transfers_read_the_object_layout_the_bench_builds(copy):
    """Were the bench's L1 object laid out otherwise than LMCache's for vLLM CPU's KV, LMCache's
    own copies would scatter the tokens elsewhere than the naive loop."""
    pytest.importorskip("lmcache")
    objects, layers, block_ids = _load(seed=1)
    if copy == "lmcache_server":
        lmcache_server_copy(SMALL, layers)(objects, block_ids)
    else:
        lmcache_worker_scatter(SMALL, objects, layers, block_ids)
    _assert_equal(layers, _naive(objects, block_ids))


def test_measure_reports_every_approach_per_thread_count_against_memcpy():
    pytest.importorskip("lmcache")
    figures = measure(SMALL, threads=(1,), repeats=1)
    assert set(figures["approaches"]) == set(APPROACHES)
    for approach in figures["approaches"].values():
        for key in ("fraction_of_memcpy", "first_touch_fraction_of_memcpy"):
            assert set(approach[key]) == {"1"}
            assert approach[key]["1"] > 0
    assert figures["best"] in APPROACHES
    assert figures["best_fraction_of_memcpy"] == figures["approaches"][figures["best"]][
        "fraction_of_memcpy"]["1"]


def test_the_offload_bench_can_run_the_worker_copy_alone(monkeypatch):
    """KVOPS_BENCH_OFFLOAD_WORKER_COPY_ONLY=1: no server is started, only ``worker_copy`` and
    ``bench_seconds`` are printed."""
    from kvops.ops.bench import offload, offload_copy

    monkeypatch.setattr(offload_copy, "measure", lambda: {"best": "kvops_worker"})
    monkeypatch.setattr(offload, "vllm_server", lambda *a, **k: pytest.fail("a server was started"))
    monkeypatch.setenv(offload.WORKER_COPY_ONLY_ENV, "1")
    result = offload.run()
    assert result["worker_copy"] == {"best": "kvops_worker"}
    assert set(result) == {"worker_copy", "bench_seconds"}
