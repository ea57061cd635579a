"""``kvops bench fp8``'s real-model section reads text a Debian package ships, calibrates and
evaluates on disjoint passages, and keeps its JSON keys (the accuracy figures themselves are the
bench's, not a test's)."""

from __future__ import annotations

from pathlib import Path

from kvops.core.fp8.scales import SEARCHED_TENSORS
from kvops.ops.bench import fp8_real
from kvops.ops.fp8.kv_scaled_model import build_kv_scaled_model
from kvops.ops.models.tiny import TinyModelSpec


def test_calibration_and_evaluation_passages_are_disjoint_license_text() -> None:
    calibration = fp8_real.paragraphs(fp8_real.CALIBRATION_TEXT, fp8_real.CALIBRATION_PASSAGES)
    evaluation = [p for name in fp8_real.EVALUATION_TEXTS for p in fp8_real.paragraphs(name, 100)]
    assert len(calibration) == fp8_real.CALIBRATION_PASSAGES
    assert len(evaluation) >= fp8_real.EVALUATION_PASSAGES
    assert not set(calibration) & set(evaluation)
    assert all(len(p.split()) >= 40 for p in calibration + evaluation)


KEYS_BEFORE_THE_SEARCH = {
    "model", "method", "calibration_text", "evaluation_text", "verdict", "threshold", "sequences", "tokens",
    "bf16_perplexity", "skip_layers", "scales_source", "variants", "perplexity_ratio_scale1",
    "perplexity_ratio_calibrated", "perplexity_ratio_calibrated_skip", "goal_perplexity_ratio", "goal_met",
    "moonshot_met", "calibrated_not_worse_than_scale1",
}


def test_the_section_keeps_its_keys_and_adds_the_method_and_absmax_figures(tmp_path: Path) -> None:
    """The whole section on a tiny random model with few, short passages (the figures are the
    bench's on SmolLM2; here only what the JSON holds)."""
    model_dir = build_kv_scaled_model(tmp_path / "model", 30.0, TinyModelSpec(layers=2))
    out = fp8_real.run(model_dir, calibration_passages=3, evaluation_passages=2, max_tokens=32, greedy_tokens=2)
    assert KEYS_BEFORE_THE_SEARCH <= set(out)
    assert out["scale_method"] in SEARCHED_TENSORS
    assert out["scales_source"] == f"the scales file ({out['scale_method']})"
    variants = out["variants"]
    assert out["perplexity_ratio_absmax"] == variants[fp8_real.ABSMAX_VARIANT]["perplexity_ratio"]
    assert out["mean_kl_absmax"] == variants[fp8_real.ABSMAX_VARIANT]["mean_kl"]
    assert out["mean_kl_calibrated"] == variants["fp8 calibrated"]["mean_kl"]
    assert out["mean_kl_scale1"] == variants["fp8 scale 1.0"]["mean_kl"]
    assert (out["perplexity_ratio_calibrated_skip"] is None) == (out["mean_kl_calibrated_skip"] is None)
    assert out["calibrated_not_worse_than_scale1"] == (out["perplexity_ratio_calibrated"] <= out["perplexity_ratio_scale1"])
