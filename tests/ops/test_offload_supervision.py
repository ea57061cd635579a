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


def test_a_child_in_its_own_session_dies_when_its_supervisor_is_killed():
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE,
                                  text=True)
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    try:
        assert _alive(child)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


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
