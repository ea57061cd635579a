"""Every command's options say what they are, closed choices are choices the shell completes,
and completion installs."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from kvops.ops.cli.main import app


def _walk(command, path: str = "kvops"):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _walk(sub, f"{path} {name}")


def test_every_option_and_argument_has_help():
    missing = [f"{path} {p.name}" for path, command in _walk(typer.main.get_command(app))
               for p in command.params if not getattr(p, "help", None)]
    assert missing == []


def test_closed_choices_are_typer_enums():
    root = typer.main.get_command(app)
    commands = dict(_walk(root))
    choices = {
        ("kvops plan", "device"): {"cuda", "cpu"},
        ("kvops kv-capacity", "kv_cache_dtype"): {"auto", "fp8", "fp8_e4m3"},
        ("kvops bench", "name"): {"planner", "fp8", "loadgen"},
        ("kvops loadtest locustfile", "scenario"): {"kv-exhaustion", "prefix-miss", "ttft-regression"},
    }
    for (path, name), some in choices.items():
        (param,) = [p for p in commands[path].params if p.name == name]
        offered = {str(c.value) for c in param.type_descriptor.choices or ()}
        assert some <= offered, (path, name)
    assert {"kv-exhaustion", "prefix-miss", "ttft-regression"} <= set(commands["kvops loadtest"].commands)


def test_shell_completion_is_offered():
    res = CliRunner().invoke(app, ["--help"])
    assert "--install-completion" in res.output
    res = CliRunner().invoke(app, ["--show-completion", "bash"])
    assert res.exit_code == 0
    assert "_KVOPS_COMPLETE" in res.output
