"""A distributed run keeps every request its workers sent, also when a worker is slow at the end.

A headless Locust master used to send its workers "quit" and exit 0.5 s later
(locust/runners.py ``MasterRunner.quit``): a worker that took longer to send its final report
(a busy machine) lost every record since its last periodic report (every 3 s), the requests cut
off at the stop included. The oracle is the server's own count of the requests it received: each
must be one record, finished or stopped in flight.

Real Locust (``kvops.loadtest.runner.run``, a master and 2 workers) against a loopback SSE server
that counts requests. The slow worker is produced for real: both workers are paused with SIGSTOP
for 2 s around the end of the run (shorter than the ~4 s of silence after which Locust's heartbeat
declares a worker missing).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from sse_servers import SseHandler, event, serving, url_of

from kvops.loadtest.records import read_jsonl
from kvops.loadtest.runner import LoadtestRequest, run

DURATION_S = 4.5
PAUSE = (DURATION_S - 0.2, DURATION_S + 1.8)
"""Seconds after the first spawn. The shape ticks about once a second and ends the run at its first
tick at or past DURATION_S, ~5 s in: the workers stop before that and resume after the master's
old 0.5 s grace has passed, with ~0.7 s to spare either side."""
EVENTS, PACE_S = 10, 0.1  # a request lasts ~1 s: a few are in flight at the end
_END = event("", usage={"prompt_tokens": 5, "completion_tokens": EVENTS, "total_tokens": 5 + EVENTS})


class CountingServer(ThreadingHTTPServer):
    posts = 0


class _Handler(SseHandler):
    server: CountingServer

    def do_POST(self) -> None:
        self.server.posts += 1  # one increment per request thread: the GIL keeps it whole
        self.start_stream()
        try:
            for chunk in [event(" tok")] * EVENTS + [_END + b"data: [DONE]\n\n", b""]:
                self.chunk(chunk)
                time.sleep(PACE_S)
        except OSError:  # the load generator cut the request off at the stop
            pass


@pytest.fixture
def counting_server() -> Iterator[CountingServer]:
    with serving(CountingServer(("127.0.0.1", 0), _Handler)) as server:
        yield server


def _workers() -> list[int]:
    """This process's Locust worker children (the runner starts them)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"--worker" in argv:
            found.append(int(entry.name))
    return found


def _pause_at_the_end(log: Path, stop: threading.Event, paused: list[int]) -> None:
    """SIGSTOP the workers over the run's end, then SIGCONT them; ``paused`` gets their pids."""
    while not stop.is_set() and "Shape test updating" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    spawned, pids = time.monotonic(), _workers()
    time.sleep(max(0.0, spawned + PAUSE[0] - time.monotonic()))
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            paused.append(pid)
        time.sleep(PAUSE[1] - PAUSE[0])
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_master_keeps_a_slow_workers_last_records(counting_server: CountingServer, tmp_path: Path) -> None:
    url = url_of(counting_server)
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("scenario: ttft-regression\nworkload: {prompt_words: 5, max_tokens: 10}\n"
                        f"rate_rps: 8\nusers: 32\nduration_s: {DURATION_S}\n")
    out, stop, paused = tmp_path / "run", threading.Event(), list[int]()
    out.mkdir()
    pauser = threading.Thread(target=_pause_at_the_end, args=(out / "locust-master.log", stop, paused))
    pauser.start()
    try:
        result = run(LoadtestRequest("ttft-regression", url, out, scenario_file=scenario, workers=2,
                                     progress_s=0))
    finally:
        stop.set()
        pauser.join()
    assert len(paused) == 2, paused
    records = list(read_jsonl(Path(result["files"]["records"])))
    # every request the server received is a record; a record it never received can only be one
    # cut off before its response began (killed while connecting or sending)
    answered = [r for r in records if not r["stopped"] or r["headers_s"] is not None]
    assert len(answered) <= counting_server.posts <= len(records), (
        f"server received {counting_server.posts}, records {len(records)} ({len(answered)} answered)")
    assert len({r["worker"] for r in records}) == 2, result["client"]
    assert any(r["stopped"] for r in records)  # requests were in flight at the stop
