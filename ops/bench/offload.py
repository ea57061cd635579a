"""``kvops bench offload --json``: TTFT of a long prefix served from LMCache L1 and from disk vs
recomputed, the cost of a miss, and LMCache's copy throughput vs a plain memory copy.

One run, real processes, the reference shape of research/offload_bench.md (8 layers, hidden
1024, 8 KV heads x head_dim 128 = 32 KiB of KV per token) so the ratios compare with the
measurements there. The offload server and a server without the connector stay up side by side.
Per prompt: (a) cold through the offload server, (c) again after /reset_prefix_cache (LMCache
L1), (d) again after also clearing L1 (disk); ratios are medians of c/a and d/a. The cost of a
miss is measured apart, in interleaved ABBA blocks of fresh prompts (no connector, offload,
offload, no connector): a slow stretch of the shared machine hits both sides of a block alike.
``miss_overhead_ratio`` is the median of the blocks' ratios, reported with their spread.

The transfer mode is the product default (engine_driven); KVOPS_BENCH_OFFLOAD_TRANSFER_MODE=
lmcache_driven measures the zero-copy /dev/shm path instead (research/offload_bench.md §4).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from kvops.ops.bench.paired import block_ratios
from kvops.ops.errors import BadInputError, KvopsError
from kvops.ops.launch import ManagedServer, free_port, lmcache_server, vllm_server
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model
from kvops.ops.offload.shm import remove_stale_segments
from kvops.ops.offload.status import counter_values
from kvops.plugin.offload.settings import OffloadSettings, TransferMode

REFERENCE_SHAPE = TinyModelSpec(
    layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, intermediate=2816,
)
PROMPT_TOKENS = 2048
REPEATS = 3
MISS_BLOCKS = 4
IDLE_GAP_S = 1.5
"""Pause after each request: a vLLM worker spins for 1 s after its last message before it sleeps
(vllm/distributed/device_communicators/shm_broadcast.py busy_loop_s), so the server that just
answered is idle again when the other one is measured."""
OUTPUT_TOKENS = 8
KV_CACHE_BYTES = 1 << 30
SERVER_ARGS = ("--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--max-num-seqs", "4")


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvops-bench-offload-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", REFERENCE_SHAPE)
        prompts = [_prompt(seed) for seed in range(REPEATS + 1)]  # [0] warms up
        settings = OffloadSettings(
            port=free_port(), http_port=free_port(), l1_gib=1.0,
            disk_path=str(root / "l2"), disk_gib=2.0,
            transfer_mode=_transfer_mode(),
        )
        offload = _measure(model, prompts, settings, root)
        memcpy = memcpy_gb_per_s()
    return _result(offload, memcpy, settings)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(5, REFERENCE_SHAPE.vocab - 1) for _ in range(PROMPT_TOKENS)]


def _measure(model: Path, prompts: list[list[int]], settings: OffloadSettings,
             root: Path) -> dict[str, Any]:
    lmcache = lmcache_server(settings, log_path=root / "lmcache.log")
    lmcache.start(health_path="/healthcheck")
    cfg = json.dumps({"kvops": {"offload": settings.model_dump()}})
    server = vllm_server(model, (*SERVER_ARGS, "--additional-config", cfg),
                         log_path=root / "vllm-offload.log", kv_cache_bytes=KV_CACHE_BYTES,
                         env={"VLLM_SERVER_DEV_MODE": "1"}, name="vllm-offload")
    baseline = vllm_server(model, SERVER_ARGS, log_path=root / "vllm-baseline.log",
                           kv_cache_bytes=KV_CACHE_BYTES, name="vllm-baseline")
    try:
        server.start()
        baseline.start()
        tiers = _measure_tiers(server, lmcache, model, prompts)
        tiers["baseline"] = [ttft(baseline.url, model, prompt) for prompt in prompts][1:]
        tiers["misses"] = _measure_misses(server, lmcache, baseline, model)
        tiers["vllm_metrics"] = requests.get(server.url + "/metrics", timeout=10).text
        return tiers
    finally:
        baseline.stop()
        server.stop()
        remove_stale_segments()  # lmcache_driven leaves vLLM's KV segment in /dev/shm
        lmcache.stop()


def _measure_tiers(server: ManagedServer, lmcache: ManagedServer, model: Path,
                   prompts: list[list[int]]) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, str]]] = {"cold": [], "l1": [], "disk": []}
    hits = {"l1": 0.0, "disk": 0.0}
    chunks = PROMPT_TOKENS // 256
    for index, prompt in enumerate(prompts):
        cold = ttft(server.url, model, prompt)
        stored_chunks = (index + 1) * chunks

        def stored(target: int = stored_chunks) -> bool:
            return _lmcache(lmcache)["l2_stored_chunks"] >= target

        _wait(stored)
        _post(server.url + "/reset_prefix_cache")
        before = _lmcache(lmcache)
        l1 = ttft(server.url, model, prompt)
        _post(lmcache.url + "/cache/clear")
        _post(server.url + "/reset_prefix_cache")
        middle = _lmcache(lmcache)
        disk = ttft(server.url, model, prompt)
        after = _lmcache(lmcache)
        _post(server.url + "/reset_prefix_cache")
        if index == 0:
            continue  # warm-up
        runs["cold"].append(cold)
        runs["l1"].append(l1)
        runs["disk"].append(disk)
        hits["l1"] += middle["hit_tokens_l1"] - before["hit_tokens_l1"]
        hits["disk"] += after["hit_tokens_l2"] - middle["hit_tokens_l2"]
    return {"runs": runs, "hits": hits}


def _measure_misses(server: ManagedServer, lmcache: ManagedServer, baseline: ManagedServer,
                    model: Path) -> dict[str, list[float]]:
    """Cold TTFTs of fresh prompts, ABBA per block: (no connector, offload) on one prompt, then
    (offload, no connector) on the next. Each offload round waits for LMCache's stores to end,
    so its disk writes do not land in the next round."""
    ttfts: dict[str, list[float]] = {"baseline": [], "offload": []}
    for block in range(MISS_BLOCKS):
        first, second = (_prompt(100 + 2 * block + i) for i in range(2))
        for side, prompt in (("baseline", first), ("offload", first),
                             ("offload", second), ("baseline", second)):
            target = server if side == "offload" else baseline
            stored = _lmcache(lmcache)["l2_stored_chunks"]
            ttfts[side].append(ttft(target.url, model, prompt)[0])
            if side == "offload":
                _wait_stored(lmcache, stored + PROMPT_TOKENS // 256)
            time.sleep(IDLE_GAP_S)
    return ttfts


def miss_block_ratios(ttfts: dict[str, list[float]]) -> list[float]:
    """Per ABBA block: offload / no-connector cold TTFT - 1 (two rounds per side per block)."""
    return [ratio - 1 for ratio in block_ratios(ttfts["baseline"], ttfts["offload"])]


def spread(values: list[float]) -> dict[str, float]:
    """Min, quartiles and max (the quartiles interpolate; with 4 blocks they are ~ the 2nd and
    3rd smallest)."""
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return {"min": min(values), "q1": low, "q3": high, "max": max(values)}


def ttft(url: str, model: Path, prompt: list[int]) -> tuple[float, str]:
    """(seconds to the first streamed token, greedy text) of one completion."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    text = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines(chunk_size=1):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - started
            text.append(json.loads(line[6:])["choices"][0]["text"])
    if first is None:
        raise KvopsError(f"{url} streamed no tokens")
    return first, "".join(text)


