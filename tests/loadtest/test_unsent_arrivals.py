"""A user pool that a slow server holds names itself behind its schedule, even when every request
it did send went out on time.

A CI run of the more-load e2e test at 16x sent 67 requests of the ~190 its schedule owed: all 64
users were waiting on responses, so the other arrivals were never claimed, never sent, and had no
lateness to record; `client_behind` stayed empty. The arrivals that came due and were never sent
now count as late (their lateness at the stop, a lower bound).

Real Locust (``kvops.loadtest.runner.run``, in one process and with a master and 2 workers)
against a loopback server that answers every request slower than the run lasts: this file checks
the client's arithmetic on a server whose slowness is exact. The same case against a real vLLM
server is tests/e2e/test_loadtest_faults_e2e.py's more-load test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from sse_servers import SseHandler, event, serving, url_of

from kvops.loadtest.analysis import load
from kvops.loadtest.runner import LoadtestRequest, run
from kvops.loadtest.shapes.poisson import ArrivalSchedule

RATE, USERS, DURATION_S = 8.0, 2, 3.0


class _Slow(SseHandler):
    """One token a second for a minute: every request outlasts the run."""

    def do_POST(self) -> None:
        self.start_stream()
        try:
            for _ in range(60):
                self.chunk(event(" tok"))
                time.sleep(1.0)
        except OSError:  # the load generator cut the request off at the stop
            pass


@pytest.fixture
def slow_server() -> Iterator[str]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), _Slow)) as server:
        yield url_of(server)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pool_held_by_a_slow_server_is_named_behind(slow_server: str, tmp_path: Path, workers: int) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("scenario: ttft-regression\nworkload: {prompt_words: 5, max_tokens: 60}\n"
                        f"rate_rps: {RATE}\nusers: {USERS}\nduration_s: {DURATION_S}\n")
    result = run(LoadtestRequest("ttft-regression", slow_server, tmp_path / "run",
                                 scenario_file=scenario, workers=workers, progress_s=0))
    summary = result["ttft"]["summary"]
    client = result["client"]
    # each user sent one request and waited on it to the end
    assert client["requests"] == USERS, client
    assert client["stopped_in_flight"] == USERS, client
    # ~RATE x DURATION_S came due: all but the first USERS were never sent (Poisson: 24 expected,
    # fewer than 8 has a probability below 1e-4)
    assert summary["unsent_overdue"] >= 8 - USERS, summary["unsent_overdue"]
    late = load.fell_behind("run", summary, 1.0)
    assert late is not None, summary["lateness_p99_s"]
    assert late.pool_exhausted, late
    (verdict,) = result["verdicts"]
    assert verdict["evidence"]["client_behind"][0]["why"].startswith(f"all {USERS} users were waiting")
    assert "never sent" in verdict["evidence"]["note"]


def test_overdue_arrivals_are_the_schedules_next_ones() -> None:
    """The oracle is the schedule's own next claims: ``overdue`` peeks at them and leaves it be."""
    schedule, twin = ArrivalSchedule(3.0, seed=7, start=0.0), ArrivalSchedule(3.0, seed=7, start=0.0)
    for _ in range(4):
        schedule.claim()
        twin.claim()
    now = 10.0
    lateness, count = schedule.overdue(now)
    due = []
    while (at := twin.claim()) <= now:
        due.append(now - at)
    assert count == len(due) > 10
    assert lateness == pytest.approx(due)
    assert schedule.claim() == pytest.approx(now - due[0])  # the schedule itself did not move
    capped, count_capped = schedule.overdue(now + 100.0, limit=5)
    assert len(capped) == 5
    assert count_capped > 100
    assert capped == sorted(capped, reverse=True)  # the most late are the ones kept
