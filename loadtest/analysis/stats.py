"""Small statistics shared by the analyses: percentiles and bootstrap confidence intervals."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def bootstrap_relative_change(
    baseline: Sequence[float], candidate: Sequence[float], statistic: Callable[[Sequence[float]], float | None],
    *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
) -> tuple[float, float, float] | None:
    """(point, low, high) of statistic(candidate)/statistic(baseline) − 1, percentile bootstrap.

    Each side is resampled independently with replacement; None if either side is empty.
    """
    base_point, cand_point = statistic(baseline), statistic(candidate)
    if not baseline or not candidate or not base_point or cand_point is None:
        return None
    rng = random.Random(seed)
    changes = []
    for _ in range(resamples):
        b = statistic([baseline[rng.randrange(len(baseline))] for _ in baseline])
        c = statistic([candidate[rng.randrange(len(candidate))] for _ in candidate])
        if b and c is not None:
            changes.append(c / b - 1.0)
    tail = (1.0 - confidence) / 2 * 100
    low, high = percentile(changes, tail), percentile(changes, 100 - tail)
    if low is None or high is None:
        return None
    return cand_point / base_point - 1.0, low, high
