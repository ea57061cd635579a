"""``kvops bench fp8``'s ``real_model``: what fp8 KV does to a trained model's predictions.

SmolLM2-135M-Instruct (``kvops model smollm2``) scores license texts that Debian ships: scales
are calibrated on GPL-3 paragraphs and the A/B runs on other licenses' paragraphs (disjoint).
It runs offline (kvops.ops.fp8.offline: a transformers forward whose attention reads K/V through
vLLM's fp8 round trip), so the figures are the same on any CPU, and on one where vLLM refuses
fp8 KV (AVX2) too; the server-side keys of the bench need fp8 KV servers.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kvops.core.fp8.scales import LayerScales, ScalesFile, fingerprint_of_config, read_model_config

LICENSES = Path("/usr/share/common-licenses")
CALIBRATION_TEXT = "GPL-3"
EVALUATION_TEXTS = ("Apache-2.0", "MPL-2.0")
GOAL_RATIO, MOONSHOT_RATIO = 1.005, 1.002
CALIBRATION_PASSAGES, EVALUATION_PASSAGES, MAX_TOKENS, GREEDY_TOKENS = 24, 12, 128, 32


def paragraphs(name: str, count: int) -> list[str]:
    """The first ``count`` paragraphs of at least 40 words of a Debian license text."""
    text = (LICENSES / name).read_text()
    found = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in found if len(p.split()) >= 40][:count]


def _scales_file(model_dir: Path, scales: list[tuple[float, float]]) -> ScalesFile:
    return ScalesFile(dtype="fp8_e4m3", model=fingerprint_of_config(read_model_config(model_dir)),
                      layers={f"model.layers.{i}.self_attn.attn": LayerScales(k_scale=k, v_scale=v)
                              for i, (k, v) in enumerate(scales)})


def run(model_dir: Path | None = None) -> dict[str, Any]:
    """The A/B on SmolLM2 (built in a temporary folder unless given), keys for the bench JSON."""
    if model_dir is None:
        from kvops.ops.models.smollm2 import build_smollm2

        with tempfile.TemporaryDirectory(prefix="kvops-bench-fp8-real-") as tmp:
            return run(build_smollm2(Path(tmp) / "smollm2"))
    from kvops.ops.fp8.check import CheckRequest, offline_scales, run_check
    from kvops.ops.fp8.offline import load_offline_model

    calibration = paragraphs(CALIBRATION_TEXT, CALIBRATION_PASSAGES)
    evaluation = [p for name in EVALUATION_TEXTS for p in paragraphs(name, EVALUATION_PASSAGES)][:EVALUATION_PASSAGES]
    model = load_offline_model(model_dir)
    scales = offline_scales(model, model.encode(calibration, MAX_TOKENS), "fp8_e4m3")
    result = run_check(CheckRequest(model_dir=model_dir, prompts=tuple(evaluation), scales=_scales_file(model_dir, scales),
                                    threshold=GOAL_RATIO, max_tokens=MAX_TOKENS, greedy_tokens=GREEDY_TOKENS))
    ratios = {name: figures.perplexity_ratio for name, figures in result.variants.items()}
    calibrated = ratios["fp8 calibrated"]
    return {
        "model": "SmolLM2-135M-Instruct (bf16, kvops model smollm2)", "method": "offline transformers forward, "
        "vLLM's fp8 e4m3 round trip on the cached K/V (post-RoPE)",
        "calibration_text": f"{LICENSES}/{CALIBRATION_TEXT}: {len(calibration)} paragraphs",
        "evaluation_text": f"{', '.join(EVALUATION_TEXTS)} ({LICENSES}): {len(evaluation)} paragraphs",
        **result.as_json(),
        "perplexity_ratio_scale1": ratios["fp8 scale 1.0"], "perplexity_ratio_calibrated": calibrated,
        "perplexity_ratio_calibrated_skip": next((r for n, r in ratios.items() if "bf16 layers" in n), None),
        "goal_perplexity_ratio": GOAL_RATIO, "goal_met": calibrated <= GOAL_RATIO,
        "moonshot_met": calibrated <= MOONSHOT_RATIO,
        "calibrated_not_worse_than_scale1": calibrated <= ratios["fp8 scale 1.0"],
    }
