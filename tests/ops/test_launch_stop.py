"""ManagedServer.stop gives the processes left in a server's group time to finish their own
exit after the main process has gone, and SIGKILLs only the ones still there after the grace.

vLLM's engine core unlinks its shared-memory queues (/dev/shm/psm_*, 160 + 240 MiB) as it exits
on SIGTERM; the stop that SIGKILLed the group as soon as the API server had exited left them in
/dev/shm in 1 of 2 stops measured. Here the same order, with real processes: the main process
dies at once on SIGTERM, its child cleans up for a second first."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kvops.core.proc import free_port
from kvops.ops.launch import ManagedServer

CHILD = """
import os, signal, sys, time
marker = sys.argv[1]
def cleanup(*_):
    time.sleep(float(sys.argv[2]))  # vLLM's engine core shutting down
    os.unlink(marker)
    sys.exit(0)
signal.signal(signal.SIGTERM, cleanup)
open(marker + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""
MAIN = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
while True:
    time.sleep(1)  # SIGTERM ends it at once (no handler)
"""


def _server(tmp_path: Path, cleanup_s: float) -> tuple[ManagedServer, Path]:
    marker = tmp_path / "segment"
    marker.touch()
    argv = [sys.executable, "-c", MAIN, CHILD, str(marker), str(cleanup_s)]
    server = ManagedServer(name="group", argv=argv, port=free_port(), log_path=tmp_path / "group.log",
                           env=dict(os.environ))
    server.launch()
    deadline = time.monotonic() + 30
    while not Path(str(marker) + ".ready").exists():
        assert time.monotonic() < deadline, (tmp_path / "group.log").read_text()
        time.sleep(0.05)
    return server, marker


def test_a_child_still_cleaning_up_after_the_main_process_exits_is_let_finish(tmp_path):
    server, marker = _server(tmp_path, cleanup_s=1.0)
    started = time.monotonic()
    server.stop(grace_s=20)
    assert not marker.exists()  # the child's cleanup ran to its end
    assert 1.0 <= time.monotonic() - started < 10
    assert server.process is not None
    assert set(_states(server.process.pid)) <= {"Z"}


def test_a_child_that_outlives_the_grace_is_killed_when_it_ends(tmp_path):
    server, marker = _server(tmp_path, cleanup_s=60.0)
    started = time.monotonic()
    server.stop(grace_s=2)
    assert marker.exists()  # killed in its cleanup
    assert 2.0 <= time.monotonic() - started < 10
    assert server.process is not None
    assert set(_states(server.process.pid)) <= {"Z"}  # nothing left running (zombies: init's to reap)


def _states(group: int) -> list[str]:
    """The kernel's state letter of each process in the group (/proc/<pid>/stat)."""
    states = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(group):
            states.append(fields[0])
    return states
