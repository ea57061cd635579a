"""Per-layer fp8 KV scales chosen by what they do to each layer's attention output.

Why not absmax × margin / max alone: an e4m3 value's relative error is the same anywhere in
fp8's normal range, so a scale changes the error only through saturation, the subnormals, and
WHICH rounding lattice the values land on (a scale that is not a power of two shifts it). On
SmolLM2 (K absmax 10-23, V 0.6-17) the absmax scale changed little but the lattice, and its
perplexity ratio to bf16 KV was worse than scale 1.0's. Post-rotary keys have low-frequency
channels that hold nearly constant large values; a lattice that represents them well cuts the
logit error on every text.

The search records each layer's query, key and value on the calibration sequences once (one
bf16-KV forward each) and, per layer and per K/V, scores every candidate of
kvops.core.fp8.scales.candidate_scales (one octave of lattices from the absmax scale, and 1.0)
by the squared change of the layer's attention output after o_proj (what the layer adds to the
residual stream) with that tensor in fp8, the other exact: no full-model forward per candidate.
vLLM takes one k_scale and one v_scale per layer (per tensor), and so does the search.
``choose_by_model_kl`` then measures the whole model's KL to bf16 KV on the calibration
sequences with the searched K and V scales, either alone (1.0 for the other) and 1.0 everywhere,
and keeps the best: never worse than 1.0 on the calibration text by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, cast

from kvops.core.fp8.scales import (
    DEFAULT_MARGIN,
    DEFAULT_SEARCH_STEPS,
    SEARCHED_TENSORS,
    ScaleMethod,
    candidate_scales,
)
from kvops.ops.fp8.offline import AttentionInputs, OfflineModel, fp8_plan, fp8_round_trip
from kvops.ops.fp8.sensitivity import measure, reference


@dataclass(frozen=True)
class TensorSearch:
    """One layer's K (or V): the scale chosen, the relative output error it and 1.0 give, and
    the recorded values' own relative RMS error and the shares that saturate / fall below fp8's
    smallest normal at it (kvops.ops.fp8.calibrate's figures, on the search's recording)."""

    scale: float
    error: float
    error_scale1: float
    absmax: float = 0.0
    """The largest |value| the candidates were drawn for (recorded or seen, whichever is larger)."""
    value_error: float | None = None
    saturated: float | None = None
    subnormal: float | None = None


@dataclass(frozen=True)
class LayerSearch:
    k: TensorSearch
    v: TensorSearch


@dataclass(frozen=True)
class LayerInputs:
    """What one attention layer saw on the calibration sequences, and what scores its output."""

    calls: tuple[AttentionInputs, ...]
    module: Any  # the attention module: its o_proj and the arguments sdpa needs

    @cached_property
    def bf16_outputs(self) -> tuple[Any, ...]:
        """The output of every call with K/V as bf16 KV stores them (computed once per layer)."""
        import torch

        with torch.inference_mode():
            return tuple(_output(self, call, call.key, call.value) for call in self.calls)

    def absmax(self) -> tuple[float, float]:
        return (max(float(c.key.abs().max()) for c in self.calls),
                max(float(c.value.abs().max()) for c in self.calls))


def _output(inputs: LayerInputs, call: AttentionInputs, key: Any, value: Any) -> Any:
    """The layer's attention output after o_proj, as transformers' sdpa attention computes it
    (the same mask and arguments the forward passed)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(inputs.module, call.query, key, value, call.mask, **call.kwargs)
    return inputs.module.o_proj(out.reshape(*out.shape[:2], -1))


def output_error(inputs: LayerInputs, fmt: str, k_scale: float | None = None,
                 v_scale: float | None = None) -> float:
    """Relative RMS change of the layer's output with K (and/or V) stored in fp8 at these scales
    (None: that tensor exact), over every recorded call."""
    import torch

    diff, norm = 0.0, 0.0
    with torch.inference_mode():
        for call, want in zip(inputs.calls, inputs.bf16_outputs, strict=True):
            key = call.key if k_scale is None else fp8_round_trip(call.key, k_scale, fmt)
            value = call.value if v_scale is None else fp8_round_trip(call.value, v_scale, fmt)
            diff += float((_output(inputs, call, key, value) - want).pow(2).sum())
            norm += float(want.pow(2).sum())
    return math.sqrt(diff / norm) if norm > 0 else 0.0


