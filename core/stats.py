"""The small statistics every analysis and bench shares, on numpy: percentiles, means,
nearest-rank quantiles of a histogram, and percentile-bootstrap confidence intervals.

One copy, so a percentile means the same thing in a loadtest report, a bench verdict and a
capacity plan. The bootstrap resamples all rounds at once as an index matrix (one numpy call per
chunk instead of a Python loop per resample): a p99 bootstrap over 2,000 + 2,000 samples took
4.2 s in pure Python and takes about 0.2 s here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Rows = npt.NDArray[np.float64]
# A statistic over rows: (resamples, n) or (resamples, n, k) data -> one value per resample.
RowStatistic = Callable[[Rows], Rows]

_CHUNK_CELLS = 1 << 22  # resampled values held at once (32 MiB of float64)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100; numpy's default method), None for no data."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None for no data."""
    return float(np.mean(np.asarray(values, dtype=np.float64))) if len(values) else None


def nearest_rank(histogram: Sequence[tuple[int, int]], q: float) -> int:
    """The smallest value with at least ``ceil(q * total)`` of the counts at or below it
    (nearest-rank, q in 0..1) of a sorted ``(value, count)`` histogram; rank 1 at least."""
    values = np.asarray([v for v, _ in histogram])
    cumulative = np.cumsum([c for _, c in histogram])
    rank = max(1, math.ceil(q * int(cumulative[-1])))
    index = min(int(np.searchsorted(cumulative, rank, side="left")), len(values) - 1)
    return int(values[index])


def row_percentile(q: float) -> RowStatistic:
    """The ``q`` percentile of each row (linear, like ``percentile``)."""
    return lambda rows: np.asarray(np.percentile(rows, q, axis=1), dtype=np.float64)


def row_mean(rows: Rows) -> Rows:
    return np.asarray(np.mean(rows, axis=1), dtype=np.float64)


def row_median(rows: Rows) -> Rows:
    return np.asarray(np.median(rows, axis=1), dtype=np.float64)


def point(data: Sequence[Any], statistic: RowStatistic) -> float | None:
    """``statistic`` of the data itself (one row); None for no data."""
    if len(data) == 0:
        return None
    return float(statistic(np.asarray(data, dtype=np.float64)[np.newaxis])[0])


def resampled(data: Sequence[Any], statistic: RowStatistic, resamples: int,
              rng: np.random.Generator) -> Rows:
    """``statistic`` of ``resamples`` bootstrap resamples (with replacement) of ``data``'s rows."""
    array = np.asarray(data, dtype=np.float64)
    n = len(array)
    per_chunk = max(1, _CHUNK_CELLS // max(1, array.size))
    out = []
    for start in range(0, resamples, per_chunk):
        idx = rng.integers(0, n, size=(min(per_chunk, resamples - start), n))
        out.append(statistic(array[idx]))
    return np.concatenate(out) if out else np.empty(0)


def _interval(values: Rows, confidence: float) -> tuple[float, float] | None:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_ci(values: Sequence[Any], statistic: RowStatistic, *, confidence: float = 0.95,
                 resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic``; seeded, so it can be recomputed."""
    if len(values) == 0:
        raise ValueError("no values")
    interval = _interval(resampled(values, statistic, resamples, np.random.default_rng(seed)), confidence)
    if interval is None:
        raise ValueError("the statistic is not finite on any resample")
    return interval


def bootstrap_relative_change(
    baseline: Sequence[Any], candidate: Sequence[Any], statistic: RowStatistic,
    *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
) -> tuple[float, float, float] | None:
    """(point, low, high) of statistic(candidate)/statistic(baseline) − 1, percentile bootstrap.

    Each side is resampled independently with replacement; resamples whose baseline statistic is
    zero are dropped. None if either side is empty or the baseline statistic is zero.
    """
    base_point, cand_point = point(baseline, statistic), point(candidate, statistic)
    if not base_point or cand_point is None:
        return None
    rng = np.random.default_rng(seed)
    base = resampled(baseline, statistic, resamples, rng)
    cand = resampled(candidate, statistic, resamples, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        changes = np.where(base != 0, cand / base - 1.0, np.nan)
    interval = _interval(changes, confidence)
    if interval is None:
        return None
    return cand_point / base_point - 1.0, interval[0], interval[1]
