"""The open-loop schedule is a Poisson process at the asked rate, whatever the server does."""

from __future__ import annotations

import pytest

from kvops.loadtest.config import KvExhaustionConfig, apply_overrides, doubling_steps
from kvops.loadtest.shapes.poisson import ArrivalSchedule


def test_arrivals_have_the_asked_rate_and_exponential_gaps():
    schedule = ArrivalSchedule(rate_rps=4.0, seed=3, start=0.0)
    times = [schedule.claim() for _ in range(20000)]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std == pytest.approx(mean, rel=0.05)


def test_users_override_doubles_up_to_the_last_step():
    assert doubling_steps(8) == [1, 2, 4, 8]
    assert doubling_steps(6) == [1, 2, 4, 6]
    cfg = apply_overrides(KvExhaustionConfig(), users=6, duration_s=40)
    assert isinstance(cfg, KvExhaustionConfig)
    assert cfg.steps == [1, 2, 4, 6]
    assert cfg.step_s == 10