def best_scale(candidates: Sequence[float], error_of: Callable[[float], float]) -> TensorSearch:
    """The candidate with the least error (ties: 1.0, then the smaller scale)."""
    errors = {c: error_of(c) for c in candidates}
    scale1 = errors[1.0] if 1.0 in errors else error_of(1.0)
    chosen = min(errors, key=lambda c: (errors[c], c != 1.0, c))
    return TensorSearch(chosen, errors[chosen], scale1)


def search_layer(inputs: LayerInputs, fmt: str, absmax: tuple[float, float] | None = None,
                 margin: float = DEFAULT_MARGIN, steps: int = DEFAULT_SEARCH_STEPS) -> LayerSearch:
    """K's scale with V exact, V's with K exact, each from candidate_scales of its absmax (the
    recorded one when given, at least what the calibration sequences reached)."""
    import torch

    seen = inputs.absmax()
    k_max, v_max = (max(a, b) for a, b in zip(seen, absmax or seen, strict=True))
    k = best_scale(candidate_scales(k_max, fmt, margin, steps), lambda s: output_error(inputs, fmt, k_scale=s))
    v = best_scale(candidate_scales(v_max, fmt, margin, steps), lambda s: output_error(inputs, fmt, v_scale=s))
    keys = torch.cat([c.key.reshape(-1) for c in inputs.calls])
    values = torch.cat([c.value.reshape(-1) for c in inputs.calls])
    return LayerSearch(_with_shares(k, k_max, keys, fmt), _with_shares(v, v_max, values, fmt))


def _with_shares(found: TensorSearch, absmax: float, values: Any, fmt: str) -> TensorSearch:
    from kvops.ops.fp8.calibrate import quantization_error, range_shares

    saturated, subnormal = range_shares(values, found.scale, fmt)
    return replace(found, absmax=absmax, value_error=quantization_error(values, found.scale, fmt),
                   saturated=saturated, subnormal=subnormal)


def record_layers(model: OfflineModel, sequences: Sequence[Any]) -> list[LayerInputs]:
    modules = sorted(model.attention_modules(), key=lambda m: int(m.layer_idx))
    return [LayerInputs(tuple(calls), module)
            for calls, module in zip(model.attention_inputs(sequences), modules, strict=True)]


def search_scales(model: OfflineModel, sequences: Sequence[Any], fmt: str,
                  absmax: Sequence[tuple[float, float]] | None = None, margin: float = DEFAULT_MARGIN,
                  steps: int = DEFAULT_SEARCH_STEPS,
                  progress: Callable[[int], None] | None = None) -> list[LayerSearch]:
    """search_layer for every layer, on one recording of the sequences."""
    found = []
    for index, inputs in enumerate(record_layers(model, sequences)):
        found.append(search_layer(inputs, fmt, absmax[index] if absmax else None, margin, steps))
        if progress:
            progress(1)
    return found


def choose_by_model_kl(model: OfflineModel, sequences: Sequence[Any], scales: list[tuple[float, float]],
                       fmt: str) -> tuple[list[tuple[float, float]], ScaleMethod]:
    """The searched scales for K and V, for K only, for V only (1.0 for the other), or 1.0
    everywhere: whichever gives the least mean KL to bf16 KV on the calibration sequences (ties:
    1.0). The layers' errors do not simply add up: on SmolLM2's calibration text the searched K
    alone measured KL 0.0101, V alone 0.0117, both 0.0136 and 1.0 everywhere 0.0135."""
    ref = reference(model, sequences)
    options = {method: [(k if use_k else 1.0, v if use_v else 1.0) for k, v in scales]
               for method, (use_k, use_v) in SEARCHED_TENSORS.items()}
    kl = {method: measure(model, ref, fp8_plan(plan, fmt)).mean_kl for method, plan in options.items()}
    best = min(kl, key=lambda m: (kl[m], m != "scale1-fallback"))
    return options[best], cast(ScaleMethod, best)
