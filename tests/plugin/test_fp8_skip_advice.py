"""The plugin warns when a scales file's skip-layer advice is not served (kvops calibrate
measured those layers' fp8 cost; the server quantizes them anyway)."""

from __future__ import annotations

from kvops.core.fp8.scales import AccuracySummary, LayerScales, ModelFingerprint, ScalesFile
from kvops.plugin.fp8.validate import Fp8Plan, skip_advice


def _plan(skip: list[int], source: str = "file") -> Fp8Plan:
    accuracy = AccuracySummary(sequences=2, tokens=100, threshold=1.005, bf16_perplexity=20.0,
                               scale1_perplexity_ratio=1.03, scale1_mean_kl=0.01, calibrated_perplexity_ratio=1.012,
                               calibrated_mean_kl=0.008, skip_layers=skip, safe=True)
    scales = ScalesFile(dtype="fp8_e4m3", accuracy=accuracy, layers={
        "model.layers.0.self_attn.attn": LayerScales(k_scale=0.1, v_scale=0.1)},
        model=ModelFingerprint(architecture="LlamaForCausalLM", num_layers=1, num_kv_heads=2, head_dim=64,
                               config_sha256="0"))
    return Fp8Plan("fp8_e4m3", source, scales, "scales.json", ())  # type: ignore[arg-type]


def test_unserved_advice_is_one_warning_naming_the_flag() -> None:
    line = skip_advice(_plan([1, 3]), ["3"])
    assert line is not None
    assert "\n" not in line
    assert "this server quantizes 1:" in line
    assert "--kv-cache-dtype-skip-layers 1 3" in line


def test_served_or_absent_advice_says_nothing() -> None:
    assert skip_advice(_plan([1, 3]), ["1", "3", "7"]) is None
    assert skip_advice(_plan([]), []) is None
    assert skip_advice(_plan([1], source="checkpoint"), []) is None  # the file's scales are not applied
