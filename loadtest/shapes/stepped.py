"""Stepped closed-loop load (kv-exhaustion) and a constant pool (prefix-miss, ttft-regression).

The shapes are abstract: a scenario's locustfile subclasses them and says where the steps or
the pool come from (its config, read from the environment), so ``locust -f`` and ``kvops
loadtest`` run the same steps; a shape ends the run, so no ``-t`` is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from locust import LoadTestShape

SPAWN_RATE = 100.0


class SteppedShape(LoadTestShape):
    """users = steps[i] during [i·step_s, (i+1)·step_s)."""

    abstract = True

    def steps(self) -> tuple[Sequence[int], float]:
        """The user counts of the steps, and each step's length in seconds."""
        raise NotImplementedError

    def tick(self) -> tuple[int, float] | None:
        steps, step_s = self.steps()
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]
        index = int(elapsed // step_s)
        if index >= len(steps):
            return None
        return steps[index], SPAWN_RATE


class PoolShape(LoadTestShape):
    """A constant pool of ``users`` for ``duration_s``."""

    abstract = True

    def pool(self) -> tuple[int, float]:
        """The number of users and the run's length in seconds."""
        raise NotImplementedError

    def tick(self) -> tuple[int, float] | None:
        users, duration = self.pool()
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]
        if elapsed >= duration:
            return None
        # the whole pool within a second: at hundreds of arrivals/s a slower spawn would make
        # the first seconds late for want of free users, not for want of CPU
        return int(users), max(SPAWN_RATE, float(users))
