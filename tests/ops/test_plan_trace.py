"""`kvops plan --trace`: lengths and offload from a trace whose LRU curve is known by hand.

The cyclic trace: 100 conversations of 64 blocks (32,768 tokens), sent once each and then
again in the same order. An LRU cache finds the second pass only if it holds all 6,400 blocks
(the first block of a conversation was used 6,399 distinct blocks ago), and then finds all of
it: the curve is 0 below 6,400 blocks (3,276,800 tokens) and 50% of prompt tokens from there.
Llama 3.1 8B's bf16 KV is 32 layers × 8 KV heads × 128 × K,V × 2 B = 131,072 B/token, so that
cache is 400 GiB exactly; an H100's KV pool (well under a million tokens) finds nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.ops.cli.main import app

LLAMA = "meta-llama--Meta-Llama-3.1-8B.json"


@pytest.fixture
def base(model_configs_dir: Path) -> list[str]:
    return ["plan", "--config", str(model_configs_dir / LLAMA), "--max-model-len", "40000", "--gpu", "H100"]


def cyclic_trace(path: Path) -> Path:
    rows = [{"timestamp": 1000 * i, "input_length": 32768, "output_length": 100 + i % 2,
             "hash_ids": [c * 1000 + j for j in range(64)]} for i, c in enumerate([*range(100), *range(100)])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def plan(base: list[str], *args: str) -> dict:
    res = CliRunner().invoke(app, [*base, "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_offload_sized_from_the_lru_curve(base, tmp_path):
    doc = plan(base, "--trace", str(cyclic_trace(tmp_path / "c.jsonl")), "--target-hit-fraction", "0.9")
    trace = doc["trace"]
    assert (trace["requests"], trace["duration_s"], trace["arrival_rate_rps"]) == (200, 199.0, 200 / 199)
    assert trace["prefix_reuse_ratio"] == 0.5
    assert trace["tokens_for_target"] == trace["tokens_for_all_reuse"] == 6400 * 512
    assert trace["gpu_hit_ratio"] == 0.0
    assert doc["offload"]["lmcache_cpu_gib"] == 400.0
    assert doc["offload"]["lmcache_disk_gib"] is None
    assert doc["kvops_yaml"]["offload"]["l1_gib"] == 400.0
    assert "--host-memory-gib caps L1" in doc["offload"]["why"]  # no host size given: says so
    points = {p["cache_tokens"]: p for p in trace["curve"]}
    assert points[6400 * 512]["hit_ratio"] == 0.5
    assert points[6400 * 512]["cache_gib"] == 400.0
    assert all(p["hit_ratio"] == 0.0 for t, p in points.items() if t < 6400 * 512)
    # lengths: prompt 32,768 + output 100 or 101, half each
    assert (doc["workload"]["p50"], doc["workload"]["p99"]) == (32868, 32869)


def test_host_memory_cap_spills_to_disk(base, tmp_path):
    doc = plan(base, "--trace", str(cyclic_trace(tmp_path / "c.jsonl")), "--host-memory-gib", "100")
    assert (doc["offload"]["lmcache_cpu_gib"], doc["offload"]["lmcache_disk_gib"]) == (100.0, 400.0)  # disk inclusive: the whole target
    assert "--host-memory-gib" not in doc["offload"]["why"]


def test_a_trace_without_reuse_says_offload_cannot_help(base, tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n0,1000,10\n2,3000,30\n4,50000,0\n")
    doc = plan(base, "--trace", str(path))
    assert doc["offload"]["lmcache_cpu_gib"] is None
    assert "no prefix reuse" in doc["offload"]["warning"]
    assert doc["trace"]["requests_over_max_model_len"] == 1  # 50,000 > 40,000: sized clipped
    assert doc["trace"]["arrival_rate_rps"] == 0.75


def test_plan_without_trace_has_no_trace_key(base):
    assert "trace" not in plan(base, "--p50", "1000", "--p99", "4000")


@pytest.mark.parametrize(("args", "message"), [
    (["--p50", "100"], "give either --trace or --lengths-file/--p50/--p95/--p99, not both"),
    (["--distinct-prefixes", "3", "--prefix-tokens", "100"], "drop --distinct-prefixes/--prefix-tokens"),
    (["--target-hit-fraction", "0"], "--target-hit-fraction must be in (0, 1]"),
])
def test_bad_combinations_exit_2(base, tmp_path, args, message):
    res = CliRunner().invoke(app, [*base, "--trace", str(cyclic_trace(tmp_path / "c.jsonl")), *args])
    assert res.exit_code == 2
    assert message in res.stderr


def test_readable_plan_shows_the_curve(base, tmp_path):
    res = CliRunner().invoke(app, [*base, "--trace", str(cyclic_trace(tmp_path / "c.jsonl"))])
    assert res.exit_code == 0, res.output
    assert "LRU hit ratio by cache size" in res.stdout
    assert "3,276,800 tokens" in res.stdout
