"""`kvops plan --offload-mode`: tier sizes, expected hit ratios, and whether offload pays.

Oracles from outside the planner: a brute-force LRU cache (an OrderedDict) run over the real
Mooncake trace in ../shared, following issue 17's definitions, for the GPU, L1 and disk sizes the
plan chose; hand-computed hit ratios for ``--distinct-prefixes`` (D equally popular prefixes:
an LRU holding k of them finds k/D); the time model and the measured costs written out here.
Llama 3.1 8B's bf16 KV is 131,072 B/token.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from kvops.ops.cli.main import app

LLAMA = "meta-llama--Meta-Llama-3.1-8B.json"
SHARED = Path(__file__).resolve().parents[2].parent / "shared"
TRACE = SHARED / "fixtures/traces/mooncake_conversation_trace.jsonl"
CONFIGS = SHARED / "fixtures/model-configs"
KV_BYTES = 131_072
GIB = 1 << 30
ENGINE = (0.036, 0.046, 0.042)  # L1 hit, disk hit (of cold TTFT with the connector), miss overhead
LMCACHE = (0.058, 0.062, 0.039)  # core/offload/costs.py: two quiet bench runs each, README


def invoke(*args: str) -> Result:
    device = [] if "--device" in args else ["--gpu", "H100"]
    return CliRunner().invoke(app, ["plan", "--config", str(CONFIGS / LLAMA), *device, *args])


def plan(*args: str) -> dict:
    res = invoke("--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def time_model(costs: tuple[float, float, float], gpu: float, l1: float, disk: float) -> tuple[float, float]:
    """(prefill saved, miss overhead) in shares of recomputing every prompt token without a connector."""
    c_l1, c_disk, m = costs
    return (l1 - gpu) * (1 - c_l1 * (1 + m)) + (disk - l1) * (1 - c_disk * (1 + m)), m * (1 - disk)


def lru_hit_ratio(requests: list[dict], capacity_blocks: int) -> float:
    """Issue 17: hit = min(512 × leading ids cached, input); then every id inserted/refreshed in order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for req in requests:
        k = 0
        for block in req["hash_ids"]:
            if block not in cache:
                break
            k += 1
        hit += min(512 * k, req["input_length"])
        total += req["input_length"]
        for block in req["hash_ids"]:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total


