"""Background loops that never die: each step is caught, counted, logged once, and retried.

A daemon thread that raises is gone for good and nobody notices: the offload poller used to die
on the first malformed LMCache /metrics page, freezing ``kvops_offload_server_up`` and the disk
watch with it. Every plugin loop therefore runs its steps through ``ResilientLoop``: an
exception in a step counts ``kvops_internal_errors_total{component}``, is logged on the first
failure of a streak (and the recovery once), and the loop waits longer (doubling up to
``max_backoff_s``) before it tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

logger = logging.getLogger("vllm.plugins.kvops")

INTERNAL_ERRORS_DOC = "Faults inside kvops plugin code that were caught so vLLM keeps serving"


def count_internal_error(component: str, count: int = 1) -> None:
    """kvops_internal_errors_total{component} += count, in this process's registry."""
    from kvops.plugin.metrics import counter

    counter("kvops_internal_errors", INTERNAL_ERRORS_DOC, ("component",)).labels(
        component=component).inc(count)


def backoff_s(interval_s: float, streak: int, max_backoff_s: float) -> float:
    """The wait after ``streak`` failing rounds in a row (0: the normal interval)."""
    return float(min(max_backoff_s, interval_s * 2.0 ** min(streak, 16)))


class ResilientLoop(threading.Thread):
    """Runs each named step every ``interval_s``; a failing step never stops the others."""

    def __init__(self, name: str, steps: Mapping[str, Callable[[], object]], interval_s: float,
                 max_backoff_s: float = 60.0) -> None:
        super().__init__(name=name, daemon=True)
        self.steps = dict(steps)
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.stop_event = threading.Event()
        self.streak = 0
        self._failing: set[str] = set()

    def run(self) -> None:
        while True:
            self.run_once()
            if self.stop_event.wait(backoff_s(self.interval_s, self.streak, self.max_backoff_s)):
                return

    def run_once(self) -> bool:
        """One round over the steps; True when every step succeeded."""
        ok = True
        for component, step in self.steps.items():
            ok = self._run_step(component, step) and ok
        self.streak = 0 if ok else self.streak + 1
        return ok

    def _run_step(self, component: str, step: Callable[[], object]) -> bool:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any fault of a step
            try:
                count_internal_error(component)
            except Exception:  # noqa: BLE001, S110 - a broken registry must not kill the loop
                pass
            if component not in self._failing:
                self._failing.add(component)
                logger.error("kvops: %s failed (%s: %s); retrying with backoff (counted in "
                             "kvops_internal_errors_total{component=%r})", component,
                             type(exc).__name__, " ".join(str(exc).split())[:200], component)
            return False
        if component in self._failing:
            self._failing.discard(component)
            logger.warning("kvops: %s works again", component)
        return True
