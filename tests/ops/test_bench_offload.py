"""The offload bench's miss overhead: per-block ratios of ABBA rounds and their spread."""

from __future__ import annotations

import pytest

from kvops.ops.bench.offload import miss_block_ratios, spread


def test_a_drift_linear_within_a_block_cancels():
    # Rounds run baseline, offload, offload, baseline; the machine slows by 10% per round and
    # the connector costs exactly 5%. Comparing the sides' first rounds alone would say +15.5%.
    slow = [1.0 + 0.1 * i for i in range(8)]
    ttfts = {"baseline": [slow[0], slow[3], slow[4], slow[7]],
             "offload": [1.05 * slow[1], 1.05 * slow[2], 1.05 * slow[5], 1.05 * slow[6]]}
    assert miss_block_ratios(ttfts) == pytest.approx([0.05, 0.05])
    assert ttfts["offload"][0] / ttfts["baseline"][0] - 1 == pytest.approx(0.155)


def test_spread_orders_the_blocks():
    assert spread([0.3, -0.1, 0.1, 0.2]) == pytest.approx(
        {"min": -0.1, "q1": 0.05, "q3": 0.225, "max": 0.3})
