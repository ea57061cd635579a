"""ttft-regression locustfile: open-loop Poisson arrivals at --kvops-rate, compared with
--kvops-baseline (a previous result JSON); exit code 3 on a significant regression."""

from __future__ import annotations

import time

import gevent
from locust import constant, task

from kvops.loadtest.config import TtftRegressionConfig
from kvops.loadtest.scenarios import context, glue
from kvops.loadtest.scenarios.workloads import dataset_body, generated_body
from kvops.loadtest.shapes import stepped
from kvops.loadtest.users.openai import OpenAIStreamUser

glue.wire("ttft-regression")
__all__ = ["TtftRegressionShape", "TtftRegressionUser"]


class TtftRegressionShape(stepped.PoolShape):
    def pool(self) -> tuple[int, float]:
        assert self.runner is not None
        return context.pool_of(self.runner.environment)


class TtftRegressionUser(OpenAIStreamUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = context.user_rng(self.environment)

    @task
    def request(self) -> None:
        # the served name (a GET /v1/models the first time) and the dataset before the slot is
        # claimed: resolved after it, a busy server's answer made the first sends seconds late
        model = context.model_of(self.environment)
        bodies = context.dataset_of(self.environment)
        at = context.schedule_of(self.environment).claim()
        gevent.sleep(max(0.0, at - time.time()))
        if bodies:
            self.stream(dataset_body(self.rng.choice(bodies), model), scheduled_at=at)
            return
        config = context.config_of(self.environment)
        assert isinstance(config, TtftRegressionConfig)
        self.stream(generated_body(config.workload, model, self.rng), scheduled_at=at)
