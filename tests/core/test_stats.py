"""kvops.core.stats against values worked out by hand on small cases (no numpy in the oracle)."""

from __future__ import annotations

import random

import pytest

from kvops.core.stats import (
    bootstrap_ci,
    bootstrap_relative_change,
    mean,
    nearest_rank,
    percentile,
    point,
    row_mean,
    row_median,
    row_percentile,
)


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([3.0, 1.0, 2.0, 4.0], 0, 1.0),
    ([3.0, 1.0, 2.0, 4.0], 100, 4.0),
    ([3.0, 1.0, 2.0, 4.0], 50, 2.5),       # between the 2nd and 3rd of four
    ([10.0, 20.0, 30.0, 40.0, 50.0], 90, 46.0),  # position 3.6: 40 + 0.6 * 10
    ([7.0], 99, 7.0),
])
def test_percentile_interpolates_linearly_between_ranks(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_no_data_has_no_percentile_or_mean():
    assert percentile([], 50) is None
    assert mean([]) is None
    assert point([], row_mean) is None


def test_mean_and_row_statistics_of_one_row():
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert point([1.0, 2.0, 6.0], row_mean) == 3.0
    assert point([1.0, 2.0, 6.0], row_median) == 2.0
    assert point([10.0, 20.0, 30.0, 40.0, 50.0], row_percentile(90)) == pytest.approx(46.0)


@pytest.mark.parametrize(("q", "expected"), [(0.0, 1), (0.25, 1), (0.26, 2), (0.5, 2), (0.9, 5), (1.0, 5)])
def test_nearest_rank_of_a_histogram(q, expected):
    # 1 x1, 2 x2, 5 x1: ranks 1 | 2 3 | 4; rank = max(1, ceil(q * 4))
    assert nearest_rank([(1, 1), (2, 2), (5, 1)], q) == expected


def test_interval_of_identical_values_is_that_value():
    assert bootstrap_ci([0.99] * 7, row_median) == (0.99, 0.99)


def test_interval_is_reproducible_from_its_seed_and_moves_with_it():
    values = [0.97, 1.01, 0.99, 1.03, 0.95, 1.0, 0.9, 1.1]
    assert bootstrap_ci(values, row_mean, seed=3) == bootstrap_ci(values, row_mean, seed=3)
    assert bootstrap_ci(values, row_mean, seed=3) != bootstrap_ci(values, row_mean, seed=4)


def test_interval_of_the_mean_lies_within_the_data_and_brackets_it():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    low, high = bootstrap_ci(values, row_mean, resamples=2000)
    assert 1.0 <= low < 3.5 < high <= 6.0


def test_no_values_have_no_interval():
    with pytest.raises(ValueError, match="no values"):
        bootstrap_ci([], row_mean)


def test_relative_change_of_a_doubled_sample():
    rng = random.Random(2)
    base = [rng.uniform(1.0, 2.0) for _ in range(300)]
    change, low, high = bootstrap_relative_change(base, [2 * x for x in base], row_percentile(50))
    assert change == pytest.approx(1.0)
    assert low < 1.0 < high


def test_relative_change_needs_both_sides_and_a_nonzero_baseline():
    assert bootstrap_relative_change([], [1.0], row_mean) is None
    assert bootstrap_relative_change([1.0], [], row_mean) is None
    assert bootstrap_relative_change([0.0, 0.0], [1.0], row_mean) is None


def test_rows_of_pairs_resample_whole_pairs():
    # (sum, count) pairs: a pooled mean resampled pair by pair stays within the pairs' own means
    pairs = [(2.0, 1.0), (9.0, 3.0), (4.0, 1.0)]

    def pooled(rows):
        return rows[..., 0].sum(axis=1) / rows[..., 1].sum(axis=1)

    assert point(pairs, pooled) == pytest.approx(15.0 / 5.0)
    low, high = bootstrap_ci(pairs, pooled, resamples=500)
    assert 2.0 <= low <= high <= 4.0
