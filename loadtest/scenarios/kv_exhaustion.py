"""kv-exhaustion locustfile: ``locust -f kv_exhaustion.py --headless --host URL``.

Stepped users, each sending long EOS-ignoring completions back to back (or replaying
--kvops-dataset); the verdict classifies each step and compares the knee with the KV cache's
predicted concurrency.
"""

from __future__ import annotations

from locust import constant, task

from kvops.loadtest.scenarios import glue
from kvops.loadtest.scenarios.config import KvExhaustionConfig
from kvops.loadtest.scenarios.workloads import dataset_body, generated_body
from kvops.loadtest.shapes.stepped import SteppedShape
from kvops.loadtest.users.openai import OpenAIStreamUser

glue.wire("kv-exhaustion")
__all__ = ["KvExhaustionUser", "SteppedShape"]


class KvExhaustionUser(OpenAIStreamUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = glue.user_rng(self.environment)

    @task
    def request(self) -> None:
        model = glue.model_of(self.environment)
        bodies = glue.dataset_of(self.environment)
        if bodies:
            self.stream(dataset_body(self.rng.choice(bodies), model))
            return
        config = glue.config_of(self.environment)
        assert isinstance(config, KvExhaustionConfig)
        self.stream(generated_body(config.workload, model, self.rng))
