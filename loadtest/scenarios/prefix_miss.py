"""prefix-miss locustfile: a prime phase (one request per group, once per process), then a
measure phase of shared-prefix requests; or --kvops-dataset replayed in order."""

from __future__ import annotations

import itertools

from gevent.event import Event
from locust import constant, task

from kvops.loadtest.config import PrefixMissConfig
from kvops.loadtest.scenarios import context, glue
from kvops.loadtest.scenarios.workloads import dataset_body, prefix_request
from kvops.loadtest.shapes import stepped
from kvops.loadtest.users.openai import OpenAIStreamUser

glue.wire("prefix-miss")
__all__ = ["PrefixMissShape", "PrefixMissUser"]


class PrefixMissShape(stepped.PoolShape):
    def pool(self) -> tuple[int, float]:
        assert self.runner is not None
        return context.pool_of(self.runner.environment)


class PrefixMissUser(OpenAIStreamUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = context.user_rng(self.environment)
        env = self.environment
        if not hasattr(env, "kvops_primed"):
            env.kvops_primed = Event()
            env.kvops_counter = itertools.count()
            self._prime()
            env.kvops_primed.set()
        env.kvops_primed.wait()

    def _prime(self) -> None:
        if context.dataset_of(self.environment):
            return
        config = self._config()
        model = context.model_of(self.environment)
        for group in range(config.groups):
            req = prefix_request(config, model, group, self.rng, -1)
            self.stream(req.body, phase="prime", group=req.group, shared_text=req.shared_text)

    def _config(self) -> PrefixMissConfig:
        config = context.config_of(self.environment)
        assert isinstance(config, PrefixMissConfig)
        return config

    @task
    def request(self) -> None:
        model = context.model_of(self.environment)
        number = next(self.environment.kvops_counter)
        bodies = context.dataset_of(self.environment)
        if bodies:
            self.stream(dataset_body(bodies[number % len(bodies)], model))
            return
        config = self._config()
        req = prefix_request(config, model, self.rng.randrange(config.groups), self.rng, number)
        self.stream(req.body, group=req.group, shared_text=req.shared_text)
