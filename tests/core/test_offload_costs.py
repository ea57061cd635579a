"""The hit ratio recomputed from the figures that carry between machines (issue 43).

Oracle: each mode's built-in figures are one measured run's (README: the AVX-512 box's zero-copy
steady state; run 2 of "kvops' copy in the worker" for engine_driven), and recomputed for the
model that run measured (the reference shape: 32 KiB of KV and 205,520,896 FLOPs per token,
2,048-token hits) they must give back that run's own measured hit ratios (zero-copy: L1 0.046,
disk 0.056 of the cold TTFT through the offload server, 1.50 s against 1.60 s without it;
engine_driven: L1 0.021, disk 0.024), within what rounding the figures to three digits and the
few percent between the two servers' cold TTFTs leave.
"""

from __future__ import annotations

import pytest

from kvops.core.offload.costs import MEASURED, scaled_costs

REFERENCE_KV_BYTES = 2 * 8 * 8 * 128 * 2
REFERENCE_FLOPS = 205_520_896.0


@pytest.mark.parametrize(("mode", "l1", "disk"), [
    ("lmcache_driven", 0.046, 0.056),  # README: the zero-copy run
    ("engine_driven", 0.021, 0.024),  # README "kvops' copy in the worker", run 2
])
def test_the_built_in_figures_give_back_the_ratios_their_run_measured(mode, l1, disk):
    costs = scaled_costs(MEASURED[mode], REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048)
    assert costs.l1_ttft_ratio == pytest.approx(l1, rel=0.10)
    assert costs.disk_ttft_ratio == pytest.approx(disk, rel=0.10)
    assert costs.miss_overhead_ratio == MEASURED[mode].miss_overhead_ratio


def test_costs_without_figures_are_left_as_measured():
    engine = MEASURED["engine_driven"].model_copy(update={"figures": None})
    assert scaled_costs(engine, REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048) is engine
