"""``kvops fp8 check`` and calibrate's accuracy step on tiny models whose K/V are ×1000
(kvops.ops.fp8.kv_scaled_model: the same function as the plain model, but scale 1.0 saturates
e4m3). The faults are planted: a scales file with 1.0 for layer 2 only must make layer 2 the
costly one and the layer to keep in bf16; 1.0 everywhere is beyond what skipping one layer
fixes. No server: the A/B is offline (kvops.ops.fp8.offline)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.core.fp8.scales import (
    LayerScales,
    ScalesFile,
    fingerprint_of_config,
    load_scales_file,
    read_model_config,
    scale_from_absmax,
)
from kvops.ops.cli.main import build_app
from kvops.ops.fp8.calibrate_accuracy import with_accuracy
from kvops.ops.fp8.kv_scaled_model import build_kv_scaled_model
from kvops.ops.fp8.offline import load_offline_model
from kvops.ops.models.tiny import TinyModelSpec

LICENSE = Path("/usr/share/common-licenses/Apache-2.0")
runner = CliRunner()


def _passages(count: int) -> list[str]:
    """Paragraphs of a license text Debian ships (not text written for the test)."""
    paragraphs = [" ".join(p.split()) for p in LICENSE.read_text().split("\n\n")]
    return [p for p in paragraphs if len(p.split()) >= 30][:count]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8check")
    build_kv_scaled_model(root / "model", 1000.0, TinyModelSpec(layers=4))
    (root / "prompts.txt").write_text("\n".join(_passages(8)) + "\n")
    model = load_offline_model(root / "model")
    absmax = model.absmax(model.encode(_passages(16)[8:], 64))  # calibration passages, disjoint
    calibrated = [(scale_from_absmax(k, "fp8_e4m3"), scale_from_absmax(v, "fp8_e4m3")) for k, v in absmax]
    layer2_at_1 = [(1.0, 1.0) if i == 2 else s for i, s in enumerate(calibrated)]
    for name, scales in (("calibrated", calibrated), ("layer2", layer2_at_1), ("ones", [(1.0, 1.0)] * 4)):
        (root / f"{name}.json").write_text(_scales_file(root / "model", scales).model_dump_json())
    return root


def _scales_file(model_dir: Path, scales: list[tuple[float, float]]) -> ScalesFile:
    return ScalesFile(dtype="fp8_e4m3", model=fingerprint_of_config(read_model_config(model_dir)),
                      layers={f"model.layers.{i}.self_attn.attn": LayerScales(k_scale=k, v_scale=v)
                              for i, (k, v) in enumerate(scales)})


def _check(work: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(build_app(), ["fp8", "check", "--model", str(work / "model"),
                                         "--max-tokens", "64", *args])
    return result.exit_code, result.output


def test_calibrated_scales_are_safe(work: Path) -> None:
    code, out = _check(work, "--prompts", str(work / "prompts.txt"), "--scales", str(work / "calibrated.json"))
    assert code == 0, out
    assert "\nsafe (threshold: perplexity ratio and exp(mean KL) <= 1.005)" in out
    assert "fp8 scale 1.0: perplexity ratio" in out


def test_one_saturating_layer_is_advised_to_stay_bf16(work: Path) -> None:
    code, out = _check(work, "--prompts", str(work / "prompts.txt"), "--scales", str(work / "layer2.json"))
    assert code == 0, out
    assert "safe with skip layers 2 (threshold" in out
    assert "serve with: --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 2" in out


def test_scale_one_everywhere_is_not_safe_exit_3(work: Path) -> None:
    code, out = _check(work, "--prompts", str(work / "prompts.txt"), "--scales", str(work / "ones.json"),
                       "--greedy-tokens", "4")
    assert code == 3, out
    assert "not safe (threshold: perplexity ratio and exp(mean KL) <= 1.005)" in out
    assert "greedy equal" in out
    # every layer saturates: sparing the one layer a 4-layer model's advice allows cannot fix it, and it says so
    assert "not safe even with 1 of 4 layers' KV in bf16, the most the advice spares" in out


def test_request_bodies_and_json_output(work: Path, tmp_path: Path) -> None:
    """OpenAI request bodies, one per line: completions' prompt and chat messages (rendered
    with the model's chat template)."""
    passages = _passages(4)
    bodies = [{"model": "m", "prompt": passages[0]}, {"model": "m", "prompt": passages[1]},
              {"model": "m", "messages": [{"role": "user", "content": passages[2]}]}]
    path = tmp_path / "bodies.jsonl"
    path.write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    invoked = runner.invoke(build_app(), ["fp8", "check", "--model", str(work / "model"), "--prompts", str(path),
                                          "--scales", str(work / "calibrated.json"), "--json"])
    assert invoked.exit_code == 0, invoked.output
    result = json.loads(invoked.stdout)
    assert result["verdict"] == "safe"
    assert result["skip_layers_limit"] == 1
    assert result["skip_layers_capped"] is False
    assert result["sequences"] == 3
    assert set(result["variants"]) == {"fp8 scale 1.0", "fp8 calibrated"}