def test_trace_tiers_match_a_brute_force_lru_over_the_real_trace():
    assert TRACE.is_file(), f"missing {TRACE}: ../shared must sit beside the repo"
    doc = plan("--max-model-len", "40000", "--trace", str(TRACE), "--host-memory-gib", "500",
               "--offload-mode", "engine_driven")
    d = doc["offload_decision"]
    assert (d["l1_gib"], d["disk_gib"]) == (500.0, 1974.5)  # disk inclusive: the whole 90% target
    assert (d["l1_tokens"], d["disk_tokens"]) == (500 * GIB // KV_BYTES, int(1974.5 * GIB) // KV_BYTES)
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])
    gpu = lru_hit_ratio(rows, d["gpu_cache_tokens"] // 512)
    l1 = lru_hit_ratio(rows, d["l1_tokens"] // 512)
    disk = lru_hit_ratio(rows, d["disk_tokens"] // 512)
    assert d["gpu_hit_ratio"] == pytest.approx(gpu, abs=1e-4)
    assert d["l1_hit_ratio"] == pytest.approx(l1 - gpu, abs=2e-4)
    assert d["hit_ratio"] == pytest.approx(disk, abs=1e-4)
    saved, overhead = time_model(ENGINE, gpu, l1, disk)
    assert d["prefill_saved_fraction"] == pytest.approx(saved, abs=3e-4)
    assert d["miss_overhead_fraction"] == pytest.approx(overhead, abs=3e-4)
    assert d["recommendation"] == ("enable" if saved > overhead else "leave-off") == "enable"
    assert doc["kvops_yaml"]["offload"] == {"l1_gib": 500.0, "chunk_size": 256, "disk_path": "/var/lib/kvops/lmcache",
                                            "disk_gib": 1974.5, "transfer_mode": "engine_driven"}
    assert d["commands"] == ["kvops offload serve --config kvops.yaml", doc["serve"]]


def prefixes(mode: str, distinct: int, prefix: int, mean: int, *extra: str) -> dict:
    return plan("--max-model-len", "8192", "--p50", str(mean), "--p95", str(mean), "--p99", str(mean),
                "--distinct-prefixes", str(distinct), "--prefix-tokens", str(prefix), "--offload-mode", mode, *extra)


def test_distinct_prefixes_hand_computed():
    # 400 prefixes of 3,000 tokens leading 4,000-token requests: 75% of prompt tokens reusable.
    # GPU: 3,008 tokens a prefix in 16-token blocks; L1: 400 × 3,072 (256-token chunks) × 131,072 B
    # = 150 GiB, × 1.25 LRU headroom = 187.5 GiB, which holds all 400.
    doc = prefixes("engine_driven", 400, 3000, 4000)
    d, gpu_tokens = doc["offload_decision"], doc["capacity"]["kv_cache_size_tokens"]
    gpu = 0.75 * min(1, (gpu_tokens // 3008) / 400)
    assert (d["l1_gib"], d["disk_gib"], d["gpu_cache_tokens"]) == (187.5, None, gpu_tokens)
    assert d["gpu_hit_ratio"] == round(gpu, 4)
    assert (d["hit_ratio"], d["l1_hit_ratio"], d["disk_hit_ratio"]) == (0.75, round(0.75 - gpu, 4), 0.0)
    saved, overhead = time_model(ENGINE, gpu, 0.75, 0.75)
    assert (d["prefill_saved_fraction"], d["miss_overhead_fraction"]) == (round(saved, 4), round(overhead, 4))
    assert d["recommendation"] == "enable"
    assert doc["offload"]["lmcache_cpu_gib"] == 187.5


@pytest.mark.parametrize(("mode", "costs", "prefix", "verdict"), [
    ("auto", ENGINE, 200, "leave-off"),  # auto on a GPU plan: engine_driven
    ("lmcache_driven", LMCACHE, 1000, "enable"),
])
def test_saving_below_the_miss_overhead_leaves_it_off(mode, costs, prefix, verdict):
    # 10,000 prefixes of `prefix` tokens leading 5,000-token requests: 4% or 20% reusable; the GPU
    # holds gpu_tokens // (the prefix in 16-token blocks) of them; L1 holds all (for 1,000 tokens:
    # 10,000 × 1,024 × 131,072 B × 1.25 = 1,562.5 GiB). 4% saves less than every miss pays.
    doc = prefixes(mode, 10_000, prefix, 5000)
    d, gpu_tokens = doc["offload_decision"], doc["capacity"]["kv_cache_size_tokens"]
    share = prefix / 5000
    gpu = share * (gpu_tokens // (-(-prefix // 16) * 16)) / 10_000
    saved, overhead = time_model(costs, gpu, share, share)
    assert (d["prefill_saved_fraction"], d["miss_overhead_fraction"]) == (round(saved, 4), round(overhead, 4))
    assert d["recommendation"] == verdict
    assert d["costs"]["transfer_mode"] == ("engine_driven" if mode == "auto" else mode)
    if verdict == "leave-off":
        assert d["reason"].startswith("leave it off: L1 and disk hits would save")
        assert (d["l1_gib"], d["commands"], doc["offload"]["lmcache_cpu_gib"]) == (None, [], None)
        assert "offload" not in doc["kvops_yaml"]
        assert doc["offload"]["warning"] == d["reason"]
    else:
        assert doc["kvops_yaml"]["offload"]["l1_gib"] == d["l1_gib"] == 1562.5
        assert doc["kvops_yaml"]["offload"]["transfer_mode"] == "lmcache_driven"


def test_gpu_holding_the_working_set_leaves_it_off():
    doc = prefixes("engine_driven", 10, 2000, 4000)
    d = doc["offload_decision"]
    assert (d["gpu_hit_ratio"], d["hit_ratio"], d["recommendation"]) == (0.5, 0.5, "leave-off")
    assert "the GPU KV cache alone finds 50.0%" in d["reason"]


def test_no_reuse_given_leaves_it_off():
    d = plan("--max-model-len", "8192", "--offload-mode", "engine_driven")["offload_decision"]
    assert d["recommendation"] == "leave-off"
    assert d["reason"].startswith("leave it off: no prefix reuse given")


def bench_json(path: Path, **fields: object) -> Path:
    doc = {"prompt_tokens": 2048, "transfer_mode": "engine_driven", "l1_ttft_ratio": 0.05,
           "disk_ttft_ratio": 0.08, "miss_overhead_ratio": 0.01, **fields}
    path.write_text(json.dumps(doc))
    return path


def test_measured_costs_from_a_bench_json_replace_the_built_in_ones(tmp_path):
    costs = bench_json(tmp_path / "bench.json")
    doc = prefixes("engine_driven", 10_000, 1000, 5000, "--offload-costs", str(costs))
    d = doc["offload_decision"]
    gpu = 0.2 * (doc["capacity"]["kv_cache_size_tokens"] // 1008) / 10_000
    saved, overhead = time_model((0.05, 0.08, 0.01), gpu, 0.2, 0.2)
    assert (d["prefill_saved_fraction"], d["miss_overhead_fraction"]) == (round(saved, 4), round(overhead, 4))
    assert d["recommendation"] == "enable"
    assert str(costs) in d["costs"]["source"]


def test_a_miss_measured_faster_with_the_connector_counts_as_no_cost(tmp_path):
    """The bench compares two servers, which differ by a few percent: its median miss ratio can
    come out below 0 (-0.063 in one quiet run). The plan takes the file and counts no cost."""
    costs = bench_json(tmp_path / "bench.json", miss_overhead_ratio=-0.063)
    doc = prefixes("engine_driven", 10_000, 1000, 5000, "--offload-costs", str(costs))
    d = doc["offload_decision"]
    gpu = 0.2 * (doc["capacity"]["kv_cache_size_tokens"] // 1008) / 10_000
    saved, overhead = time_model((0.05, 0.08, 0.0), gpu, 0.2, 0.2)
    assert (d["prefill_saved_fraction"], d["miss_overhead_fraction"]) == (round(saved, 4), 0.0)
    assert d["costs"]["miss_overhead_ratio"] == 0.0
    assert "miss_overhead_ratio -0.063 counted as 0" in d["costs"]["source"]


@pytest.mark.parametrize(("fields", "args", "message"), [
    ({}, ["--offload-mode", "lmcache_driven"], "measured engine_driven"),
    ({"miss_overhead_ratio": "fast"}, [], "miss_overhead_ratio is 'fast'"),
    ({"transfer_mode": "pickle"}, [], "transfer_mode 'pickle'"),
    ({"miss_overhead_ratio": -1.0}, [], "miss_overhead_ratio is -1.0, not a number > -1"),
    ({"l1_ttft_ratio": -0.01}, [], "l1_ttft_ratio is -0.01, not a number >= 0"),
])
def test_bad_costs_exit_2_naming_the_field(tmp_path, fields, args, message):
    costs = bench_json(tmp_path / "bench.json", **fields)
    res = invoke("--max-model-len", "8192", "--offload-costs", str(costs), *args)
    assert res.exit_code == 2
    assert message in res.stderr


def test_unknown_mode_exits_2():
    res = invoke("--max-model-len", "8192", "--offload-mode", "fast")
    assert res.exit_code == 2
    assert "--offload-mode 'fast'" in res.stderr


def test_readable_plan_says_what_to_do():
    res = invoke("--max-model-len", "8192", "--p50", "4000", "--distinct-prefixes", "400", "--prefix-tokens", "3000",
                 "--offload-mode", "engine_driven")
    assert res.exit_code == 0, res.output
    assert "offload (engine_driven, as --offload-mode asked): enable:" in res.stdout
    assert "    kvops offload serve --config kvops.yaml" in res.stdout
    res = invoke("--max-model-len", "8192", "--offload-mode", "engine_driven")
    assert "offload (engine_driven, as --offload-mode asked): leave it off: no prefix reuse" in res.stdout


def test_without_the_options_the_plan_has_no_decision():
    doc = plan("--max-model-len", "8192", "--distinct-prefixes", "400", "--prefix-tokens", "3000")
    assert "offload_decision" not in doc
    assert "transfer_mode" not in doc["kvops_yaml"]["offload"]


def test_auto_on_a_cpu_plan_judges_the_shared_l1_mode_and_leaves_the_setting_auto():
    doc = plan("--device", "cpu", "--memory-gib", "64", "--max-model-len", "8192", "--p50", "5000",
               "--distinct-prefixes", "10000", "--prefix-tokens", "1000", "--offload-mode", "auto")
    d = doc["offload_decision"]
    assert d["costs"]["transfer_mode"] == "engine_driven"
    assert d["transfer_mode"].startswith("engine_driven (auto on --device cpu: L1 shared through /dev/shm")
    assert d["recommendation"] == "enable"
    assert "transfer_mode" not in doc["kvops_yaml"]["offload"]  # the plugin's own auto picks it


# Issue 43: the hit ratios scale with the model and the machine. Llama 3.1 8B's matmul FLOPs per
# prompt token, from its config: per layer q and o 4096 x 4096, k and v 4096 x 1024 (8 KV heads x
# 128), gate, up and down 4096 x 14336; 32 layers; 2 FLOPs per weight (the LM head runs for the
# last token only).
LLAMA_FLOPS = 2 * 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
FIGURES = {"load_copy_fraction_of_memcpy": {"l1": 0.10, "disk": 0.05}, "hit_overhead_s": {"l1": 0.02, "disk": 0.04},
           "memcpy_gb_per_s": 10.0, "cold_prefill_tokens_per_s": 1000.0, "prefill_flops_per_token": 2.0e8}
CPU = ("--device", "cpu", "--memory-gib", "64")


def hand_ratio(copy_fraction: float, overhead_s: float, hit_tokens: int) -> float:
    """FIGURES' machine: a hit loads tokens x 131,072 B at copy_fraction x 10 GB/s plus the fixed
    time; recomputing runs at 1,000 tokens/s x 2e8 / LLAMA_FLOPS."""
    load_s = hit_tokens * KV_BYTES / (copy_fraction * 10e9) + overhead_s
    return load_s / (hit_tokens / (1000.0 * 2.0e8 / LLAMA_FLOPS))


def test_a_cpu_plan_recomputes_the_hit_ratios_from_the_bench_files_machine_figures(tmp_path):
    """1,000-token prefixes of 5,000-token requests: a hit loads 1,000 tokens (125 MiB); at
    14.3 tokens/s of Llama 3.1 8B (1,000 of a 2e8-FLOP model) recomputing them takes ~70 s."""
    costs = bench_json(tmp_path / "bench.json", transfer_mode="lmcache_driven", **FIGURES)
    doc = prefixes("auto", 10_000, 1000, 5000, *CPU, "--offload-costs", str(costs))
    c = doc["offload_decision"]["costs"]
    assert c["l1_ttft_ratio"] == pytest.approx(hand_ratio(0.10, 0.02, 1000), rel=1e-5)
    assert c["disk_ttft_ratio"] == pytest.approx(hand_ratio(0.05, 0.04, 1000), rel=1e-5)
    assert c["miss_overhead_ratio"] == 0.01  # the file's, as measured
    assert c["derivation"].startswith("recomputed for this model on the measuring machine: a hit of 1,000 tokens "
                                      "loads 125.0 MiB at 10.0% (L1) / 5.0% (disk) of 10.0 GB/s memcpy")
    d = doc["offload_decision"]
    gpu = 0.2 * min(1, (doc["capacity"]["kv_cache_size_tokens"] // 1024) / 10_000)
    saved, overhead = time_model((c["l1_ttft_ratio"], c["disk_ttft_ratio"], 0.01), gpu, 0.2, 0.2)
    assert (d["prefill_saved_fraction"], d["miss_overhead_fraction"]) == (round(saved, 4), round(overhead, 4))
    text = invoke("--max-model-len", "8192", "--p50", "5000", "--distinct-prefixes", "10000", "--prefix-tokens",
                  "1000", "--offload-mode", "auto", *CPU, "--offload-costs", str(costs)).stdout
    assert "  hit costs: recomputed for this model on the measuring machine" in text


def test_a_faster_prefill_on_the_same_copy_makes_a_hit_weigh_more(tmp_path):
    """Issue 43's point: the load is the transfer's, the recompute the machine's; three times the
    prefill rate at the same copy share triples the ratio, bar nothing."""
    slow = bench_json(tmp_path / "slow.json", transfer_mode="lmcache_driven", **FIGURES)
    fast = bench_json(tmp_path / "fast.json", transfer_mode="lmcache_driven",
                      **{**FIGURES, "cold_prefill_tokens_per_s": 3000.0})
    ratios = [prefixes("auto", 10_000, 1000, 5000, *CPU, "--offload-costs", str(f))["offload_decision"]["costs"]
              ["l1_ttft_ratio"] for f in (slow, fast)]
    assert ratios[1] == pytest.approx(3 * ratios[0], rel=1e-4)


def test_a_bench_file_without_the_figures_keeps_its_measured_ratios_and_says_so(tmp_path):
    costs = bench_json(tmp_path / "old.json", transfer_mode="lmcache_driven")
    c = prefixes("auto", 10_000, 1000, 5000, *CPU, "--offload-costs", str(costs))["offload_decision"]["costs"]
    assert (c["l1_ttft_ratio"], c["disk_ttft_ratio"], c["figures"]) == (0.05, 0.08, None)
    assert c["derivation"].startswith(f"the measured ratios: {costs} has no load_copy_fraction_of_memcpy.l1 "
                                      "(an older kvops bench offload)")


def test_a_gpu_plan_keeps_the_measured_ratios_and_says_why(tmp_path):
    costs = bench_json(tmp_path / "bench.json", **FIGURES)
    c = prefixes("engine_driven", 10_000, 1000, 5000, "--offload-costs", str(costs))["offload_decision"]["costs"]
    assert (c["l1_ttft_ratio"], c["disk_ttft_ratio"]) == (0.05, 0.08)
    assert c["derivation"].startswith("the measured ratios: on a GPU a load crosses the host link")


def test_the_built_in_cpu_costs_scale_too_and_name_the_reference_machine():
    """core/offload/costs.py's reference CPU for auto (engine_driven): 40.8% of 13.01 GB/s, 51.9 ms
    fixed per L1 hit, of which vLLM's own one-token hit 30.9 ms for the 276,867,288 bytes its step
    read (grown by what Llama's step reads), 1,157.6 tokens/s of the 205,520,896-FLOP reference
    model."""
    c = prefixes("auto", 10_000, 1000, 5000, *CPU)["offload_decision"]["costs"]
    step_s = 0.0309 * ((LLAMA_WEIGHT_BYTES + 1000 * KV_BYTES) / 276_867_288 - 1)
    load_s = 1000 * KV_BYTES / (0.408 * 13.01e9) + 0.0519 + step_s
    assert c["l1_ttft_ratio"] == pytest.approx(load_s / (1000 / (1157.6 * 205_520_896 / LLAMA_FLOPS)), rel=1e-5)
    assert "kvops' reference CPU's" in c["derivation"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"load_copy_fraction_of_memcpy": {"l1": 0, "disk": 0.05}}, "load_copy_fraction_of_memcpy.l1 is 0, not a number > 0"),
    ({"hit_overhead_s": {"l1": 0.02, "disk": -0.1}}, "hit_overhead_s.disk is -0.1, not a number >= 0"),
    ({"cold_prefill_tokens_per_s": "fast"}, "cold_prefill_tokens_per_s is 'fast'"),
])
def test_bad_figures_exit_2_naming_the_key(tmp_path, fields, message):
    costs = bench_json(tmp_path / "bench.json", transfer_mode="lmcache_driven", **{**FIGURES, **fields})
    res = invoke("--max-model-len", "8192", *CPU, "--offload-costs", str(costs))
    assert res.exit_code == 2
    assert message in res.stderr


# Llama 3.1 8B's bf16 weights, counted from its config by hand: per layer q and o 4096 x 4096,
# k and v 4096 x 1024, gate/up/down 4096 x 14336, two norms of 4096; 32 layers; embedding and an
# untied LM head of 128,256 x 4096; the final norm; and the rotary cos/sin cache vLLM holds
# beside them (vllm rotary_embedding/base.py: 131,072 positions x head_dim 128, in bf16).
LLAMA_WEIGHT_BYTES = 2 * (32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
                          + 2 * 128_256 * 4096 + 4096 + 131_072 * 128)


def test_the_step_computing_a_hits_last_token_grows_with_the_weights_it_reads(tmp_path):
    """A bench file that measured vLLM's own one-token hit (30 ms for a 2e8-byte model and its
    2,048-token prompt's KV at 32 KiB a token) scales that share of the fixed time by what Llama's
    step reads: its weights (16.06 GB) and the hit's 1,000 tokens of KV (131,072,000 B), ~60.6x:
    ~1.8 s more per hit than the bench model's, on top of FIGURES' load and fixed time."""
    floor_bytes = 2.0e8 + 2048 * 32768
    costs = bench_json(tmp_path / "bench.json", transfer_mode="lmcache_driven", **FIGURES,
                       prefix_hit_ttft_s=0.03, weight_bytes=2.0e8, kv_bytes_per_token=32768)
    c = prefixes("auto", 10_000, 1000, 5000, *CPU, "--offload-costs", str(costs))["offload_decision"]["costs"]
    added = 0.03 * ((LLAMA_WEIGHT_BYTES + 1000 * KV_BYTES) / floor_bytes - 1)
    recompute = 1000 / (1000.0 * 2.0e8 / LLAMA_FLOPS)
    assert c["l1_ttft_ratio"] == pytest.approx(hand_ratio(0.10, 0.02, 1000) + added / recompute, rel=1e-4)
    assert c["disk_ttft_ratio"] == pytest.approx(hand_ratio(0.05, 0.04, 1000) + added / recompute, rel=1e-4)
    assert "of which vLLM's own one-token hit 30 ms" in c["derivation"]
    older = bench_json(tmp_path / "older.json", transfer_mode="lmcache_driven", **FIGURES)
    c = prefixes("auto", 10_000, 1000, 5000, *CPU, "--offload-costs", str(older))["offload_decision"]["costs"]
    assert c["l1_ttft_ratio"] == pytest.approx(hand_ratio(0.10, 0.02, 1000), rel=1e-5)
    assert "the figures have no one-token hit" in c["derivation"]


def test_a_bench_files_bad_floor_exits_2_naming_the_key(tmp_path):
    costs = bench_json(tmp_path / "bench.json", transfer_mode="lmcache_driven", **FIGURES,
                       prefix_hit_ttft_s=0.03, weight_bytes="lots", kv_bytes_per_token=32768)
    res = invoke("--max-model-len", "8192", "--p50", "5000", "--distinct-prefixes", "10000", "--prefix-tokens",
                 "1000", "--offload-mode", "auto", *CPU, "--offload-costs", str(costs))
    assert res.exit_code == 2
    assert f"--offload-costs {costs}: weight_bytes is 'lots', not a number > 0" in res.output
