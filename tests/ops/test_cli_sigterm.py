"""SIGTERM to `kvops` (a cancelled CI job, `timeout`, a pod's stop) stops the servers the
command started and exits 143 with one line; Python's default ended kvops at once and left them
running (a `kvops bench offload` killed this way left two vLLM servers behind).

The command that holds a server is added to the real app for this test only: every kvops
command that starts one (benches, demo, verify --calibration-out) needs a vLLM start of a
minute or more, and the path under test is the console entry's, not the command's. The server
is a real process: the loadgen bench's fake SSE server, started by ManagedServer as the benches
start theirs (its own session, so a signal to kvops does not reach it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import os, sys, time
from pathlib import Path
from kvops.core.proc import free_port
from kvops.ops.cli import main as cli
from kvops.ops.launch import ManagedServer

@cli.app.command("hold-a-server")
def hold(log: str) -> None:
    port = free_port()
    server = ManagedServer(name="fake-sse", port=port, log_path=Path(log), env=dict(os.environ),
                           argv=[sys.executable, "-m", "kvops.ops.bench.fake_sse", str(port)])
    server.start(health_path="/v1/models", timeout_s=60)
    try:
        print(server.process.pid, flush=True)
        time.sleep(600)
    finally:
        server.stop()

sys.argv = ["kvops", "hold-a-server", sys.argv[1]]
cli.main()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_sigterm_stops_the_servers_a_command_started_and_exits_143(tmp_path):
    kvops = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "fake.log")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert kvops.stdout is not None
        server_pid = int(kvops.stdout.readline() or 0)
        assert server_pid, kvops.stderr.read() if kvops.stderr else ""
        assert _alive(server_pid)
        kvops.send_signal(signal.SIGTERM)
        code = kvops.wait(timeout=60)
        err = kvops.stderr.read() if kvops.stderr else ""
        deadline = time.monotonic() + 5
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), "the server kvops started outlived its SIGTERM"
        assert code == 143, err
        assert err.splitlines() == [
            "kvops: terminated (SIGTERM); stopped what this command had started"], err
    finally:
        if kvops.poll() is None:
            kvops.kill()
        if server_pid and _alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
