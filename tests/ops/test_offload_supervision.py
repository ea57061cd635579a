"""Supervised children die with their supervisor, and a start that finds our ports taken names
the holder in one line. Real processes: a supervisor killed with SIGKILL, a real listening port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvops.core.errors import KvopsError
from kvops.core.offload.settings import OffloadSettings
from kvops.core.proc import free_port, port_holder
from kvops.ops.offload.serve import check_ports_free

SUPERVISOR = """
import os, subprocess, sys, time
from kvops.ops.launch import _parent_death_signal
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True, preexec_fn=_parent_death_signal(os.getpid()))
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_a_child_in_its_own_session_dies_when_its_supervisor_is_killed():
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE,
                                  text=True)
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    try:
        assert _alive(child)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        assert _gone_within(child, 30)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


LAUNCHER = """
import os, sys, threading, time
from pathlib import Path
from kvops.core.proc import free_port
from kvops.ops.launch import ManagedServer

def launch(log):
    port = free_port()
    server = ManagedServer(name="fake-sse", port=port, log_path=Path(log), env=dict(os.environ),
                           argv=[sys.executable, "-m", "kvops.ops.bench.fake_sse", str(port)],
                           die_with_parent=True)
    server.launch()
    return server

main = launch(sys.argv[1] + "/main.log")
box = []
worker = threading.Thread(target=lambda: box.append(launch(sys.argv[1] + "/thread.log")))
worker.start()
worker.join()  # the thread that started it has ended
time.sleep(1.0)
print(main.process.pid, box[0].process.pid, flush=True)
time.sleep(120)
"""


def test_a_managed_server_dies_with_the_process_that_launched_it_from_its_main_thread(tmp_path):
    """vllm_server's servers are die_with_parent (a `kill -9` of kvops left vLLM running); the
    e2e pool starts them from worker threads, whose end must not stop them."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE,
                                text=True)
    assert launcher.stdout is not None
    main, threaded = (int(x) for x in launcher.stdout.readline().split())
    try:
        assert _alive(threaded), "a server launched from a thread died when the thread ended"
        assert _alive(main)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone_within(main, 30), "the server outlived the kill -9 of the process that started it"
    finally:
        for pid in (main, threaded):
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_a_taken_port_is_named_with_its_holder_in_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        holder = port_holder(port)
        assert holder is not None
        assert holder[0] == os.getpid()
        settings = OffloadSettings(port=free_port(), http_port=port)
        with pytest.raises(KvopsError) as caught:
            check_ports_free(settings)
    message = str(caught.value)
    assert "\n" not in message
    assert f"kvops.offload.http_port {port} on 127.0.0.1 is already taken by pid {os.getpid()}" in message
    assert f"kill {os.getpid()}" in message
    check_ports_free(settings)  # released: no complaint
