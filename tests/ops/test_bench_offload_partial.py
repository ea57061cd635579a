"""`kvops bench offload` stopped part-way (SIGTERM: `timeout`, a cancelled job) prints what it had
measured, marked ``complete: false``, then exits 143 as every kvops command does; before, a run
stopped after 30 minutes printed nothing.

The real command, stopped for real once its first part (the worker copy) is done and its
no-connector vLLM server is starting (its log exists in the bench's temporary folder)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_a_stopped_offload_bench_prints_what_it_measured(tmp_path: Path) -> None:
    kvops = str(Path(sys.executable).with_name("kvops"))
    out = tmp_path / "bench.json"
    bench = subprocess.Popen([kvops, "bench", "offload", "--json", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("kvops-bench-offload-*/vllm-baseline.log")):
            assert bench.poll() is None, bench.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the bench never started its vLLM server"
            time.sleep(0.2)
        bench.send_signal(signal.SIGTERM)
        stdout, stderr = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 143, stderr[-3000:]
    assert "kvops: terminated (SIGTERM)" in stderr
    printed = json.loads(stdout)
    assert printed == json.loads(out.read_text())
    assert printed["bench"] == "offload"
    assert printed["complete"] is False
    assert printed["variants"] == {}
    copy = printed["worker_copy"]
    assert copy["load_mib"] == 64.0
    assert set(copy["approaches"]) == {"lmcache_server", "lmcache_worker_scatter", "kvops_worker"}
    assert not list(tmp_path.glob("kvops-bench-offload-*")), "the bench left its folder behind"
