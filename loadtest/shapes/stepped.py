"""Stepped closed-loop load (kv-exhaustion) and a constant pool (prefix-miss, ttft-regression).

The shapes read the scenario config from the environment, so ``locust -f`` and ``kvops
loadtest`` run the same steps; a shape ends the run, so no ``-t`` is needed.
"""

from __future__ import annotations

from locust import LoadTestShape

from kvops.loadtest.scenarios.config import KvExhaustionConfig
from kvops.loadtest.scenarios.glue import config_of

SPAWN_RATE = 100.0


class SteppedShape(LoadTestShape):
    """users = steps[i] during [i·step_s, (i+1)·step_s)."""

    def tick(self) -> tuple[int, float] | None:
        assert self.runner is not None
        config = config_of(self.runner.environment)
        assert isinstance(config, KvExhaustionConfig)
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]
        index = int(elapsed // config.step_s)
        if index >= len(config.steps):
            return None
        return config.steps[index], SPAWN_RATE


class PoolShape(LoadTestShape):
    """A constant pool of ``users`` for ``duration_s``."""

    def tick(self) -> tuple[int, float] | None:
        assert self.runner is not None
        config = config_of(self.runner.environment)
        users, duration = getattr(config, "users"), getattr(config, "duration_s")  # noqa: B009
        elapsed: float = self.get_run_time()  # type: ignore[no-untyped-call]
        if elapsed >= duration:
            return None
        # the whole pool within a second: at hundreds of arrivals/s a slower spawn would make
        # the first seconds late for want of free users, not for want of CPU
        return int(users), max(SPAWN_RATE, float(users))
