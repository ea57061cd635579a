"""The in-process harness behind the bench's direct cost figure, on vLLM's real Scheduler.

Oracle: vLLM's own scheduler. Where the KV budget does not bind, KVBudgetScheduler must make
exactly vLLM's decisions (the bench's cost is then only CPU time); where it binds, the harness
must see a different schedule (otherwise "identical" would prove nothing).
"""

from __future__ import annotations

import pytest

from kvops.ops.bench.admission_cost import (
    StepShape,
    front_door_cost,
    front_door_request_cost,
    scheduler_step_cost,
)
from kvops.ops.models.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec())


def test_inside_the_budget_the_schedule_is_vllms_own(model):
    # 3 sequences x (241 + 100 tokens) = 9 of 16 blocks: admission never holds anything back.
    cost = scheduler_step_cost(model, StepShape(3, 241, 100, 17, 128, 1024, 250), repeats=1)
    assert cost["identical_schedule"]
    assert cost["scheduled_tokens"] > 0
    assert cost["stock_us_per_step"] > 0
    assert cost["kvops_us_per_step"] > 0


def test_over_the_budget_the_harness_sees_a_different_schedule(model):
    # 12 sequences that may each grow to 841 tokens (7 blocks): only 2 fit at once in 16 blocks.
    cost = scheduler_step_cost(model, StepShape(12, 241, 600, 17, 128, 1024, 60), repeats=1)
    assert not cost["identical_schedule"]


def test_front_door_costs_are_reported_per_call():
    cost = front_door_cost(8, repeats=100)
    assert cost["running"] == 8
    assert cost["on_step_us"] > 0
    assert cost["queue_walk_us"] > 0


def test_front_door_cost_per_request_is_reported_for_tracked_and_walked_states():
    tracked = front_door_request_cost(50, requests=200)
    walked = front_door_request_cost(50, requests=20, tracked=False)
    assert tracked["in_flight"] == walked["in_flight"] == 50
    assert tracked["us_per_request"] > 0
    assert walked["us_per_request"] > 0
