"""The per-layer fp8 scale search (kvops.ops.fp8.scale_search) on tiny random models: its
candidates, its choice against a brute-force minimum, the guard against scale 1.0, and what
``kvops calibrate``'s offline step writes into the scales file. No server."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvops.core.fp8.scales import (
    FORMAT_MAX,
    SEARCHED_TENSORS,
    LayerScales,
    ScalesFile,
    candidate_scales,
    fingerprint_of_config,
    load_scales_file,
    read_model_config,
    scale_from_absmax,
)
from kvops.ops.fp8.calibrate_accuracy import with_searched_scales
from kvops.ops.fp8.kv_scaled_model import build_kv_scaled_model
from kvops.ops.fp8.offline import OfflineModel, fp8_plan, load_offline_model
from kvops.ops.fp8.scale_search import choose_by_model_kl, output_error, record_layers, search_layer
from kvops.ops.fp8.sensitivity import measure, reference
from kvops.ops.models.tiny import TinyModelSpec

LICENSE = Path("/usr/share/common-licenses/MPL-2.0")


def _passages(count: int) -> list[str]:
    paragraphs = [" ".join(p.split()) for p in LICENSE.read_text().split("\n\n")]
    return [p for p in paragraphs if len(p.split()) >= 30][:count]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> OfflineModel:
    """K/V ×30: scale 1.0 leaves most of e4m3's range unused but does not saturate."""
    root = tmp_path_factory.mktemp("search")
    return load_offline_model(build_kv_scaled_model(root / "model", 30.0, TinyModelSpec(layers=2)))


@pytest.mark.parametrize("absmax", [0.01, 3.7, 22.5, 5000.0])
def test_candidates_are_one_octave_from_the_absmax_scale_and_one(absmax: float) -> None:
    base = scale_from_absmax(absmax, "fp8_e4m3")
    found = candidate_scales(absmax, "fp8_e4m3", steps=16)
    assert 1.0 in found
    lattice = [c for c in found if c != 1.0]  # 1.0 is outside [base, 2 base) for these absmax
    assert len(lattice) == 16
    assert all(base * (1 - 1e-6) <= c < 2 * base for c in lattice)
    assert all(absmax / c <= FORMAT_MAX["fp8_e4m3"] for c in lattice)  # none saturates
    assert found == sorted(found)


def test_candidates_are_float32_values() -> None:
    import numpy as np

    assert all(float(np.float32(c)) == c for c in candidate_scales(17.3, "fp8_e4m3"))
    with pytest.raises(ValueError, match="steps"):
        candidate_scales(17.3, "fp8_e4m3", steps=0)


def test_the_search_picks_the_brute_force_minimum_never_worse_than_one(model: OfflineModel) -> None:
    sequences = model.encode(_passages(3), 48)
    for inputs in record_layers(model, sequences):
        k_max, v_max = inputs.absmax()
        found = search_layer(inputs, "fp8_e4m3", steps=4)
        k_errors = {c: output_error(inputs, "fp8_e4m3", k_scale=c) for c in candidate_scales(k_max, "fp8_e4m3", steps=4)}
        v_errors = {c: output_error(inputs, "fp8_e4m3", v_scale=c) for c in candidate_scales(v_max, "fp8_e4m3", steps=4)}
        assert found.k.error == min(k_errors.values()) == k_errors[found.k.scale]
        assert found.v.error == min(v_errors.values()) == v_errors[found.v.scale]
        assert found.k.error <= found.k.error_scale1 == k_errors[1.0]
        assert found.v.error <= found.v.error_scale1 == v_errors[1.0]
        assert 0 < found.k.error < 1
        assert found.k.saturated == 0.0


def test_the_output_error_is_zero_without_fp8_and_grows_when_k_saturates(model: OfflineModel) -> None:
    inputs = record_layers(model, model.encode(_passages(1), 32))[0]
    k_max, _ = inputs.absmax()
    assert output_error(inputs, "fp8_e4m3") == 0.0
    saturating = k_max / FORMAT_MAX["fp8_e4m3"] / 8  # the largest keys clipped to an eighth
    assert output_error(inputs, "fp8_e4m3", k_scale=saturating) > output_error(inputs, "fp8_e4m3", k_scale=1.0)


def test_the_model_level_choice_is_the_least_kl_never_worse_than_one(model: OfflineModel) -> None:
    """Brute force: the whole model's mean KL with each of the four plans (searched K and V, K
    only, V only, 1.0 everywhere); the choice is the least of them, so never worse than 1.0."""
    sequences = model.encode(_passages(2), 32)
    ref = reference(model, sequences)
    for scales in ([(1e-3, 1e-3)] * 2, [(0.5, 0.05)] * 2):  # all clipped; a plausible mix
        chosen, method = choose_by_model_kl(model, sequences, scales, "fp8_e4m3")
        use_k, use_v = SEARCHED_TENSORS[method]
        assert chosen == [(k if use_k else 1.0, v if use_v else 1.0) for k, v in scales]
        kl = {m: measure(model, ref, fp8_plan([(k if uk else 1.0, v if uv else 1.0) for k, v in scales],
                                             "fp8_e4m3")).mean_kl for m, (uk, uv) in SEARCHED_TENSORS.items()}
        assert kl[method] == min(kl.values()) <= kl["scale1-fallback"]
    clipped, method = choose_by_model_kl(model, sequences, [(1e-3, 1e-3)] * 2, "fp8_e4m3")
    assert (clipped, method) == ([(1.0, 1.0)] * 2, "scale1-fallback")


def test_calibrates_offline_step_writes_the_searched_scales(tmp_path: Path) -> None:
    """On a K/V ×1000 model scale 1.0 saturates: the search moves every scale off 1.0, says so
    in the file (scale_method), the file loads, and calibrated fp8 is closer to bf16 KV on the
    calibration prompts than scale 1.0 (mean KL)."""
    model_dir = build_kv_scaled_model(tmp_path / "model", 1000.0, TinyModelSpec(layers=2))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    recorded = ScalesFile(dtype="fp8_e4m3", model=fingerprint_of_config(read_model_config(model_dir)),
                          layers={n: LayerScales(k_scale=1.0, v_scale=1.0, k_absmax=0.0, v_absmax=0.0)
                                  for n in names})
    searched = with_searched_scales(recorded, model_dir, _passages(3), token_budget=96, steps=4)
    assert searched.scale_method == "output-search"
    assert searched.search_steps == 4
    for name in names:
        layer = searched.layers[name]
        assert layer.k_scale != 1.0
        assert layer.v_scale != 1.0
        assert layer.k_output_error is not None
        assert layer.k_output_error_scale1 is not None
        assert layer.k_output_error < layer.k_output_error_scale1
        assert layer.k_saturated == 0.0
    path = tmp_path / "scales.json"
    path.write_text(searched.model_dump_json())
    assert load_scales_file(path) == searched
    offline = load_offline_model(model_dir)
    ref = reference(offline, offline.encode(_passages(3), 48))
    scales = [(searched.layers[n].k_scale, searched.layers[n].v_scale) for n in names]
    calibrated = measure(offline, ref, fp8_plan(scales, "fp8_e4m3")).mean_kl
    assert calibrated < measure(offline, ref, fp8_plan([(1.0, 1.0)] * 2, "fp8_e4m3")).mean_kl
    assert math.isfinite(calibrated)
