"""CLI contract of the capacity commands: textbook numbers, JSON keys, verify exit codes, and
bad inputs → exit 2 with a message (fuzzed with hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvops.ops.cli.main import app

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
LLAMA_70B = FIXTURES / "meta-llama--Meta-Llama-3.1-70B.json"
LLAMA_8B = FIXTURES / "meta-llama--Meta-Llama-3.1-8B.json"
runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_textbook_bytes_per_token_and_10_gib() -> None:
    code, out = invoke("kv", "--config", str(LLAMA_70B), "--batch", "1", "--seq-len", "32768", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680
    assert data["batch"]["bytes"] == 327_680 * 32_768
    assert data["batch"]["gib"] == 10.0
    assert data["batch"]["gb"] == 10.73741824


def test_sum_of_request_lengths_form() -> None:
    code, out = invoke("kv", "--config", str(LLAMA_70B), "--lengths", "1000,3000,28768", "--json")
    assert code == 0, out
    assert json.loads(out)["requests"]["bytes"] == 327_680 * 32_768


def test_kv_capacity_json_contract_llama_8b_20_gib() -> None:
    # planner.md §3.2 oracle row: 32 layers × 8 heads × 128 × 2 × 2 B × 16 tokens = 2 MiB/block.
    code, out = invoke("kv-capacity", "--config", str(LLAMA_8B), "--kv-cache-memory-bytes",
                       str(20 << 30), "--max-model-len", "8192", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["bytes_per_block"] == 32 * 8 * 128 * 2 * 2 * 16
    assert data["num_blocks"] == (20 << 30) // data["bytes_per_block"] == 10_240
    assert data["kv_cache_size_tokens"] == 10_240 * 16
    assert data["max_concurrency"] == 10_240 / (8192 // 16)


def test_kv_capacity_too_small_names_the_largest_fitting_length() -> None:
    # 64 blocks of 16 tokens: one null block leaves 63 × 16 = 1008 tokens for one request.
    code, out = invoke("kv-capacity", "--config", str(LLAMA_8B), "--kv-cache-memory-bytes",
                       str(64 * 2 * 1024 * 1024), "--max-model-len", "8192")
    assert code == 2
    assert "max_model_len that fits is 1008" in out


def test_tp_not_dividing_heads_exits_2() -> None:
    code, out = invoke("kv-capacity", "--config", str(LLAMA_8B), "--kv-cache-memory-bytes", "1000000000",
                       "--max-model-len", "1024", "--tensor-parallel-size", "3")
    assert code == 2
    assert "tensor-parallel-size 3" in out


def test_plan_outputs_serve_line_and_yaml() -> None:
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192",
                       "--p50", "1000", "--p95", "4000", "--p99", "8000", "--json")
    assert code == 0, out
    plan = json.loads(out)
    assert plan["gpu_total_gib"] == 79.19
    assert plan["serve"].startswith("vllm serve meta-llama/Meta-Llama-3.1-8B ")
    assert f"--max-num-seqs {plan['max_num_seqs']}" in plan["serve"]
    # fp8 KV halves bytes per token of this GQA model: twice the blocks of the same pool.
    assert plan["fp8_alternative"]["num_blocks"] in (2 * plan["capacity"]["num_blocks"],
                                                     2 * plan["capacity"]["num_blocks"] + 1)
    code, out = invoke("plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--yaml")
    assert code == 0
    assert "gpu_memory_utilization:" in out


def test_verify_log_match_and_mismatch(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO ... CPU KV cache size: 524,288 tokens, Maximum concurrency for 2,048 tokens "
                   "per request: 256.00x\n")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"kv_cache_size_tokens": 524_288, "max_concurrency": 256.0}))
    bad.write_text(json.dumps({"kv_cache_size_tokens": 524_160, "max_concurrency": 255.9375}))
    assert invoke("verify", "--log", str(log), "--expect", str(good))[0] == 0
    code, out = invoke("verify", "--log", str(log), "--expect", str(bad))
    assert code == 3
    assert "kv_cache_size_tokens" in out


def test_verify_needs_exactly_one_source(tmp_path: Path) -> None:
    exp = tmp_path / "e.json"
    exp.write_text("{}")
    assert invoke("verify", "--expect", str(exp))[0] == 2


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
          "sliding_window", "layer_types", "kv_lora_rank", "torch_dtype", "hybrid_override_pattern",
          "index_topk", "index_head_dim", "index_topk_freq", "index_topk_pattern", "model_type",
          "global_head_dim", "num_global_key_value_heads", "per_layer_config", "num_kv_shared_layers")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(broken=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=4))
def test_fuzzed_bad_configs_exit_2(tmp_path: Path, broken: dict[str, object]) -> None:
    cfg = json.loads(LLAMA_8B.read_text())
    cfg.update(broken)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out = invoke("kv-capacity", "--config", str(path), "--kv-cache-memory-bytes", str(8 << 30),
                       "--max-model-len", "4096", "--json")
    # A mutation may still be a valid model; otherwise it must be a clean exit 2, never a crash.
    assert code in (0, 2), out
    if code == 2:
        assert out.startswith("kvops: ")
        assert "\n" == out[-1]
        assert out.count("\n") == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(memory=st.integers(-10**12, 10**5), mml=st.integers(-10**6, 0) | st.integers(10**7, 10**9))
def test_fuzzed_sizes_exit_2(memory: int, mml: int) -> None:
    code, out = invoke("kv-capacity", "--config", str(LLAMA_8B), "--kv-cache-memory-bytes", str(memory),
                       "--max-model-len", str(mml))
    assert code == 2, out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_fuzzed_malformed_json_exits_2(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    code, out = invoke("kv-capacity", "--config", str(path), "--kv-cache-memory-bytes", "1000000000",
                       "--max-model-len", "1024")
    assert code == 2, out


def test_speculative_flags_size_a_hybrid_and_bad_ones_exit_2() -> None:
    nemotron = str(FIXTURES / "nvidia--Nemotron-H-56B-Base-8K.json")
    base = ("kv-capacity", "--config", nemotron, "--kv-cache-memory-bytes", str(20 << 30),
            "--max-model-len", "8192", "--json")
    _, plain = invoke(*base)
    code, out = invoke(*base, "--num-speculative-tokens", "3", "--speculative-method", "mtp", "--draft-layers", "1")
    assert code == 0, out
    # 3 more state blocks per request and wider conv states: fewer requests fit
    assert json.loads(out)["max_concurrency"] < json.loads(plain)["max_concurrency"]
    code, out = invoke(*base, "--num-speculative-tokens", "3")
    assert code == 2
    assert "--speculative-method" in out
    assert "Traceback" not in out


GEMMA4 = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "torch_dtype": "bfloat16",
          "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
          "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 1024,
          "hidden_size": 2048}
SPARSE_MLA = {"architectures": ["DeepseekV32ForCausalLM"], "torch_dtype": "bfloat16", "num_hidden_layers": 8,
              "num_attention_heads": 16, "hidden_size": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "index_topk": 2048, "index_head_dim": 128}
NEW_FIELDS = ("num_hidden_layers", "head_dim", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
              "sliding_window", "layer_types", "per_layer_config", "use_bidirectional_attention",
              "num_kv_shared_layers", "index_head_dim", "index_topk_freq", "index_topk_pattern",
              "index_skip_topk_offset", "kv_lora_rank")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.sampled_from([GEMMA4, SPARSE_MLA]),
       broken=st.dictionaries(st.sampled_from(NEW_FIELDS), JSON_VALUES, min_size=1, max_size=3),
       extra=st.sampled_from([(), ("--num-speculative-tokens", "2"), ("--speculative-method", "mtp"),
                              ("-pp", "2", "--pp-layer-partition", "3,x"), ("-pp", "2", "--pp-layer-partition", "6,6"),
                              ("--num-speculative-tokens", "-1", "--speculative-method", "eagle")]))
def test_fuzzed_gemma4_and_sparse_mla_configs_exit_2(
    tmp_path: Path, base: dict[str, object], broken: dict[str, object], extra: tuple[str, ...],
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **broken}))
    code, out = invoke("kv-capacity", "--config", str(path), "--kv-cache-memory-bytes", str(8 << 30),
                       "--max-model-len", "4096", "--json", *extra)
    assert code in (0, 2), out
    if code == 2:
        assert out.startswith("kvops: ")
        assert out.count("\n") == 1
