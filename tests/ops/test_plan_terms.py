"""The plan says which non-KV terms it measured, estimated or defaulted, and how to make them exact."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvops.ops.cli.main import app

FIXTURES = Path(__file__).parents[2] / "../shared/fixtures/model-configs"
BASE = ["plan", "--gpu", "H100", "--max-model-len", "8192", "--json"]


def _notes(config: str, *extra: str) -> list[str]:
    out = CliRunner().invoke(app, [*BASE, "--config", str(FIXTURES / config), *extra])
    assert out.exit_code == 0, out.output
    notes: list[str] = json.loads(out.output)["notes"]
    return notes


def test_defaults_are_named_with_the_command_that_measures_them() -> None:
    note = next(n for n in _notes("meta-llama--Meta-Llama-3.1-8B.json") if n.startswith("non-KV terms"))
    assert "estimated from config.json: weights" in note
    assert "defaulted: activation, non_torch, cudagraph" in note
    assert "--calibration-out" in note


def test_given_terms_are_not_called_defaults() -> None:
    note = next(n for n in _notes("meta-llama--Meta-Llama-3.1-8B.json", "--activation-gib", "1.5", "--non-torch-gib",
                                  "0.3", "--cudagraph-gib", "0.5") if n.startswith("non-KV terms"))
    assert "measured or given: activation, non_torch, cudagraph" in note
    assert "defaulted: none" in note


def test_moe_activation_uncertainty_is_said_only_for_moe() -> None:
    assert any("held-out MoE logs" in n for n in _notes("Qwen--Qwen3-30B-A3B.json"))
    assert not any("held-out" in n for n in _notes("meta-llama--Meta-Llama-3.1-8B.json"))
