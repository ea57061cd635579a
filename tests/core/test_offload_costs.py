"""The hit ratio recomputed from the figures that carry between machines (issue 43).

Oracle: the built-in figures are one measured run's (README, the AVX-512 box's steady state), and
recomputed for the model that run measured (the reference shape: 32 KiB of KV and 205,520,896
FLOPs per token, 2,048-token hits) they must give back that run's own measured hit ratios (L1
0.046, disk 0.056 of the cold TTFT through the offload server, 1.50 s against 1.60 s without
it), within what rounding the figures to three digits and the 6% between the two servers' cold
TTFTs leave.
"""

from __future__ import annotations

import pytest

from kvops.core.offload.costs import MEASURED, scaled_costs

REFERENCE_KV_BYTES = 2 * 8 * 8 * 128 * 2
REFERENCE_FLOPS = 205_520_896.0


def test_the_built_in_figures_give_back_the_ratios_their_run_measured():
    costs = scaled_costs(MEASURED["lmcache_driven"], REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048)
    assert costs.l1_ttft_ratio == pytest.approx(0.046, rel=0.10)
    assert costs.disk_ttft_ratio == pytest.approx(0.056, rel=0.10)
    assert costs.miss_overhead_ratio == MEASURED["lmcache_driven"].miss_overhead_ratio


def test_costs_without_figures_are_left_as_measured():
    engine = MEASURED["engine_driven"]
    assert scaled_costs(engine, REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048) is engine
