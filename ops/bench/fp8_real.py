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

from kvops.core.fp8.scales import (
    Fp8Format,
    LayerScales,
    ScaleMethod,
    ScalesFile,
    fingerprint_of_config,
    read_model_config,
    scale_from_absmax,
)

LICENSES = Path("/usr/share/common-licenses")
CALIBRATION_TEXT = "GPL-3"
EVALUATION_TEXTS = ("Apache-2.0", "MPL-2.0")
GOAL_RATIO, MOONSHOT_RATIO = 1.005, 1.002
CALIBRATION_PASSAGES, EVALUATION_PASSAGES, MAX_TOKENS, GREEDY_TOKENS = 24, 12, 128, 32
FMT: Fp8Format = "fp8_e4m3"
ABSMAX_VARIANT = "fp8 absmax scales"
"""The scales scale_from_absmax gives (what kvops calibrate wrote before the search)."""


def paragraphs(name: str, count: int) -> list[str]:
    """The first ``count`` paragraphs of at least 40 words of a Debian license text."""
    text = (LICENSES / name).read_text()
    found = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in found if len(p.split()) >= 40][:count]


def _scales_file(model_dir: Path, scales: list[tuple[float, float]], method: ScaleMethod) -> ScalesFile:
    return ScalesFile(dtype=FMT, scale_method=method, model=fingerprint_of_config(read_model_config(model_dir)),
                      layers={f"model.layers.{i}.self_attn.attn": LayerScales(k_scale=k, v_scale=v)
                              for i, (k, v) in enumerate(scales)})


def run(model_dir: Path | None = None, calibration_passages: int = CALIBRATION_PASSAGES,
        evaluation_passages: int = EVALUATION_PASSAGES, max_tokens: int = MAX_TOKENS,
        greedy_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """The A/B on SmolLM2 (built in a temporary folder unless given), keys for the bench JSON.

    The calibrated scales are kvops calibrate's offline rule (kvops.ops.fp8.scale_search, guarded
    against 1.0 on the calibration text); the absmax scales (scale_from_absmax of the same
    recording, the rule before the search) are measured beside them."""
    if model_dir is None:
        from kvops.ops.models.smollm2 import build_smollm2

        with tempfile.TemporaryDirectory(prefix="kvops-bench-fp8-real-") as tmp:
            return run(build_smollm2(Path(tmp) / "smollm2"), calibration_passages, evaluation_passages,
                       max_tokens, greedy_tokens)
    from kvops.ops.fp8.check import CheckRequest, run_check
    from kvops.ops.fp8.offline import load_offline_model
    from kvops.ops.fp8.scale_search import choose_by_model_kl, search_scales

    calibration = paragraphs(CALIBRATION_TEXT, calibration_passages)
    evaluation = [p for name in EVALUATION_TEXTS for p in paragraphs(name, evaluation_passages)][:evaluation_passages]
    model = load_offline_model(model_dir)
    sequences = model.encode(calibration, max_tokens)
    found = search_scales(model, sequences, FMT)
    scales, method = choose_by_model_kl(model, sequences, [(f.k.scale, f.v.scale) for f in found], FMT)
    absmax = tuple((scale_from_absmax(f.k.absmax, FMT), scale_from_absmax(f.v.absmax, FMT)) for f in found)
    del model, sequences, found  # the check loads its own copy
    result = run_check(CheckRequest(model_dir=model_dir, prompts=tuple(evaluation), scales=_scales_file(model_dir, scales, method),
                                    threshold=GOAL_RATIO, max_tokens=max_tokens, greedy_tokens=greedy_tokens,
                                    compare=((ABSMAX_VARIANT, absmax),)))
    return _figures(result.as_json(), method, len(calibration), len(evaluation))


def _figures(check: dict[str, Any], method: ScaleMethod, calibration: int, evaluation: int) -> dict[str, Any]:
    variants = check["variants"]
    ratios = {name: figures["perplexity_ratio"] for name, figures in variants.items()}
    calibrated, scale1 = ratios["fp8 calibrated"], ratios["fp8 scale 1.0"]
    skip = next((n for n in ratios if "bf16 layers" in n), None)
    return {
        "model": "SmolLM2-135M-Instruct (bf16, kvops model smollm2)", "method": "offline transformers forward, "
        "vLLM's fp8 e4m3 round trip on the cached K/V (post-RoPE)",
        "calibration_text": f"{LICENSES}/{CALIBRATION_TEXT}: {calibration} paragraphs",
        "evaluation_text": f"{', '.join(EVALUATION_TEXTS)} ({LICENSES}): {evaluation} paragraphs",
        **check,
        "scale_method": method,
        "perplexity_ratio_scale1": scale1, "perplexity_ratio_calibrated": calibrated,
        "perplexity_ratio_calibrated_skip": ratios[skip] if skip else None,
        "perplexity_ratio_absmax": ratios[ABSMAX_VARIANT],
        "mean_kl_scale1": variants["fp8 scale 1.0"]["mean_kl"],
        "mean_kl_calibrated": variants["fp8 calibrated"]["mean_kl"],
        "mean_kl_calibrated_skip": variants[skip]["mean_kl"] if skip else None,
        "mean_kl_absmax": variants[ABSMAX_VARIANT]["mean_kl"],
        "goal_perplexity_ratio": GOAL_RATIO, "goal_met": calibrated <= GOAL_RATIO,
        "moonshot_met": calibrated <= MOONSHOT_RATIO,
        "calibrated_not_worse_than_scale1": calibrated <= scale1,
    }
