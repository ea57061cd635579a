"""The typed plan (kvops.core.plan): what ``kvops plan --json`` and ``kvops kv-capacity --json``
print, read back into the core types, prints the very same JSON; the keys are the ones the plan
had as a dict (listed here from its output before it became a type); ``--expect`` reads a plan
and a kv-capacity document of the same pool alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.core.plan import Capacity, Expectation, Plan, read_expectation
from kvops.ops.cli.main import app

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
runner = CliRunner()

# A dense GQA model with offload sizes, a sliding-window MoE on two PP stages, an MLA model on
# 8 × 2 ranks from a lengths file, a mamba hybrid with a drafter.
PLANS = [
    ("meta-llama--Meta-Llama-3.1-8B.json", ["--gpu", "H100", "--max-model-len", "8192", "--p50", "1000",
                                            "--distinct-prefixes", "50", "--prefix-tokens", "2000"]),
    ("openai--gpt-oss-20b.json", ["--gpu", "H200", "--max-model-len", "32768", "-pp", "2", "--headroom", "0.1"]),
    ("deepseek-ai--DeepSeek-V3.json", ["--gpu", "H200", "-tp", "8", "-pp", "2", "--max-model-len", "16384",
                                       "--lengths-file", "LENGTHS", "--risk-quantile", "0.9",
                                       "--distinct-prefixes", "300", "--prefix-tokens", "3000",
                                       "--host-memory-gib", "10"]),
    ("nvidia--Nemotron-H-56B-Base-8K.json", ["--gpu", "B200", "-tp", "4", "--max-model-len", "8192", "--draft-layers", "1",
                                             "--num-speculative-tokens", "2", "--speculative-method", "mtp"]),
]
PLAN_KEYS = ["device", "gpu_total_gib", "tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition",
             "gpu_memory_utilization", "max_num_seqs", "max_num_seqs_why", "max_model_len",
             "max_num_batched_tokens", "kv_cache_dtype", "non_kv", "non_kv_sources", "available_kv_gib",
             "capacity", "workload", "fp8_alternative", "calibration", "notes", "weights_source", "offload",
             "kvops_yaml", "serve"]
CAPACITY_KEYS = ["num_blocks", "block_size", "bytes_per_block", "kv_cache_size_tokens", "max_concurrency",
                 "max_model_len", "available_kv_bytes", "usable_blocks", "blocks_per_request",
                 "max_in_flight_tokens", "mamba_page_padded_bytes", "groups", "notes", "log_line"]
WHY_KEYS = ["risk_quantile", "length_at_quantile", "blocks_per_request_at_quantile", "usable_blocks",
            "headroom_fraction", "budget_blocks", "fit_at_quantile", "caps", "binding", "rounded_to_capture_step",
            "mean_length", "mean_load_concurrency"]
OFFLOAD_SIZED = ["lmcache_cpu_gib", "lmcache_disk_gib", "working_set_gib", "bytes_per_prefix", "chunk_tokens", "why"]
OFFLOAD_NONE = ["lmcache_cpu_gib", "lmcache_disk_gib", "working_set_gib", "warning"]


def plan_json(tmp_path: Path, name: str, args: list[str]) -> str:
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("prompt_tokens,output_tokens,count\n100,50,10\n1000,200,5\n3000,500,2\n9000,100,1\n")
    args = [str(lengths) if a == "LENGTHS" else a for a in args]
    result = runner.invoke(app, ["plan", "--config", str(FIXTURES / name), *args, "--json"])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


@pytest.mark.parametrize(("name", "args"), PLANS)
def test_plan_json_round_trips_through_the_core_type(tmp_path: Path, name: str, args: list[str]) -> None:
    printed = plan_json(tmp_path, name, args)
    plan = Plan.model_validate_json(printed)
    assert plan.to_json() == printed
    doc = json.loads(printed)
    assert list(doc) == PLAN_KEYS
    assert list(doc["capacity"]) == CAPACITY_KEYS
    assert list(doc["max_num_seqs_why"]) == WHY_KEYS
    assert list(doc["non_kv"]) == list(doc["non_kv_sources"]) == [
        "weights_gib", "activation_gib", "non_torch_gib", "cudagraph_gib"]
    # offload keys that do not apply stay absent, not null
    assert list(doc["offload"]) in (OFFLOAD_SIZED, OFFLOAD_SIZED + ["warning"], OFFLOAD_NONE)


def test_offload_without_reuse_keeps_only_its_warning(tmp_path: Path) -> None:
    doc = json.loads(plan_json(tmp_path, "meta-llama--Meta-Llama-3.1-8B.json",
                               ["--gpu", "H100", "--max-model-len", "8192"]))
    assert list(doc["offload"]) == OFFLOAD_NONE
    assert doc["offload"]["lmcache_cpu_gib"] is None


@pytest.mark.parametrize("name", ["meta-llama--Meta-Llama-3.1-8B.json", "openai--gpt-oss-20b.json",
                                  "nvidia--Nemotron-H-56B-Base-8K.json"])
def test_kv_capacity_json_round_trips_and_reads_as_the_plans_capacity(tmp_path: Path, name: str) -> None:
    # The plan's pool sized again by kv-capacity from the same bytes: one Capacity, two commands.
    plan = Plan.model_validate_json(plan_json(tmp_path, name, ["--gpu-memory-gib", "300", "--max-model-len", "8192"]))
    result = runner.invoke(app, [
        "kv-capacity", "--config", str(FIXTURES / name), "--max-model-len", "8192",
        "--kv-cache-memory-bytes", str(plan.capacity.available_kv_bytes),
        "--max-num-batched-tokens", str(plan.max_num_batched_tokens), "--json"])
    assert result.exit_code == 0, result.output
    printed = result.stdout.strip()
    capacity = Capacity.model_validate_json(printed)
    assert capacity.to_json() == printed
    assert capacity == plan.capacity
    as_plan, as_capacity = (tmp_path / "plan.json", tmp_path / "capacity.json")
    as_plan.write_text(plan.to_json())
    as_capacity.write_text(printed)
    from_plan, from_capacity = read_expectation(as_plan), read_expectation(as_capacity)
    assert from_plan.capacity == from_capacity.capacity
    assert (from_plan.is_plan, from_capacity.is_plan) == (True, False)
    assert (from_plan.max_num_seqs, from_capacity.max_num_seqs) == (plan.max_num_seqs, None)
    assert from_plan.non_kv == plan.non_kv


def test_expectation_refuses_a_field_of_the_wrong_type() -> None:
    with pytest.raises(BadInputError, match=r"--expect x.json: num_blocks: .*kvops plan --json"):
        Expectation.from_document({"num_blocks": "many", "block_size": 16}, "--expect x.json")
    with pytest.raises(BadInputError, match="not a JSON object"):
        Expectation.from_document([1, 2])


def test_verify_with_an_expectation_of_the_wrong_type_exits_2(tmp_path: Path) -> None:
    log, expect = tmp_path / "server.log", tmp_path / "e.json"
    log.write_text("INFO ... CPU KV cache size: 524,288 tokens, Maximum concurrency for 2,048 tokens "
                   "per request: 256.00x\n")
    expect.write_text(json.dumps({"kv_cache_size_tokens": "524288"}))
    result = runner.invoke(app, ["verify", "--log", str(log), "--expect", str(expect)])
    assert result.exit_code == 2
    assert "kv_cache_size_tokens" in result.output
    assert "Traceback" not in result.output
