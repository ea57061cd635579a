"""Locustfile for test_batching_trap: our user and Locust's own iter_lines, side by side."""

from __future__ import annotations

import json
import os
import time

from locust import constant, events, task

from kvops.loadtest.hooks.store import store_of
from kvops.loadtest.users.openai import OpenAIStreamUser

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 12}
OUT = os.environ["KVOPS_TEST_OUT"]
naive: list[float] = []


class OurUser(OpenAIStreamUser):
    wait_time = constant(0.2)

    @task
    def go(self) -> None:
        self.stream(BODY)


class NaiveUser(OpenAIStreamUser):
    """Locust's documented streaming helper: iter_lines (iter_content(1024) underneath)."""

    wait_time = constant(0.2)

    @task
    def go(self) -> None:
        start = time.perf_counter()
        for line in self.client.iter_lines("/v1/completions", method="POST",
                                           json={**BODY, "stream": True}):
            if line.startswith("data: {"):
                naive.append(time.perf_counter() - start)
                break


@events.quitting.add_listener
def _dump(environment, **_):
    with open(OUT, "w") as handle:
        json.dump({"ours": [r.to_dict() for r in store_of(environment).records],
                   "naive": naive}, handle)
