"""KVOPS_SERVER_NICE: the servers kvops starts run at that niceness (read back from the kernel),
the load generator on the same machine keeps its own; a bad value is refused by name."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from kvops.core.errors import KvopsError
from kvops.core.proc import free_port
from kvops.ops.launch import SERVER_NICE_ENV, ManagedServer, autogroups_on, can_renice


def _server(tmp_path, port: int) -> ManagedServer:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return ManagedServer(name="http", argv=argv, port=port, log_path=tmp_path / "http.log",
                         env=dict(os.environ))


def _autogroup_nice_of(pid: int) -> int | None:
    """The nice of the process's scheduling autogroup ("/autogroup-N nice X"; None: no autogroups
    in this kernel, or a kernel that shows the file but reads it empty, as CI's does)."""
    path = Path(f"/proc/{pid}/autogroup")
    found = re.search(r"\bnice (-?\d+)", path.read_text()) if path.exists() else None
    return int(found.group(1)) if found else None


def _nice_of(pid: int) -> int:
    # /proc/<pid>/stat: field 19 is the nice value; the command name (field 2) may hold spaces
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return int(fields[16])


@pytest.mark.parametrize("asked", ["10", ""])
def test_servers_run_at_the_niceness_asked_for(tmp_path, monkeypatch, asked):
    monkeypatch.setenv(SERVER_NICE_ENV, asked)
    ours, ours_group = os.nice(0), _autogroup_nice_of(os.getpid())
    server = _server(tmp_path, free_port())
    server.start(health_path="/", timeout_s=30)
    try:
        assert server.process is not None
        assert _nice_of(server.process.pid) == max(ours, int(asked or 0))
        assert os.nice(0) == ours  # the caller (the load generator) keeps its priority
        # the server's session is its own scheduling group: niced too, or its threads' nice
        # counts only among themselves (sched(7), autogroup); the caller's group is untouched
        group, our_group = _autogroup_nice_of(server.process.pid), _autogroup_nice_of(os.getpid())
        if group is not None:
            assert group == int(asked or 0)
            assert our_group == ours_group
    finally:
        server.stop()


def test_a_server_started_by_a_niced_server_keeps_that_niceness(tmp_path, monkeypatch):
    """`kvops offload serve` (itself a server kvops started) starts `lmcache server`: both at
    10, not 10 and then 20 (19: the lowest priority there is). The inner one dies with the
    outer (die_with_parent, as `kvops offload serve` starts LMCache): in its own session, the
    outer's stop does not reach it, and each run left an http.server behind."""
    monkeypatch.setenv(SERVER_NICE_ENV, "10")
    port = free_port()
    starter = (f"import os; from pathlib import Path; from kvops.ops.launch import ManagedServer; "
               f"s = ManagedServer(name='inner', argv={[sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1']!r}, "
               f"port={port}, log_path=Path({str(tmp_path / 'inner.log')!r}), env=dict(os.environ), "
               "die_with_parent=True); "
               "s.start(health_path='/', timeout_s=30); print(s.process.pid, flush=True); "
               "import time; time.sleep(60)")
    outer = ManagedServer(name="outer", argv=[sys.executable, "-c", starter], port=port,
                          log_path=tmp_path / "outer.log", env=dict(os.environ))
    outer.start(health_path="/", timeout_s=60)
    try:
        assert outer.process is not None
        log = tmp_path / "outer.log"
        deadline = time.monotonic() + 30  # the inner answers before the outer prints its pid
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        inner = int(log.read_text().split()[0])
        assert _nice_of(outer.process.pid) == max(os.nice(0), 10)
        assert _nice_of(inner) == max(os.nice(0), 10)
    finally:
        outer.stop()
    assert _gone(inner), f"the inner server (pid {inner}) outlived the outer one"


def _gone(pid: int) -> bool:
    """Whether the process exited within 10 s (absent, or a zombie its new parent has not
    reaped yet)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _thread_nices(pid: int) -> set[int]:
    return {_nice_of_task(pid, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()}


def _nice_of_task(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[16])


def test_a_start_ahead_runs_at_19_until_settled_at_the_servers_niceness(tmp_path, monkeypatch):
    """What the e2e pool's starts ahead rely on: ``launch(starting_nice=19)`` runs the start
    at 19 (its processes' nice as root, its session's where autogroups show one) and ``settle``
    puts it back to KVOPS_SERVER_NICE, every thread of it, once it is needed."""
    if not (can_renice() or autogroups_on()):
        pytest.skip("neither root nor readable autogroups: the pool starts nothing ahead here")
    monkeypatch.setenv(SERVER_NICE_ENV, "5")
    server = _server(tmp_path, free_port())
    server.launch(starting_nice=19)
    try:
        assert server.process is not None
        pid = server.process.pid
        if can_renice():
            assert _thread_nices(pid) == {19}
        if autogroups_on():
            assert _autogroup_nice_of(pid) == 19
        server.wait_ready("/", 30)
        server.settle()
        assert _thread_nices(pid) == {max(os.nice(0), 5)}
        if autogroups_on():
            assert _autogroup_nice_of(pid) == 5
    finally:
        server.stop()


def _state_of(pid: int, settled: str) -> str:
    """The process's state letter in /proc/<pid>/stat once it is one of ``settled`` (a signal
    takes effect when the kernel next schedules the process), or the last one read after 5 s."""
    deadline = time.monotonic() + 5
    while True:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        if state in settled or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def test_a_paused_start_is_stopped_its_held_time_is_not_counted_and_it_stops_on_sigterm(tmp_path):
    """What the e2e pool does to starts ahead during a latency measurement: ``pause`` stops the
    process group (state T, from the kernel), ``wait_ready`` does not count the seconds held
    (a 2 s wait held for 4 s still succeeds after ``resume``), and ``stop`` of a paused server
    ends it through its SIGTERM handler (as vLLM's), not with the SIGKILL after the grace: a
    stopped process runs no handler (only a default-action signal would end it)."""
    port = free_port()
    code = ("import signal, sys, http.server\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(43))\n"
            f"http.server.test(http.server.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')")
    server = ManagedServer(name="http", argv=[sys.executable, "-c", code], port=port,
                           log_path=tmp_path / "http.log", env=dict(os.environ))
    server.start(health_path="/", timeout_s=30)
    try:
        assert server.process is not None
        pid = server.process.pid
        server.pause()
        assert _state_of(pid, "T") == "T"
        waited: list[BaseException | None] = []

        def wait() -> None:
            try:
                server.wait_ready("/", 2.0)
                waited.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                waited.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(4)
        assert _state_of(pid, "T") == "T"
        server.resume()
        assert _state_of(pid, "SR") in "SR"
        waiter.join(30)
        assert waited == [None]
        server.pause()
    finally:
        code = server.stop(grace_s=10)
    assert code == 43


@pytest.mark.parametrize("bad", ["-5", "20", "ten", "1.5"])
def test_a_bad_niceness_is_refused_by_name_before_anything_starts(tmp_path, monkeypatch, bad):
    monkeypatch.setenv(SERVER_NICE_ENV, bad)
    server = _server(tmp_path, free_port())
    with pytest.raises(KvopsError, match=f"{SERVER_NICE_ENV}=.*0 to 19"):
        server.start(health_path="/", timeout_s=30)
    assert server.process is None
