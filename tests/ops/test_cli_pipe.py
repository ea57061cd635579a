"""`kvops … | head`: a reader that goes away ends kvops quietly (exit 0, or 141 as by SIGPIPE),
never with "kvops: internal error: BrokenPipeError" or Python's "Exception ignored" at exit.

The pipes are real: in the first test the reading end is closed before kvops has written
anything, so every write meets a pipe without a reader (EPIPE for certain, not by a race); the
second runs the pipeline a shell runs, where `head` may or may not have gone before kvops writes.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

LLAMA_8B = Path(__file__).parents[2] / "../shared/fixtures/model-configs/meta-llama--Meta-Llama-3.1-8B.json"
KVOPS = [str(Path(sys.executable).with_name("kvops"))]  # the console script an operator runs
LONG_OUTPUTS = {
    "plan": ["plan", "--config", str(LLAMA_8B), "--gpu", "H100", "--max-model-len", "8192"],
    "help": ["--help"],
    "subcommand-help": ["plan", "--help"],
    "runbook-page": ["runbook", "kv-exhaustion"],
    "alert-rules": ["alerts", "rules"],
}
QUIET = (0, 141)


@pytest.mark.parametrize("args", LONG_OUTPUTS.values(), ids=LONG_OUTPUTS.keys())
def test_a_reader_gone_before_the_output_ends_kvops_quietly(args):
    proc = subprocess.Popen([*KVOPS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # the only reader: kvops' writes now fail with EPIPE
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in QUIET, err
    assert err == ""


@pytest.mark.parametrize("args", LONG_OUTPUTS.values(), ids=LONG_OUTPUTS.keys())
def test_kvops_into_head_in_a_shell(args):
    line = " ".join(shlex.quote(a) for a in [*KVOPS, *args])
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {line} | head -1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode in QUIET, proc.stderr
    assert proc.stderr == ""
    assert len(proc.stdout.splitlines()) == 1
