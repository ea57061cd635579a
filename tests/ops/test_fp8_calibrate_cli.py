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
