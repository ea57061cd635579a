"""What fp8 KV costs a model, in the figures operators ask for: perplexity ratio to bf16 KV,
next-token KL divergence, top-1 agreement, and which layers to keep in bf16.

Every figure compares a KV plan (kvops.ops.fp8.offline) with the bf16-KV reference on the same
token sequences (teacher forcing: every position compares like with like). The per-layer
sweep quantizes ONE layer at a time with its calibrated scales and measures the KL that layer
alone adds; the skip-layer advice spares the most costly layers, one at a time, until the
perplexity ratio of the whole model is within the threshold (each step one more forward, since
the layers' costs do not simply add up).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvops.ops.fp8.offline import KvPlan, LayerQuant, OfflineModel, fp8_plan, unquantized

DEFAULT_THRESHOLD = 1.005
"""Perplexity ratio to bf16 KV that counts as safe (issue 41's goal for calibrated fp8)."""
DEFAULT_MAX_SKIP_FRACTION = 0.25
"""At most this share of the layers is advised to stay bf16: beyond it fp8 saves too little KV
(a quarter of the layers in bf16 keeps 62.5% of fp8's saving) to be worth the risk."""


@dataclass(frozen=True)
class Reference:
    """The bf16-KV run every plan is compared with."""

    sequences: tuple[Any, ...]
    log_probs: tuple[Any, ...]
    nll: float  # mean negative log-likelihood of the actual next tokens

    @property
    def tokens(self) -> int:
        return sum(len(s) - 1 for s in self.sequences)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@dataclass(frozen=True)
class Figures:
    """One plan against the reference."""

    perplexity: float
    perplexity_ratio: float
    mean_kl: float
    top1_agreement: float
    median_first_divergence: float | None
    """Teacher-forced: the median over sequences of the first position whose top-1 token
    differs from bf16's (None where no sequence diverges)."""
    greedy_equal: int | None = None
    greedy_total: int | None = None
    greedy_median_first_divergence: float | None = None

    @property
    def kl_ratio(self) -> float:
        """exp(mean KL): the perplexity ratio measured against bf16's own predictions instead
        of the text. Unlike the text's perplexity ratio, chance cannot push it below 1 (on a
        random-weight model fp8 at scale 1.0 measured a text ratio of 0.996 at KL 0.34)."""
        return math.exp(self.mean_kl)

    @property
    def worst_ratio(self) -> float:
        """What the threshold is held against: both ratios must be within it."""
        return max(self.perplexity_ratio, self.kl_ratio)

    def as_json(self) -> dict[str, Any]:
        data = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        return {**data, "kl_ratio": round(self.kl_ratio, 6)}


def reference(model: OfflineModel, sequences: Sequence[Any]) -> Reference:
    model.set_plan(unquantized(model.num_layers))
    log_probs = tuple(model.log_probs(ids) for ids in sequences)
    return Reference(tuple(sequences), log_probs, _nll(sequences, log_probs))


def _nll(sequences: Sequence[Any], log_probs: Sequence[Any]) -> float:
    total, count = 0.0, 0
    for ids, lp in zip(sequences, log_probs, strict=True):
        total -= float(lp[:-1].gather(1, ids[1:, None]).sum())
        count += len(ids) - 1
    return total / count


def measure(model: OfflineModel, ref: Reference, plan: KvPlan) -> Figures:
    """The plan's perplexity, KL and agreement against the reference."""
    model.set_plan(plan)
    kl_sum, agree, positions = 0.0, 0, 0
    log_probs, divergences = [], []
    for ids, ref_lp in zip(ref.sequences, ref.log_probs, strict=True):
        lp = model.log_probs(ids)
        log_probs.append(lp)
        rows = ref_lp[:-1], lp[:-1]
        kl_sum += float((rows[0].exp() * (rows[0] - rows[1])).sum())
        same = rows[0].argmax(-1) == rows[1].argmax(-1)
        agree += int(same.sum())
        positions += len(same)
        differ = (~same).nonzero()
        if len(differ):
            divergences.append(float(differ[0, 0]))
    nll = _nll(ref.sequences, log_probs)
    return Figures(
        perplexity=math.exp(nll), perplexity_ratio=math.exp(nll - ref.nll),
        mean_kl=kl_sum / positions, top1_agreement=agree / positions,
        median_first_divergence=statistics.median(divergences) if divergences else None,
    )


def with_greedy(model: OfflineModel, ref: Reference, plan: KvPlan, figures: Figures,
                new_tokens: int, ref_greedy: Sequence[list[int]]) -> Figures:
    """figures plus how many greedy continuations equal bf16's and where they part."""
    model.set_plan(plan)
    equal, firsts = 0, []
    for ids, want in zip(ref.sequences, ref_greedy, strict=True):
        got = model.greedy(ids, new_tokens)
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        equal += first is None
        firsts.append(float(new_tokens if first is None else first))
    return Figures(**{**figures.__dict__, "greedy_equal": equal, "greedy_total": len(firsts),
                      "greedy_median_first_divergence": statistics.median(firsts)})


def reference_greedy(model: OfflineModel, ref: Reference, new_tokens: int) -> list[list[int]]:
    model.set_plan(unquantized(model.num_layers))
    return [model.greedy(ids, new_tokens) for ids in ref.sequences]


@dataclass(frozen=True)
class LayerCost:
    """What one layer's fp8 KV costs when it is the only layer quantized."""

    index: int
    mean_kl: float
    perplexity_ratio: float


def layer_costs(model: OfflineModel, ref: Reference, scales: Sequence[tuple[float, float]], fmt: str,
                progress: Callable[[int], None] | None = None) -> list[LayerCost]:
    """One forward per layer, that layer alone in fp8 with its calibrated scales."""
    costs = []
    for index, (k, v) in enumerate(scales):
        plan = tuple(LayerQuant(fmt, k, v) if i == index else LayerQuant() for i in range(len(scales)))
        figures = measure(model, ref, plan)
        costs.append(LayerCost(index, figures.mean_kl, figures.perplexity_ratio))
        if progress:
            progress(1)
    return costs


@dataclass(frozen=True)
class SkipAdvice:
    """Which layers to keep in bf16 and what the model measures then."""

    skip_layers: tuple[int, ...]
    threshold: float
    all_fp8: Figures
    advised: Figures
    tried: tuple[tuple[int, float], ...] = field(default=())
    """(layers spared, worst ratio) for each step of the search."""

    @property
    def safe(self) -> bool:
        return self.advised.worst_ratio <= self.threshold


def skip_limit(layers: int) -> int:
    """The most layers the advice keeps in bf16: a quarter of the model's (at least one)."""
    return max(1, int(layers * DEFAULT_MAX_SKIP_FRACTION))


def advise_skip_layers(model: OfflineModel, ref: Reference, scales: Sequence[tuple[float, float]], fmt: str,
                       costs: Sequence[LayerCost], threshold: float = DEFAULT_THRESHOLD,
                       max_skip: int | None = None) -> SkipAdvice:
    """Spare the costliest layers (by KL alone) one by one until the plan's worst ratio
    (Figures.worst_ratio) is within the threshold or max_skip layers are spared; the advice is
    the first plan within the threshold, else the best one tried."""
    limit = max_skip if max_skip is not None else skip_limit(len(scales))
    order = [c.index for c in sorted(costs, key=lambda c: -c.mean_kl)]
    all_fp8 = measure(model, ref, fp8_plan(scales, fmt))
    best: tuple[tuple[int, ...], Figures] = ((), all_fp8)
    tried: list[tuple[int, float]] = [(0, all_fp8.worst_ratio)]
    skip: list[int] = []
    while best[1].worst_ratio > threshold and len(skip) < min(limit, len(order)):
        skip.append(order[len(skip)])
        figures = measure(model, ref, fp8_plan(scales, fmt, skip))
        tried.append((len(skip), figures.worst_ratio))
        if figures.worst_ratio < best[1].worst_ratio:
            best = (tuple(sorted(skip)), figures)
    return SkipAdvice(best[0], threshold, all_fp8, best[1], tuple(tried))


def skip_flag(layers: Sequence[int]) -> str:
    """The vLLM flag that keeps these layers' KV unquantized (vllm/config/cache.py
    ``kv_cache_dtype_skip_layers``, a list[str] that vLLM's parser takes space-separated: "3,7"
    would be one entry that matches no layer, model_executor/layers/attention/attention.py)."""
    return "--kv-cache-dtype-skip-layers " + " ".join(str(i) for i in sorted(layers))
