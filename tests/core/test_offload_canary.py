"""The load-path canary's verdict (kvops.core.offload.canary): which evidence makes it pass, and
the first failure named in the order a load happens."""

from __future__ import annotations

import random

import pytest

from kvops.core.offload.canary import (
    CORRUPT,
    FAILED,
    UNVERIFIED,
    VERIFIED,
    CanaryOutcome,
    canary_length,
    canary_tokens,
    judge,
    local_share,
)


def outcome(cached: int, reports: dict[str, int], same: bool = True, stats: bool = True
            ) -> CanaryOutcome:
    return CanaryOutcome(256, 128, 0, cached, same, reports, stats)


def test_vllm_serves_whole_blocks_below_the_last_token():
    assert local_share(256, 128) == 128
    assert local_share(257, 128) == 256
    assert local_share(256, 16) == 240
    assert canary_length(256, 128) == 256


def test_tokens_are_fresh_and_inside_the_vocabulary():
    a, b = canary_tokens(256, 1024), canary_tokens(256, 1024)
    assert a != b
    assert all(10 <= t < 1024 for t in a)
    assert canary_tokens(4, 1024, random.Random(1)) == canary_tokens(4, 1024, random.Random(1))


def test_loaded_and_verified_is_ok():
    result = judge(outcome(255, {VERIFIED: 1}), 1.0)
    assert (result.ok, result.loaded_tokens) == (True, 127)
    assert "checksums match" in result.reason


@pytest.mark.parametrize(("cached", "reports", "same", "words"), [
    (128, {}, True, "loads do not happen"),
    (0, {}, True, "loads do not happen"),
    (255, {FAILED: 1}, True, "failed to load"),
    (255, {CORRUPT: 1, VERIFIED: 1}, True, "do not match the checksums"),
    (255, {VERIFIED: 1}, False, "output after loading differs"),
    (255, {}, True, "reported no finished load"),
])
def test_each_broken_load_path_fails_with_its_reason(cached, reports, same, words):
    result = judge(outcome(cached, reports, same), 1.0)
    assert result.ok is False
    assert words in result.reason


def test_without_checksums_or_stats_a_load_still_passes_and_says_so():
    assert "no checksums" in judge(outcome(255, {UNVERIFIED: 1}), 1.0).reason
    unreported = judge(outcome(255, {}, stats=False), 1.0)
    assert unreported.ok
    assert "stats are off" in unreported.reason
