"""Per-run state of a scenario, hung off Locust's Environment (one per Locust process): its
config with the command-line overrides, the served model, the dataset, the arrival schedule."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from gevent.lock import Semaphore
from locust.env import Environment
from locust.runners import WorkerRunner

from kvops.loadtest.analysis.tokens import served_model
from kvops.loadtest.config import ScenarioConfig, TtftRegressionConfig, load_config
from kvops.loadtest.hooks.endpoint import endpoint_of
from kvops.loadtest.hooks.store import store_of
from kvops.loadtest.scenarios.workloads import load_dataset
from kvops.loadtest.shapes.poisson import ArrivalSchedule


def _options(environment: Environment) -> Any:
    return environment.parsed_options


def config_of(environment: Environment) -> ScenarioConfig:
    """The scenario config with overrides, built on first use (workers get options at spawn)."""
    config = getattr(environment, "kvops_config", None)
    if config is None:
        opts = _options(environment)
        config = load_config(
            store_of(environment).scenario, Path(opts.kvops_config) if opts.kvops_config else None,
            users=opts.kvops_users or None, rate=opts.kvops_rate or None,
            duration_s=opts.kvops_duration or None,
            speedup=getattr(opts, "kvops_speedup", 0.0) or None,
            length_scale=getattr(opts, "kvops_length_scale", 0.0) or None)
        environment.kvops_config = config  # type: ignore[attr-defined]
    return config


_CACHED = ("kvops_config", "kvops_model", "kvops_dataset", "kvops_schedule", "kvops_endpoint",
           "kvops_users_started", "kvops_replay", "kvops_trace_schedule", "kvops_overdue_noted")
__all__ = ["endpoint_of"]  # re-exported: scenarios reach the endpoint through their context


def reset(environment: Environment) -> None:
    """Forget the last run: its options may have changed in the web UI, its records are done."""
    for name in _CACHED:
        if hasattr(environment, name):
            delattr(environment, name)
    store_of(environment).clear()


def processes_of(environment: Environment) -> int:
    """Load-generating processes: the master sets its worker count on the options it sends."""
    return max(1, int(getattr(_options(environment), "kvops_processes", 1) or 1))


_MODEL_LOOKUP = Semaphore()


def model_of(environment: Environment) -> str:
    """The served model name, looked up once per process: the first user asks /v1/models, the
    others wait for its answer (32 users asking at once made a busy server answer the last ones
    seconds later, and their first arrivals went out that late)."""
    model = getattr(environment, "kvops_model", None)
    if model is None:
        with _MODEL_LOOKUP:
            model = getattr(environment, "kvops_model", None)
            if model is None:
                model = served_model(str(environment.host), headers=endpoint_of(environment).header_dict(),
                                     wanted=_options(environment).kvops_model or None)
                environment.kvops_model = model  # type: ignore[attr-defined]
    return str(model)


def dataset_of(environment: Environment) -> list[dict[str, Any]] | None:
    opts = _options(environment)
    if not opts.kvops_dataset:
        return None
    bodies = getattr(environment, "kvops_dataset", None)
    if bodies is None:
        bodies = load_dataset(Path(opts.kvops_dataset))
        environment.kvops_dataset = bodies  # type: ignore[attr-defined]
    return list(bodies)


def schedule_of(environment: Environment) -> ArrivalSchedule:
    """This process's share of the arrival process (rate / processes, its own seed)."""
    schedule = getattr(environment, "kvops_schedule", None)
    if schedule is None:
        config = config_of(environment)
        assert isinstance(config, TtftRegressionConfig)
        runner = environment.runner
        index = runner.worker_index if isinstance(runner, WorkerRunner) else 0
        processes = processes_of(environment)
        schedule = ArrivalSchedule(config.rate_rps / processes, config.workload.seed * 1000 + index)
        environment.kvops_schedule = schedule  # type: ignore[attr-defined]
    return schedule


def note_overdue(environment: Environment) -> None:
    """At the stop, before the users are killed: the arrivals this process's schedule owed and
    never sent, into its store (nothing for a scenario without a schedule, or the master)."""
    schedule = getattr(environment, "kvops_schedule", None)
    if schedule is not None and not getattr(environment, "kvops_overdue_noted", False):
        store_of(environment).note_overdue(*schedule.overdue(time.time()))
        environment.kvops_overdue_noted = True  # type: ignore[attr-defined]


def user_rng(environment: Environment) -> random.Random:
    counter = getattr(environment, "kvops_users_started", 0) + 1
    environment.kvops_users_started = counter  # type: ignore[attr-defined]
    return random.Random(f"{store_of(environment).worker}-{counter}-{time.time()}")


def pool_of(environment: Environment) -> tuple[int, float]:
    """A pool scenario's users and run length (prefix-miss, ttft-regression)."""
    config = config_of(environment)
    return int(getattr(config, "users")), float(getattr(config, "duration_s"))  # noqa: B009
