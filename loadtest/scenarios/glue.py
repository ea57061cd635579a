"""What every scenario locustfile shares: its command-line options, its config, the scraper,
record merging, and finalization in the process that owns the run.

``wire(name)`` registers listeners on Locust's global event hooks; a locustfile calls it once
at import. All per-run state hangs off the Environment (one per Locust process).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner

from kvops.loadtest.analysis.tokens import served_model
from kvops.loadtest.hooks.scraper import MetricsScraper
from kvops.loadtest.hooks.store import install_merging, store_of
from kvops.loadtest.scenarios.config import ScenarioConfig, TtftRegressionConfig, load_config
from kvops.loadtest.scenarios.workloads import load_dataset
from kvops.loadtest.shapes.poisson import ArrivalSchedule


def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("kvops")
    group.add_argument("--kvops-config", default="", help="scenario YAML (default: the packaged one)")
    group.add_argument("--kvops-users", type=int, default=0, help="users (kv-exhaustion: last step)")
    group.add_argument("--kvops-rate", type=float, default=0.0, help="arrival rate, req/s (all processes)")
    group.add_argument("--kvops-duration", type=float, default=0.0, help="run length, s")
    group.add_argument("--kvops-dataset", default="", help="JSONL of request bodies to replay")
    group.add_argument("--kvops-baseline", default="", help="ttft-regression result to compare with")
    group.add_argument("--kvops-expect", default="", help="kv-exhaustion: plan/kv-capacity JSON")
    group.add_argument("--kvops-out", default="", help="report folder")
    group.add_argument("--kvops-processes", type=int, default=1, help="load-generating processes")


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
            duration_s=opts.kvops_duration or None)
        environment.kvops_config = config  # type: ignore[attr-defined]
    return config


def model_of(environment: Environment) -> str:
    model = getattr(environment, "kvops_model", None)
    if model is None:
        model = served_model(str(environment.host))
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
        processes = max(1, int(_options(environment).kvops_processes))
        schedule = ArrivalSchedule(config.rate_rps / processes, config.workload.seed * 1000 + index)
        environment.kvops_schedule = schedule  # type: ignore[attr-defined]
    return schedule


def user_rng(environment: Environment) -> random.Random:
    counter = getattr(environment, "kvops_users_started", 0) + 1
    environment.kvops_users_started = counter  # type: ignore[attr-defined]
    return random.Random(f"{store_of(environment).worker}-{counter}-{time.time()}")


def wire(scenario: str) -> None:
    """Register this scenario's listeners on Locust's event hooks."""
    events.init_command_line_parser.add_listener(add_arguments)  # type: ignore[no-untyped-call]

    @events.init.add_listener  # type: ignore[untyped-decorator]
    def _init(environment: Environment, **_: Any) -> None:
        store_of(environment).scenario = scenario
        install_merging(environment)

    @events.test_start.add_listener  # type: ignore[untyped-decorator]
    def _start(environment: Environment, **_: Any) -> None:
        if isinstance(environment.runner, WorkerRunner) or hasattr(environment, "kvops_scraper"):
            return
        interval = float(getattr(config_of(environment), "scrape_interval_s", 1.0))
        scraper = MetricsScraper(str(environment.host), interval_s=interval)
        scraper.sample_now()
        environment.kvops_started_at = time.time()  # type: ignore[attr-defined]
        scraper.start()
        environment.kvops_scraper = scraper  # type: ignore[attr-defined]

    @events.quitting.add_listener  # type: ignore[untyped-decorator]
    def _quit(environment: Environment, **_: Any) -> None:
        if isinstance(environment.runner, WorkerRunner) or not hasattr(environment, "kvops_scraper"):
            return
        from kvops.loadtest.scenarios.finish import finish

        finish(environment)
