"""``kvops calibrate`` input errors: one line, exit 2, before any server starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvops.ops.cli.main import app
from kvops.ops.fp8.calibrate import load_prompts, quantization_error, synthetic_prompts

runner = CliRunner()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return model


def _calibrate(*args: str):
    result = runner.invoke(app, ["calibrate", *args])
    assert "Traceback" not in result.output
    return result


def test_needs_exactly_one_prompt_source(model_dir, tmp_path):
    out = str(tmp_path / "s.json")
    for extra in ([], ["--synthetic", "2", "--prompts", str(tmp_path / "p.txt")]):
        result = _calibrate("--model", str(model_dir), "--out", out, *extra)
        assert result.exit_code == 2
        assert "give exactly one of --prompts FILE or --synthetic N" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "/nonexistent/p.txt"], "--prompts /nonexistent/p.txt: no such file"),
        (["--synthetic", "0"], "--synthetic must be >= 1"),
        (["--synthetic", "2", "--dtype", "int8"], "--dtype int8: kvops calibrate measures per-tensor scales for fp8, fp8_e4m3, fp8_e5m2"),
        (["--synthetic", "2", "--margin", "0.5"], "--margin 0.5: must be >= 1.0"),
        (["--synthetic", "2", "--search-steps", "-1"], "--search-steps must be >= 0"),
    ],
)
def test_bad_inputs_are_one_line(model_dir, tmp_path, args, message):
    result = _calibrate("--model", str(model_dir), "--out", str(tmp_path / "s.json"), *args)
    assert result.exit_code == 2
    assert message in result.stderr


def test_model_without_config_and_missing_out_dir(tmp_path, model_dir):
    result = _calibrate("--model", str(tmp_path), "--out", str(tmp_path / "s.json"), "--synthetic", "1")
    assert result.exit_code == 2
    assert "no config.json" in result.stderr
    result = _calibrate("--model", str(model_dir), "--out", "/nonexistent/dir/s.json", "--synthetic", "1")
    assert result.exit_code == 2
    assert "directory /nonexistent/dir does not exist" in result.stderr


def test_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo\n")
    assert load_prompts(text) == ("one", "two")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(Exception, match=r"p\.jsonl:2: expected"):
        load_prompts(jsonl)
    assert synthetic_prompts(3) == synthetic_prompts(3)


def test_quantization_error_against_torch_fp8():
    import torch
    values = torch.tensor([1000.0, -1000.0, 1.0])
    # At scale 1.0 e4m3 clips 1000 to 448: error is what torch's own fp8 cast gives after clipping.
    expected = (torch.tensor([552.0, -552.0, 0.0]).pow(2).mean().sqrt() / values.pow(2).mean().sqrt())
    assert quantization_error(values, 1.0, "fp8_e4m3") == pytest.approx(float(expected), rel=1e-6)
    assert quantization_error(values, 1000.0 / 448.0, "fp8_e4m3") < 0.05


@pytest.mark.parametrize(("method", "says"), [
    ("absmax", "scales: absmax × 1.25 / the format's max (no offline search)"),
    ("output-search", "scales: searched per layer (16 per octave) for the least change of its attention output: "
                      "K 0.0200 (1.0: 0.0400), V 0.0100 (1.0: 0.0100), mean over layers"),
    ("output-search-k", "scales: searched per layer (K's; V at 1.0 did better on the calibration prompts) "
                        "(16 per octave) for the least change of its attention output: "
                        "K 0.0200 (1.0: 0.0400), V 0.0100 (1.0: 0.0100), mean over layers"),
    ("scale1-fallback", "scales: 1.0 in every layer (the searched scales did worse than 1.0 on the calibration prompts)"),
])
def test_calibrate_says_how_the_scales_were_chosen(tmp_path: Path, method: str, says: str) -> None:
    from kvops.core.fp8.scales import LayerScales, ModelFingerprint, ScalesFile
    from kvops.ops.cli.calibrate import calibrate_lines

    layer = LayerScales(k_scale=0.05, v_scale=0.01, k_output_error=0.02, k_output_error_scale1=0.04,
                        v_output_error=0.01, v_output_error_scale1=0.01)
    scales = ScalesFile(dtype="fp8_e4m3", scale_method=method, search_steps=16 if method != "absmax" else None,
                        model=ModelFingerprint(architecture="A", num_layers=1, num_kv_heads=1, head_dim=64,
                                               config_sha256="x"),
                        layers={"model.layers.0.self_attn.attn": layer})
    assert calibrate_lines(scales, tmp_path / "s.json")[1] == says
