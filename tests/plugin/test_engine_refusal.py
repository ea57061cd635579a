"""Refusing from an engine process: real child processes stand in for vLLM's engine core and
worker (the exit path, the note, the engine core taken down), and the front end's wait for the
engines turns their death into one line and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvops.plugin import _compat

# An "engine core" that starts a "worker" and waits; the worker refuses as the connector does.
ENGINE = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(worker.pid, flush=True)
worker.wait()
time.sleep(60)  # must not get here: the refusing worker kills this process first
"""
WORKER = """
from kvops.plugin._compat import refuse_in_engine
refuse_in_engine("LMCache server tcp://127.0.0.1:1 does not answer")
"""


def _env(note: Path) -> dict[str, str]:
    return {**os.environ, _compat.FRONTEND_PID_ENV: str(os.getpid()),
            _compat.REFUSAL_NOTE_ENV: str(note)}


def test_a_refusing_worker_takes_its_engine_core_down_quietly(tmp_path: Path):
    note = tmp_path / "note"
    engine = subprocess.run([sys.executable, "-c", ENGINE, WORKER], env=_env(note),
                            capture_output=True, text=True, timeout=60, check=False)
    assert engine.returncode == -9  # SIGKILL, without a traceback of its own
    assert engine.stderr == ""
    assert note.read_text() == "LMCache server tcp://127.0.0.1:1 does not answer"


def test_a_refusing_engine_core_exits_2_and_leaves_the_reason(tmp_path: Path):
    note = tmp_path / "note"
    code = ("from kvops.plugin._compat import refuse_in_engine\n"
            "refuse_in_engine('no LMCache')")
    done = subprocess.run([sys.executable, "-c", code], env=_env(note), capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr) == (2, "")
    assert note.read_text() == "no LMCache"


def test_without_a_separate_front_end_the_line_is_printed_here(monkeypatch, capsys):
    monkeypatch.delenv(_compat.FRONTEND_PID_ENV, raising=False)
    with pytest.raises(SystemExit) as stop:
        _compat.refuse_in_engine("no  LMCache\nat all")
    assert stop.value.code == 2
    assert capsys.readouterr().err == "kvops: refusing to start: no LMCache at all\n"


@pytest.fixture
def engine_utils(monkeypatch):
    import vllm.v1.engine.utils as engine_utils

    monkeypatch.setattr(engine_utils, "wait_for_engine_startup", _engine_died)
    for name in (_compat.FRONTEND_PID_ENV, _compat.REFUSAL_NOTE_ENV):
        # set, then deleted: monkeypatch records the variable and removes what arming writes
        # after the test (a bare delenv of an unset variable records nothing, and this pytest
        # process then passed KVOPS_FRONTEND_PID to every server it started: a refusing one
        # took itself for an engine process and exited 2 without its line)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    _compat.arm_engine_refusal()
    return engine_utils


def _engine_died(*args: object, **kwargs: object) -> None:
    raise RuntimeError("Engine core initialization failed. See root cause above.")


def test_front_end_says_the_engine_refusal_in_one_line(engine_utils, capsys):
    Path(os.environ[_compat.REFUSAL_NOTE_ENV]).write_text("LMCache went away")
    with pytest.raises(SystemExit) as stop:
        engine_utils.wait_for_engine_startup()
    assert stop.value.code == 2
    assert capsys.readouterr().err == "kvops: refusing to start: LMCache went away\n"
    assert not Path(os.environ[_compat.REFUSAL_NOTE_ENV]).exists()


def test_an_engine_core_rebuilding_the_config_keeps_its_front_ends_note(engine_utils, monkeypatch):
    note = os.environ[_compat.REFUSAL_NOTE_ENV]
    monkeypatch.setenv(_compat.FRONTEND_PID_ENV, str(os.getppid()))  # as an engine core sees it
    _compat.arm_engine_refusal()
    assert os.environ[_compat.REFUSAL_NOTE_ENV] == note


def test_front_end_leaves_other_engine_failures_to_vllm(engine_utils):
    assert os.environ[_compat.FRONTEND_PID_ENV] == str(os.getpid())
    assert not Path(os.environ[_compat.REFUSAL_NOTE_ENV]).exists()  # armed, nothing refused
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        engine_utils.wait_for_engine_startup()


def test_a_refusing_worker_spares_a_parent_that_is_not_the_engine_core(tmp_path: Path):
    """The worker's parent is not the front end's child (a subreaper stands between): it is not
    ours to SIGKILL, so the worker only exits."""
    note = tmp_path / "note"
    survivor = ("import subprocess, sys\n"
                "worker = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
                "print('worker exited', worker.wait(), flush=True)\n")
    middle = "import subprocess, sys\nsys.exit(subprocess.call([sys.executable, '-c'] + sys.argv[1:]))\n"
    done = subprocess.run([sys.executable, "-c", middle, survivor, WORKER], env=_env(note),
                          capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "worker exited 2\n")
    assert note.read_text() == "LMCache server tcp://127.0.0.1:1 does not answer"
