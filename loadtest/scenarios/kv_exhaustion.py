"""kv-exhaustion locustfile: ``locust -f kv_exhaustion.py --headless --host URL``.

Stepped users, each sending long EOS-ignoring completions back to back (or replaying
--kvops-dataset); the verdict classifies each step and compares the knee with the KV cache's
predicted concurrency. Without `steps` in the scenario (the default) the ramp is sized from the
server on the shape's first tick (loadtest/analysis/ramp.py).
"""

from __future__ import annotations

import random
from typing import Any

from locust import constant, task
from locust.env import Environment

from kvops.core.errors import KvopsError
from kvops.core.prom import MetricsSample, scrape
from kvops.core.stats import mean
from kvops.loadtest.analysis import ramp
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.config import KvExhaustionConfig
from kvops.loadtest.scenarios import context, glue
from kvops.loadtest.scenarios.workloads import dataset_body, generated_body
from kvops.loadtest.shapes import stepped
from kvops.loadtest.users.openai import OpenAIStreamUser

glue.wire("kv-exhaustion")
__all__ = ["KvExhaustionShape", "KvExhaustionUser"]
TOKENS_PER_WORD = 1.3
"""Estimate for when the server will not tokenize for us."""
SAMPLE_BODIES = 16


class KvExhaustionShape(stepped.SteppedShape):
    def steps(self) -> tuple[list[int], float]:
        assert self.runner is not None
        config = sized_config(self.runner.environment)
        return list(config.steps or []), config.step_s


def sized_config(environment: Environment) -> KvExhaustionConfig:
    """The config with its steps; sized from the server once per run if the scenario gave none
    (the sized config replaces the cached one, so the analysis reads the same steps)."""
    config = context.config_of(environment)
    assert isinstance(config, KvExhaustionConfig)
    if config.steps is not None:
        return config
    host, headers = str(environment.host), context.endpoint_of(environment).header_dict()
    sampler = getattr(environment, "kvops_scraper", None)  # the fleet's, with --kvops-prometheus
    try:
        sample = sampler.read() if sampler is not None else scrape(host, headers=headers)
    except KvopsError:
        sample = MetricsSample(t=0.0)  # no capacity known: the fixed ramp, and the verdict says so
    sized = ramp.size(config, ramp.capacity_of(sample, _tokens_per_request(environment, config)))
    config = config.model_copy(update={"steps": sized.steps, "step_s": sized.step_s})
    environment.kvops_config = config  # type: ignore[attr-defined]
    environment.kvops_ramp = sized.to_dict()  # type: ignore[attr-defined]
    return config


def _tokens_per_request(environment: Environment, config: KvExhaustionConfig) -> float:
    """Prompt tokens as the server counts them (chat template included) plus the output asked
    for, averaged over a sample of the dataset or one generated body."""
    model = context.model_of(environment)
    bodies: list[dict[str, Any]] = (context.dataset_of(environment) or [])[:SAMPLE_BODIES] or [
        generated_body(config.workload, model, random.Random(0))]
    tokenizer = ServerTokenizer(str(environment.host), model,
                                headers=context.endpoint_of(environment).header_dict())
    totals = []
    for body in bodies:
        prompt = body.get("messages", body.get("prompt"))
        try:
            prompt_tokens = float(len(tokenizer.tokens(prompt)))
        except KvopsError:
            prompt_tokens = TOKENS_PER_WORD * len(str(prompt).split())
        out = body.get("max_tokens") or body.get("max_completion_tokens") or config.workload.max_tokens
        totals.append(prompt_tokens + float(out))
    return mean(totals) or 0.0


class KvExhaustionUser(OpenAIStreamUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = context.user_rng(self.environment)

    @task
    def request(self) -> None:
        model = context.model_of(self.environment)
        bodies = context.dataset_of(self.environment)
        if bodies:
            self.stream(dataset_body(self.rng.choice(bodies), model))
            return
        config = context.config_of(self.environment)
        assert isinstance(config, KvExhaustionConfig)
        self.stream(generated_body(config.workload, model, self.rng))
