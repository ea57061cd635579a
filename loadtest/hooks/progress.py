"""One line on stderr every few seconds while a run goes, so a person watching a 10-minute
load test sees it move: users, request rate, TTFT, the server's KV usage, preemptions, errors.

Runs where the records and /metrics samples meet (the local or master process); a master's
records arrive from its workers every 3 s, so its window lags by up to that much.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from kvops.core.prom import MetricsSample, delta
from kvops.core.stats import percentile
from kvops.loadtest.records import RequestRecord

if TYPE_CHECKING:  # gevent only once a run starts: `kvops loadtest` imports PREFIX from here
    from gevent import Greenlet

PREFIX = "kvops: progress "


def progress_line(elapsed_s: float, users: int, window: list[RequestRecord], window_s: float,
                  first: MetricsSample | None, last: MetricsSample | None) -> str:
    """The line for one window: ``window`` holds the records that ended in the last ``window_s``."""
    ttfts = [r.ttft_s for r in window if r.ok and r.ttft_s is not None]
    errors = sum(1 for r in window if not r.ok and not r.stopped)
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    kv = f"{last.get('kv_usage') * 100:.0f}%" if last is not None and "kv_usage" in last.values else "?"
    preempted = f"{delta(first, last, 'preemptions'):.0f}" if first and last else "?"
    return (f"{PREFIX}t={elapsed_s:.0f}s users={users} req/s={len(window) / max(window_s, 1e-9):.2f} "
            f"ttft_p50={_s(p50)} ttft_p99={_s(p99)} kv_usage={kv} preemptions={preempted} "
            f"errors={errors}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


class ProgressPrinter:
    """Every ``interval_s`` a line for the records that arrived since the last one."""

    def __init__(self, records: list[RequestRecord], samples: list[MetricsSample],
                 users: Callable[[], int], interval_s: float = 5.0, out: TextIO | None = None) -> None:
        self.records, self.samples, self.users = records, samples, users
        self.interval_s, self.out = interval_s, out or sys.stderr
        self._greenlet: Greenlet | None = None
        self._seen = 0
        self._started = time.monotonic()

    def start(self) -> None:
        import gevent

        if self.interval_s > 0 and self._greenlet is None:
            self._started = time.monotonic()
            self._greenlet = gevent.spawn(self._loop)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=True)
            self._greenlet = None

    def tick(self, window_s: float) -> str:
        window = self.records[self._seen:]
        self._seen = len(self.records)
        first = self.samples[0] if self.samples else None
        last = self.samples[-1] if self.samples else None
        line = progress_line(time.monotonic() - self._started, self.users(), window, window_s,
                             first, last)
        self.out.write(line + "\n")
        self.out.flush()
        return line

    def _loop(self) -> None:
        import gevent

        while True:
            gevent.sleep(self.interval_s)
            self.tick(self.interval_s)
