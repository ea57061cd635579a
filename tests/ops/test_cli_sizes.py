"""Sizes and token counts on the capacity commands take what `vllm serve` takes (8G, 32k ...)
and the GiB of vLLM's log lines, and give the same plan as the plain numbers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvops.ops.cli.main import app


def _capacity(model_configs_dir, mml: str, kv: str):
    config = model_configs_dir / "meta-llama--Meta-Llama-3.1-8B.json"
    return CliRunner().invoke(app, ["kv-capacity", "--config", str(config), "--max-model-len", mml,
                                    "--kv-cache-memory-bytes", kv, "--json"])


@pytest.mark.parametrize(("mml", "kv", "plain_mml", "plain_kv"), [
    ("32k", "8G", 32000, 8 << 30),
    ("32K", "8GiB", 32768, 8 << 30),
    ("8192", "3.52 GiB", 8192, int(3.52 * (1 << 30))),
    ("1.5k", "8g", 1500, 8 * 10**9),
])
def test_vllm_forms_plan_as_the_numbers_they_stand_for(model_configs_dir, mml, kv, plain_mml, plain_kv):
    forms, plain = _capacity(model_configs_dir, mml, kv), _capacity(model_configs_dir, str(plain_mml), str(plain_kv))
    assert forms.exit_code == 0, forms.output
    assert json.loads(forms.stdout) == json.loads(plain.stdout)


def test_a_form_vllm_refuses_is_refused_naming_the_option(model_configs_dir):
    res = _capacity(model_configs_dir, "1.5M", "8G")
    assert res.exit_code == 2
    assert "--max-model-len" in res.output
    assert "did you mean 1.5m" in res.output
