"""The steps after ``kvops calibrate`` records scales: the per-layer scale search
(kvops.ops.fp8.scale_search, on the recorded absmax), what each layer's fp8 KV costs, and which
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
from typing import TYPE_CHECKING, Any

from kvops.core.fp8.scales import (
    DEFAULT_SEARCH_STEPS,
    SEARCHED_TENSORS,
    AccuracySummary,
    LayerScales,
    ScaleMethod,
    ScalesFile,
)
from kvops.ops.fp8.check import layer_scales
from kvops.ops.fp8.offline import fp8_plan, load_offline_model
from kvops.ops.fp8.sensitivity import (
    DEFAULT_THRESHOLD,
    advise_skip_layers,
    layer_costs,
    measure,
    reference,
)

if TYPE_CHECKING:
    from kvops.ops.fp8.scale_search import LayerSearch

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


def _layer_names(scales: ScalesFile) -> list[str]:
    return sorted(scales.layers, key=lambda n: [int(p) for p in n.split(".") if p.isdigit()] or [-1])


def with_searched_scales(scales: ScalesFile, model_dir: Path, prompts: Sequence[str],
                         token_budget: int = DEFAULT_TOKEN_BUDGET, steps: int = DEFAULT_SEARCH_STEPS,
                         progress: Callable[[int], None] | None = None) -> ScalesFile:
    """scales with each layer's k_scale / v_scale from the output-error search (candidates from
    the absmax the server recorded), or 1.0 everywhere where the search did worse on these
    prompts; the file says which (scale_method)."""
    from kvops.ops.fp8.scale_search import choose_by_model_kl, search_scales

    model = load_offline_model(model_dir)
    sequences = within_budget(model.encode(list(prompts), MAX_TOKENS_PER_PROMPT), token_budget)
    if not sequences:
        return scales
    names = _layer_names(scales)
    recorded = [(scales.layers[n].k_absmax or 0.0, scales.layers[n].v_absmax or 0.0) for n in names]
    found = search_scales(model, sequences, scales.dtype, recorded, scales.margin, steps, progress)
    _, method = choose_by_model_kl(model, sequences, [(f.k.scale, f.v.scale) for f in found], scales.dtype)
    layers = {name: _searched_layer(scales.layers[name], search, method)
              for name, search in zip(names, found, strict=True)}
    return scales.model_copy(update={"layers": {**scales.layers, **layers}, "scale_method": method,
                                     "search_steps": steps})


def _searched_layer(layer: LayerScales, search: LayerSearch, method: ScaleMethod) -> LayerScales:
    """The layer's entry with the search's scales and figures for the tensors the method keeps
    searched, and 1.0 with 1.0's figures for the others."""
    update: dict[str, float | None] = {}
    for kind, found, searched in zip("kv", (search.k, search.v), SEARCHED_TENSORS[method], strict=True):
        update[f"{kind}_output_error_scale1"] = found.error_scale1
        if searched:
            update.update({f"{kind}_scale": found.scale, f"{kind}_output_error": found.error,
                           f"{kind}_error": found.value_error, f"{kind}_saturated": found.saturated,
                           f"{kind}_subnormal": found.subnormal})
        else:
            update.update({f"{kind}_scale": 1.0, f"{kind}_output_error": found.error_scale1,
                           f"{kind}_error": getattr(layer, f"{kind}_error_scale1"),
                           f"{kind}_saturated": getattr(layer, f"{kind}_saturated_scale1"),
                           f"{kind}_subnormal": getattr(layer, f"{kind}_subnormal_scale1")})
    return layer.model_copy(update=update)


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
    names = _layer_names(scales)
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


def method_lines(scales: ScalesFile) -> list[str]:
    """How the scales were chosen and, for the search, what it bought per layer (mean over layers
    of the relative change of the attention output, K and V in fp8 alone)."""
    if scales.scale_method == "absmax":
        return [f"scales: absmax × {scales.margin:g} / the format's max (no offline search)"]
    if scales.scale_method == "scale1-fallback":
        return ["scales: 1.0 in every layer (the searched scales did worse than 1.0 on the calibration prompts)"]
    which = {"output-search-k": " (K's; V at 1.0 did better on the calibration prompts)",
             "output-search-v": " (V's; K at 1.0 did better on the calibration prompts)"}.get(scales.scale_method, "")

    def mean(field: str) -> float:
        found = [getattr(s, field) for s in scales.layers.values() if getattr(s, field) is not None]
        return sum(found) / len(found) if found else 0.0

    return [f"scales: searched per layer{which} ({scales.search_steps} per octave) for the least change of its "
            f"attention output: K {mean('k_output_error'):.4f} (1.0: {mean('k_output_error_scale1'):.4f}), "
            f"V {mean('v_output_error'):.4f} (1.0: {mean('v_output_error_scale1'):.4f}), mean over layers"]


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
