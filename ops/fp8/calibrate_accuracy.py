"""The step after ``kvops calibrate`` records scales: what each layer's fp8 KV costs, and which
layers to keep in bf16 (vLLM's ``--kv-cache-dtype-skip-layers``), written into the scales file.

Route: offline (kvops.ops.fp8.offline), not servers with --kv-cache-dtype-skip-layers. A
per-layer sweep is one configuration per layer (30 for SmolLM2): a server start each would take
tens of minutes on two cores, vLLM refuses fp8 KV on CPUs without AVX-512, and a forward pass
over the calibration prompts gives the same figures on any machine. The prompts are cut to a
token budget so the sweep stays within minutes on a small model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvops.core.fp8.scales import AccuracySummary, ScalesFile
from kvops.ops.fp8.check import layer_scales
from kvops.ops.fp8.offline import fp8_plan, load_offline_model
from kvops.ops.fp8.sensitivity import (
    DEFAULT_THRESHOLD,
    advise_skip_layers,
    layer_costs,
    measure,
    reference,
)

DEFAULT_TOKEN_BUDGET = 2048
"""Tokens of calibration prompts the sweep scores (SmolLM2: ~10 s a forward on two idle cores)."""
MAX_TOKENS_PER_PROMPT = 512


def within_budget(sequences: Sequence[Any], budget: int) -> list[Any]:
    """The first sequences whose tokens fit the budget (at least one, cut to it)."""
    kept, used = [], 0
    for ids in sequences:
        if used >= budget:
            break
        kept.append(ids[: budget - used])
        used += len(kept[-1])
    return [ids for ids in kept if len(ids) >= 2]


def with_accuracy(scales: ScalesFile, model_dir: Path, prompts: Sequence[str],
                  threshold: float = DEFAULT_THRESHOLD, token_budget: int = DEFAULT_TOKEN_BUDGET,
                  progress: Callable[[int], None] | None = None) -> ScalesFile:
    """scales with per-layer kl_alone / perplexity_ratio_alone and the model-level summary."""
    model = load_offline_model(model_dir)
    sequences = within_budget(model.encode(list(prompts), MAX_TOKENS_PER_PROMPT), token_budget)
    if not sequences:
        return scales
    fmt = scales.dtype
    per_layer = layer_scales(scales)
    ref = reference(model, sequences)
    scale1 = measure(model, ref, fp8_plan([(1.0, 1.0)] * len(per_layer), fmt))
    costs = layer_costs(model, ref, per_layer, fmt, progress)
    advice = advise_skip_layers(model, ref, per_layer, fmt, costs, threshold)
    names = sorted(scales.layers, key=lambda n: [int(p) for p in n.split(".") if p.isdigit()] or [-1])
    layers = {name: scales.layers[name].model_copy(update={
        "kl_alone": cost.mean_kl, "perplexity_ratio_alone": cost.perplexity_ratio})
        for name, cost in zip(names, costs, strict=True)}
    summary = AccuracySummary(
        sequences=len(sequences), tokens=ref.tokens, threshold=threshold,
        bf16_perplexity=ref.perplexity,
        scale1_perplexity_ratio=scale1.perplexity_ratio, scale1_mean_kl=scale1.mean_kl,
        calibrated_perplexity_ratio=advice.all_fp8.perplexity_ratio,
        calibrated_mean_kl=advice.all_fp8.mean_kl,
        skip_layers=list(advice.skip_layers),
        skip_perplexity_ratio=advice.advised.perplexity_ratio if advice.skip_layers else None,
        skip_mean_kl=advice.advised.mean_kl if advice.skip_layers else None,
        safe=advice.safe,
    )
    return scales.model_copy(update={"layers": {**scales.layers, **layers}, "accuracy": summary})


def summary_lines(summary: AccuracySummary) -> list[str]:
    """What calibrate prints about accuracy: the model-level result and the advice."""
    lines = [
        f"fp8 KV vs bf16 KV on {summary.tokens} calibration tokens (bf16 perplexity "
        f"{summary.bf16_perplexity:.3f}): scale 1.0 perplexity ratio {summary.scale1_perplexity_ratio:.4f} "
        f"(mean KL {summary.scale1_mean_kl:.5f}), calibrated {summary.calibrated_perplexity_ratio:.4f} "
        f"(mean KL {summary.calibrated_mean_kl:.5f})"]
    if summary.skip_layers:
        flag = "--kv-cache-dtype-skip-layers " + " ".join(map(str, summary.skip_layers))
        lines.append(f"advice: {flag} (calibrated with those layers in bf16: perplexity ratio "
                     f"{summary.skip_perplexity_ratio:.4f}, mean KL {summary.skip_mean_kl:.5f}; "
                     f"threshold {summary.threshold:g} on the ratio and exp(mean KL))")
    elif summary.safe:
        lines.append(f"advice: no layer needs bf16 KV (threshold {summary.threshold:g})")
    if not summary.safe:
        lines.append(f"not within the threshold {summary.threshold:g} with up to a quarter of the layers "
                     "in bf16: serve bf16 KV, or check on your own prompts with `kvops fp8 check`")
    return lines
