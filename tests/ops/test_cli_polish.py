"""Every command's options say what they are, closed choices are choices the shell completes,
and completion installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    # Typer finds the shell from the process tree (shellingham), not from an argument: run it
    # from bash, as an operator would, and not from wherever pytest happens to be started
    # (a detached run with no shell above it got "Shell  not supported").
    kvops = Path(sys.executable).with_name("kvops")
    # (two commands: bash would exec a lone one and leave no shell above it)
    res = subprocess.run(["bash", "-c", f"'{kvops}' --show-completion; exit $?"], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "_KVOPS_COMPLETE" in res.stdout
    assert "complete -o default -F _kvops_completion kvops" in res.stdout