def _lmcache(server: ManagedServer) -> dict[str, float]:
    values: dict[str, float] = counter_values(requests.get(server.url + "/metrics", timeout=10).text)
    return values


def _post(url: str) -> None:
    requests.post(url, timeout=60).raise_for_status()


def _wait_stored(lmcache: ManagedServer, chunks: float) -> None:
    _wait(lambda: _lmcache(lmcache)["l2_stored_chunks"] >= chunks)


def _wait(check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise KvopsError("LMCache did not store the prompt in time (see its log)")
        time.sleep(0.2)


def memcpy_gb_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-n plain copy between two pre-faulted buffers on this machine (decimal GB/s)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def _vllm_sum(metrics: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(metrics)
               for sample in family.samples if sample.name == name)


def _result(offload: dict[str, Any], memcpy: float, settings: OffloadSettings) -> dict[str, Any]:
    runs, baseline = offload["runs"], offload["baseline"]
    median = {tier: statistics.median(t for t, _ in runs[tier]) for tier in runs}
    misses = offload["misses"]
    baseline_s = statistics.median(misses["baseline"])
    blocks = miss_block_ratios(misses)
    texts = [text for tier in runs for _, text in runs[tier]]
    identical = all(text == baseline[i % len(baseline)][1] for i, text in enumerate(texts))
    metrics = offload["vllm_metrics"]
    load_gb_s = _rate(metrics, "kvops_offload_loaded_bytes_total", "kvops_offload_load_seconds_sum")
    store_gb_s = _rate(metrics, "kvops_offload_stored_bytes_total", "kvops_offload_store_seconds_sum")
    kv_bytes_per_token = 2 * REFERENCE_SHAPE.layers * REFERENCE_SHAPE.kv_heads * REFERENCE_SHAPE.head_dim * 2
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "l1_ttft_ratio": median["l1"] / median["cold"],
        "disk_ttft_ratio": median["disk"] / median["cold"],
        "miss_overhead_ratio": statistics.median(blocks),
        "miss_overhead_spread": spread(blocks),
        "miss_overhead_blocks": blocks,
        "miss_ttft_s": {"no_connector": baseline_s, "offload": statistics.median(misses["offload"])},
        "copy_fraction_of_memcpy": load_gb_s / memcpy,
        # lmcache_driven stores are submitted in the step and copied later by the server, so the
        # step time says nothing about copy speed there.
        "store_fraction_of_memcpy": (store_gb_s / memcpy
                                     if settings.transfer_mode == "engine_driven" else None),
        "outputs_identical": identical,
        "kv_bytes_per_token": kv_bytes_per_token,
        "hidden_size": REFERENCE_SHAPE.hidden,
        "layers": REFERENCE_SHAPE.layers,
        "repeats": len(runs["cold"]),
        "transfer_mode": settings.transfer_mode,
        "ttft_s": {**median, "no_connector": baseline_s},
        "hit_tokens_per_request": {tier: hits / len(runs["cold"]) for tier, hits in offload["hits"].items()},
        "load_gb_per_s": load_gb_s,
        "store_gb_per_s": store_gb_s,
        "memcpy_gb_per_s": memcpy,
    }


def _rate(metrics: str, bytes_name: str, seconds_name: str) -> float:
    seconds = _vllm_sum(metrics, seconds_name)
    return _vllm_sum(metrics, bytes_name) / seconds / 1e9 if seconds else 0.0


def _transfer_mode() -> TransferMode:
    mode = os.environ.get("KVOPS_BENCH_OFFLOAD_TRANSFER_MODE", "engine_driven")
    if mode == "lmcache_driven":
        return "lmcache_driven"
    if mode == "engine_driven":
        return "engine_driven"
    raise BadInputError(
        f"KVOPS_BENCH_OFFLOAD_TRANSFER_MODE={mode!r}: use engine_driven or lmcache_driven"
    )
