"""Paired A/B rounds for throughput on a machine whose speed drifts (shared, 2 cores).

Rounds run in ABBA blocks against two servers that stay alive side by side. Each block gives
one ratio, (B1 + B2) / (A1 + A2): a drift that is linear over the block's four rounds hits both
sides equally and cancels. The estimate is the median of the block ratios; its confidence
interval comes from a percentile bootstrap over blocks (seeded, so a result can be recomputed
from the ratios printed with it). A claim such as "costs at most 2%" is made only when the whole
interval clears the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvops.core.stats import bootstrap_ci, row_median

Side = Literal["a", "b"]
Verdict = Literal["meets", "fails", "inconclusive"]


def abba_order(blocks: int) -> list[Side]:
    """The order of the rounds: a b b a, repeated ``blocks`` times."""
    return ["a", "b", "b", "a"] * blocks


def block_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """One b/a ratio per ABBA block, from the per-side values in the order they were measured
    (``a[2k]``, ``a[2k+1]`` and ``b[2k]``, ``b[2k+1]`` belong to block k)."""
    if len(a) != len(b) or len(a) % 2:
        raise ValueError(f"need two rounds per side per block, got {len(a)} and {len(b)}")
    return [
        (b[i] + b[i + 1]) / (a[i] + a[i + 1])
        for i in range(0, len(a), 2)
        if a[i] + a[i + 1] > 0
    ]


def median_ci(
    values: Sequence[float], confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median (``kvops.core.stats``)."""
    return bootstrap_ci(values, row_median, confidence=confidence, resamples=resamples, seed=seed)


def verdict_at_least(ci: tuple[float, float], threshold: float) -> Verdict:
    """Whether the interval lies wholly at or above ``threshold``, wholly below it, or straddles it."""
    low, high = ci
    if low >= threshold:
        return "meets"
    if high < threshold:
        return "fails"
    return "inconclusive"
