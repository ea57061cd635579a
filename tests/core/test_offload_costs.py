"""The hit ratio recomputed from the figures that carry between machines (issue 43).

Oracle: each mode's built-in figures are one measured run's (README "The floor under a hit": the
third of three runs on the AVX-512 box, both modes side by side), and recomputed for the model that
run measured (the reference shape: 32 KiB of KV and 205,520,896 FLOPs per token, 2,048-token hits)
they must give back that run's own measured hit ratios (engine_driven: L1 0.036, disk 0.046;
zero-copy: L1 0.058, disk 0.050, of the cold TTFT through each offload server, 1.77 and 1.61 s,
against 1.77 s without a connector), within what rounding the figures to three digits and the few
percent between two servers' cold TTFTs leave.
"""

from __future__ import annotations

import pytest

from kvops.core.offload.costs import MEASURED, scaled_costs

REFERENCE_KV_BYTES = 2 * 8 * 8 * 128 * 2
REFERENCE_FLOPS = 205_520_896.0


@pytest.mark.parametrize(("mode", "l1", "disk"), [
    ("lmcache_driven", 0.058, 0.050),  # README "The floor under a hit", run 3, zero-copy
    ("engine_driven", 0.036, 0.046),  # the same run's default (auto: engine_driven)
])
def test_the_built_in_figures_give_back_the_ratios_their_run_measured(mode, l1, disk):
    costs = scaled_costs(MEASURED[mode], REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048)
    assert costs.l1_ttft_ratio == pytest.approx(l1, rel=0.10)
    assert costs.disk_ttft_ratio == pytest.approx(disk, rel=0.10)
    assert costs.miss_overhead_ratio == MEASURED[mode].miss_overhead_ratio


def test_costs_without_figures_are_left_as_measured():
    engine = MEASURED["engine_driven"].model_copy(update={"figures": None})
    assert scaled_costs(engine, REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048) is engine


def test_a_model_smaller_than_the_benchs_keeps_the_measured_step_and_an_unknown_one_says_so():
    """The one-token hit's front-end share does not shrink with the model: a step reading less
    than the bench model's keeps the measured fixed time (the ratio as without a floor)."""
    figures = MEASURED["engine_driven"].figures
    assert figures is not None
    floored = MEASURED["engine_driven"].model_copy(update={"figures": figures.model_copy(
        update={"floor_s": 0.03, "floor_bytes": 3.0e8})})
    plain = MEASURED["engine_driven"].model_copy(update={"figures": figures.model_copy(
        update={"floor_s": None, "floor_bytes": None})})
    small = scaled_costs(floored, REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048, weight_bytes=1.0e8)
    assert small.l1_ttft_ratio == pytest.approx(scaled_costs(plain, REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048).l1_ttft_ratio)
    assert "vLLM's own one-token hit 30 ms" in (small.derivation or "")
    unknown = scaled_costs(floored, REFERENCE_KV_BYTES, REFERENCE_FLOPS, 2048)
    assert "this model's weights are not known" in (unknown.derivation or "")
