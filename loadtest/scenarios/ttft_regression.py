"""ttft-regression locustfile: open-loop Poisson arrivals at --kvops-rate, compared with
--kvops-baseline (a previous result JSON); exit code 3 on a significant regression."""

from __future__ import annotations

import time

import gevent
from locust import constant, task

from kvops.loadtest.scenarios import glue
from kvops.loadtest.scenarios.config import TtftRegressionConfig
from kvops.loadtest.scenarios.workloads import dataset_body, generated_body
from kvops.loadtest.shapes.stepped import PoolShape
from kvops.loadtest.users.openai import OpenAIStreamUser

glue.wire("ttft-regression")
__all__ = ["PoolShape", "TtftRegressionUser"]


class TtftRegressionUser(OpenAIStreamUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = glue.user_rng(self.environment)

    @task
    def request(self) -> None:
        at = glue.schedule_of(self.environment).claim()
        gevent.sleep(max(0.0, at - time.time()))
        model = glue.model_of(self.environment)
        bodies = glue.dataset_of(self.environment)
        if bodies:
            self.stream(dataset_body(self.rng.choice(bodies), model), scheduled_at=at)
            return
        config = glue.config_of(self.environment)
        assert isinstance(config, TtftRegressionConfig)
        self.stream(generated_body(config.workload, model, self.rng), scheduled_at=at)
