"""Paired ABBA rounds and the bootstrap interval the admission bench reports."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvops.ops.bench.paired import abba_order, block_ratios, median_ci, verdict_at_least


def test_abba_order():
    assert abba_order(2) == ["a", "b", "b", "a", "a", "b", "b", "a"]


def _measure(order, speed_at, cost):
    """Throughput of each round on a machine whose speed is speed_at(round index)."""
    a, b = [], []
    for i, side in enumerate(order):
        (a if side == "a" else b).append(speed_at(i) * (cost if side == "b" else 1.0))
    return a, b


def test_linear_drift_within_a_block_cancels():
    # The machine slows down by 5% per round; b costs exactly 3%.
    a, b = _measure(abba_order(3), lambda i: 100.0 - 5.0 * i, 0.97)
    assert block_ratios(a, b) == pytest.approx([0.97] * 3)
    # Plain alternation (a b a b) under the same drift is biased: b always runs later.
    alternating = [100.0 - 5.0 * i for i in range(6)]
    naive = sum(alternating[1::2]) * 0.97 / sum(alternating[0::2])
    assert naive < 0.95


@given(
    speeds=st.lists(st.floats(1.0, 1000.0), min_size=8, max_size=8),
    cost=st.floats(0.5, 1.5),
)
def test_a_constant_cost_is_recovered_whatever_the_speed_per_block(speeds, cost):
    # Speed changes arbitrarily between blocks, but is constant within each block.
    a, b = _measure(abba_order(2), lambda i: speeds[i // 4], cost)
    assert block_ratios(a, b) == pytest.approx([cost, cost])


def test_unequal_rounds_are_refused():
    with pytest.raises(ValueError, match="two rounds per side per block"):
        block_ratios([1.0, 2.0], [1.0])


def test_interval_of_identical_values_is_that_value():
    assert median_ci([0.99] * 7) == (0.99, 0.99)


def test_interval_covers_the_true_median_about_as_often_as_it_claims():
    # Oracle: the generating distribution's median (1.0) is known; noise as wide as the shared
    # machine's (+-10%). A 95% interval from 12 blocks should cover it in most trials.
    rng = random.Random(1)
    covered = 0
    trials = 200
    for trial in range(trials):
        values = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(12)]
        low, high = median_ci(values, resamples=1000, seed=trial)
        covered += low <= 1.0 <= high
    assert covered / trials >= 0.88


def test_interval_is_reproducible_from_its_seed():
    values = [0.97, 1.01, 0.99, 1.03, 0.95, 1.0]
    assert median_ci(values, seed=3) == median_ci(values, seed=3)


@pytest.mark.parametrize(
    ("ci", "expected"),
    [((0.985, 1.02), "meets"), ((0.95, 0.979), "fails"), ((0.97, 1.01), "inconclusive"),
     ((0.98, 0.99), "meets")],
)
def test_verdict_against_the_threshold(ci, expected):
    assert verdict_at_least(ci, 0.98) == expected


def test_bench_result_keeps_the_contract_keys_and_makes_no_claim_from_noise():
    from kvops.ops.bench.admission_normal import normal_load_result

    engine = {"steps": 100.0, "step_s": 0.02, "tokens_per_step": 3.0, "engine_tokens_per_s": 150.0}
    rng = random.Random(0)
    noisy = {"stock": [rng.uniform(80, 600) for _ in range(16)], "kvops": [rng.uniform(80, 600) for _ in range(16)]}
    result = normal_load_result(
        {"tokens_per_s": noisy, "engine": {"stock": engine, "kvops": engine}},
        {"throughput_ratio_bound": 0.9996},
    )
    assert result["normal_load_throughput_verdict"] == "inconclusive"
    low, high = result["normal_load_throughput_ratio_ci95"]
    assert low < 0.98 < high
    assert low <= result["normal_load_throughput_ratio"] <= high
    assert len(result["normal_load_block_ratios"]) == 8
    assert result["normal_load_cost_verdict_direct"] == "meets"
    assert result["normal_load_engine_throughput_ratio"] == 1.0

    none = normal_load_result(
        {"tokens_per_s": {"stock": [0.0, 0.0], "kvops": [1.0, 1.0]}, "engine": {"stock": engine, "kvops": engine}},
        {},
    )
    assert none["normal_load_throughput_ratio"] is None
    assert none["normal_load_throughput_verdict"] == "inconclusive"
    assert none["normal_load_cost_verdict_direct"] is None
