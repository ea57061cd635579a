"""``kvops plan --kv-scales``: the skip layers a calibrated scales file advises are sized, costed
and passed to the serve line; kvops.yaml loads the file. The sizes come from the allocator that
tests/ops/test_capacity_oracle_kv_dtypes.py checks against vLLM's own spec code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.core.fp8.scales import AccuracySummary, LayerScales, ScalesFile, fingerprint_of_config
from kvops.ops.cli.main import app

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
LLAMA_8B = FIXTURES / "meta-llama--Meta-Llama-3.1-8B.json"
PLAN = ["plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192", "--json"]


def _scales(tmp_path: Path, skip: list[int], config: Path = LLAMA_8B) -> Path:
    raw = json.loads(config.read_text())
    accuracy = AccuracySummary(sequences=4, tokens=400, threshold=1.005, bf16_perplexity=20.0,
                               scale1_perplexity_ratio=1.03, scale1_mean_kl=0.01, calibrated_perplexity_ratio=1.012,
                               calibrated_mean_kl=0.008, skip_layers=skip, skip_perplexity_ratio=1.004,
                               skip_mean_kl=0.004, safe=True)
    scales = ScalesFile(dtype="fp8_e4m3", model=fingerprint_of_config(raw), accuracy=accuracy,
                        layers={f"model.layers.{i}.self_attn.attn": LayerScales(k_scale=0.05, v_scale=0.02)
                                for i in range(raw["num_hidden_layers"])})
    path = tmp_path / "scales.json"
    path.write_text(scales.model_dump_json())
    return path


def _plan(*extra: str) -> dict[str, object]:
    out = CliRunner().invoke(app, [*PLAN, *extra])
    assert out.exit_code == 0, out.output
    result: dict[str, object] = json.loads(out.output)
    return result


def test_advised_layers_are_sized_and_served(tmp_path: Path) -> None:
    scales = _scales(tmp_path, [0, 31])
    advised = _plan("--kv-cache-dtype", "fp8", "--kv-scales", str(scales))
    by_hand = _plan("--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0,31")
    plain = _plan("--kv-cache-dtype", "fp8")
    assert advised["capacity"] == by_hand["capacity"]
    assert advised["capacity"]["kv_cache_size_tokens"] < plain["capacity"]["kv_cache_size_tokens"]  # type: ignore[index]
    assert "--kv-cache-dtype-skip-layers 0 31" in str(advised["serve"])
    assert advised["kvops_yaml"]["kv_scales"] == {"path": str(scales.resolve())}  # type: ignore[index]
    note = next(n for n in advised["notes"] if "skip layers 0 31" in n)  # type: ignore[attr-defined]
    tokens = f"{advised['capacity']['kv_cache_size_tokens']:,} KV tokens instead of "  # type: ignore[index]
    assert tokens + f"{plain['capacity']['kv_cache_size_tokens']:,}" in note  # type: ignore[index]


def test_given_skip_layers_win_over_the_advice(tmp_path: Path) -> None:
    scales = _scales(tmp_path, [0, 31])
    plan = _plan("--kv-cache-dtype", "fp8", "--kv-scales", str(scales), "--kv-cache-dtype-skip-layers", "5")
    assert "--kv-cache-dtype-skip-layers 5 " in str(plan["serve"]) + " "
    assert any("advises --kv-cache-dtype-skip-layers 0 31" in n for n in plan["notes"])  # type: ignore[attr-defined]


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-cache-dtype", "auto"], "--kv-scales applies to --kv-cache-dtype fp8"),
    (["--kv-cache-dtype", "fp8", "--config", str(FIXTURES / "meta-llama--Meta-Llama-3.1-70B.json")],
     "was calibrated for another model"),
])
def test_scales_that_cannot_apply_are_one_line(tmp_path: Path, extra: list[str], message: str) -> None:
    args = [*PLAN, "--kv-scales", str(_scales(tmp_path, [0])), *extra]
    if "--config" in extra:  # the 70B config replaces the 8B one
        args = [a for a in args if a != str(LLAMA_8B)]
        args.remove("--config")
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2, out.output
    assert message in out.output
