"""VLLM_PP_LAYER_PARTITION (uneven pipeline split) against vLLM 0.32.

The oracle sets the environment variable and lets vLLM's own ``get_pp_indices`` give each stage
its layers (run_pp in test_capacity_oracle), then runs ``get_kv_cache_configs`` with one worker
per stage. Our side gets the same string through ``--pp-layer-partition``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_capacity_oracle import FIXTURES, GIB, Oracle, capacity_or_none, run_pp, synthetic_configs
from typer.testing import CliRunner

from kvops.core.errors import BadInputError
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity, parse_pp_layer_partition
from kvops.ops.capacity.model import read_model
from kvops.ops.cli.main import app

Result = tuple[int, int, float] | None


def config(name: str) -> dict[str, Any]:
    files = {"llama_8b": "meta-llama--Meta-Llama-3.1-8B.json", "gpt_oss_20b": "openai--gpt-oss-20b.json",
             "deepseek_v3": "deepseek-ai--DeepSeek-V3.json"}
    cfg = json.loads((FIXTURES / files[name]).read_text()) if name in files else synthetic_configs()[name]
    cfg.setdefault("torch_dtype", "bfloat16")
    return cfg


def partitions(n: int) -> list[str]:
    """Skewed splits a user would export: heavy first, heavy last, heavy middle."""
    out = []
    for pp in (2, 3, 4):
        out.append(",".join(map(str, [n - (pp - 1), *([1] * (pp - 1))])))
        out.append(",".join(map(str, [*([1] * (pp - 1)), n - (pp - 1)])))
        middle = [max(1, n // (2 * pp))] * pp
        middle[pp // 2] += n - sum(middle)
        out.append(",".join(map(str, middle)))
    return out


def ours(cfg: dict[str, Any], case: dict[str, Any]) -> Result:
    model = read_model(cfg, tp=case["tp"], kv_cache_dtype=case["kv"])
    flags = SizingFlags(max_model_len=case["mml"], device=case["device"], max_num_batched_tokens=case["mnbt"],
                        pipeline_parallel_size=case["pp"], pp_layer_partition=parse_pp_layer_partition(case["split"]))
    return capacity_or_none(model, case["budget"], flags)


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


@pytest.mark.parametrize("name", ["llama_8b", "gpt_oss_20b", "deepseek_v3", "gemma_like_5to1", "qwen3_next"])
def test_uneven_partition_matches_vllm(oracle: Oracle, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    cfg = config(name)
    for split in partitions(cfg["num_hidden_layers"]):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", split)
        for budget in (int(2.5 * GIB), 20 * GIB):
            for mml, device in ((4096, "cuda"), (32_000, "cuda"), (8192, "cpu")):
                case = {"budget": budget, "mml": mml, "tp": 1, "kv": "auto", "device": device, "mnbt": 2048,
                        "pp": split.count(",") + 1, "split": split}
                if device == "cpu" and cfg.get("kv_lora_rank"):
                    continue
                expected = run_pp(oracle, cfg, case)
                assert ours(cfg, case) == expected, f"{name} {case}: vLLM {expected}"


def test_partition_that_vllm_rejects_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    model = read_model(config("llama_8b"))  # 32 layers
    for split, pp in (("10,10", 2), ("16,16", 3)):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", split)
        with pytest.raises(ValueError, match="does not match"):
            get_pp_indices(32, 0, pp)
        flags = SizingFlags(max_model_len=4096, pipeline_parallel_size=pp,
                            pp_layer_partition=parse_pp_layer_partition(split))
        with pytest.raises(BadInputError, match="VLLM_PP_LAYER_PARTITION"):
            kv_capacity(model, 20 * GIB, flags)
    for bad in ("16;16", "0,32", "a"):
        with pytest.raises(BadInputError, match="VLLM_PP_LAYER_PARTITION"):
            parse_pp_layer_partition(bad)


def test_cli_and_serve_line_carry_the_partition() -> None:
    llama = str(FIXTURES / "meta-llama--Meta-Llama-3.1-8B.json")
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--config", llama, "--max-model-len", "8192", "--gpu", "H100",
                                 "-pp", "2", "--pp-layer-partition", "20,12", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["pp_layer_partition"] == [20, 12]
    assert plan["serve"].startswith("VLLM_PP_LAYER_PARTITION=20,12 vllm serve ")
    result = runner.invoke(app, ["kv-capacity", "--config", llama, "--max-model-len", "8192", "-pp", "2",
                                 "--kv-cache-memory-bytes", str(20 * GIB), "--pp-layer-partition", "20,10"])
    assert result.exit_code == 2
    assert "summing to the model's 32 decoder layers" in result.output