@pytest.mark.parametrize(("args", "names"), [
    (["--prompts", "/nonexistent/prompts.txt"], "--prompts"),
    (["--threshold", "0.9"], "--threshold"),
    (["--scales", "/nonexistent/scales.json"], "kv_scales file"),
])
def test_bad_input_is_one_line_exit_2(work: Path, args: list[str], names: str) -> None:
    base = [] if "--prompts" in args else ["--prompts", str(work / "prompts.txt")]
    code, out = _check(work, *base, *args)
    assert code == 2, out
    assert names in out
    assert len(out.strip().splitlines()) == 1


def test_a_bad_request_body_names_its_line(work: Path, tmp_path: Path) -> None:
    path = tmp_path / "bodies.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    code, out = _check(work, "--prompts", str(path))
    assert code == 2
    assert f"{path}:2" in out
    assert len(out.strip().splitlines()) == 1


def test_another_models_scales_are_refused(work: Path, tmp_path: Path) -> None:
    other = build_kv_scaled_model(tmp_path / "other", 1.0, TinyModelSpec(layers=2))
    (tmp_path / "other.json").write_text(_scales_file(other, [(1.0, 1.0)] * 2).model_dump_json())
    code, out = _check(work, "--prompts", str(work / "prompts.txt"), "--scales", str(tmp_path / "other.json"))
    assert code == 2, out
    assert "not this model's" in out


def test_calibrate_writes_per_layer_cost_and_advice(work: Path, tmp_path: Path) -> None:
    """The accuracy step calibrate runs after recording: layer 2 (planted at scale 1.0) costs
    the most alone and is the advice; the file still loads as a scales file."""
    scales = load_scales_file(work / "layer2.json")
    annotated = with_accuracy(scales, work / "model", _passages(8), token_budget=512)
    costs = {name: layer.kl_alone for name, layer in annotated.layers.items()}
    assert max(costs, key=lambda n: costs[n] or 0.0) == "model.layers.2.self_attn.attn"
    assert annotated.accuracy is not None
    assert annotated.accuracy.skip_layers == [2]
    assert annotated.accuracy.safe
    assert math.exp(annotated.accuracy.scale1_mean_kl) > annotated.accuracy.threshold
    path = tmp_path / "annotated.json"
    path.write_text(annotated.model_dump_json())
    assert load_scales_file(path).accuracy == annotated.accuracy


def test_a_scales_file_from_before_the_accuracy_fields_still_loads(work: Path, tmp_path: Path) -> None:
    old = json.loads((work / "calibrated.json").read_text())
    old.pop("accuracy")
    for layer in old["layers"].values():
        for key in [k for k in layer if k not in ("k_scale", "v_scale")]:
            layer.pop(key)
        layer.update(k_error=0.026, v_error=0.026, k_error_scale1=0.026, v_error_scale1=0.026)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert load_scales_file(path).accuracy is None
