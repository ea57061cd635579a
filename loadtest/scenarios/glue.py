"""What every scenario locustfile shares: its command-line options, its config, the scraper,
record merging, and finalization in the process that owns the run.

``wire(name)`` registers listeners on Locust's global event hooks; a locustfile calls it once
at import. All per-run state hangs off the Environment (one per Locust process).
"""

from __future__ import annotations

import time
from typing import Any

import gevent
from locust import events
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from kvops.core.endpoint import API_KEY_ENV
from kvops.core.promql import DEFAULT_SELECTOR
from kvops.loadtest.hooks.progress import ProgressPrinter
from kvops.loadtest.hooks.scraper import MetricsScraper, PrometheusSampler
from kvops.loadtest.hooks.store import install_merging, store_of
from kvops.loadtest.scenarios import context
from kvops.loadtest.scenarios.finish import finish

# (flag, default, help): each on Locust's web UI, and settable as KVOPS_<NAME> (env_var below)
_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("--kvops-config", "", "scenario YAML (default: the packaged one)"),
    ("--kvops-users", 0, "users (kv-exhaustion: the last step; 0: the scenario's)"),
    ("--kvops-rate", 0.0, "arrival rate, req/s, over all processes (ttft-regression)"),
    ("--kvops-duration", 0.0, "run length, s (0: the scenario's)"),
    ("--kvops-dataset", "", "JSONL of request bodies to replay"),
    ("--kvops-baseline", "", "ttft-regression result JSON to compare with"),
    ("--kvops-expect", "", "kv-exhaustion: `kvops plan --json` / `kvops kv-capacity --json` output"),
    ("--kvops-out", "", "report folder (default kvops-loadtest/SCENARIO-TIME)"),
    ("--kvops-model", "", "served model name (default: the first of /v1/models)"),
    ("--kvops-progress", 5.0, "seconds between progress lines on stderr (0: none)"),
    ("--kvops-prometheus", "", "read the metrics from this Prometheus, per replica (behind a load balancer)"),
    ("--kvops-selector", DEFAULT_SELECTOR, "with --kvops-prometheus: the replicas' label matchers"),
)


def env_var(flag: str) -> str:
    return flag.lstrip("-").upper().replace("-", "_")


def add_arguments(parser: Any) -> None:
    """On the parser itself, not a group: Locust's web UI shows only the parser's own arguments."""
    for flag, default, text in _OPTIONS:
        parser.add_argument(flag, type=type(default), default=default, help=text,
                            env_var=env_var(flag), include_in_web_ui=True)
    parser.add_argument("--kvops-api-key", default="", env_var="KVOPS_API_KEY", is_secret=True,
                        include_in_web_ui=True,
                        help=f"the server's API key (default: ${API_KEY_ENV}, which keeps it out of "
                             "the web UI's page; a value here is in the page, masked)")
    parser.add_argument("--kvops-header", action="append", default=None, env_var="KVOPS_HEADERS",
                        include_in_web_ui=True,
                        help="'Name: value' sent with every request; repeat it, or one per line")


def wire(scenario: str) -> None:
    """Register this scenario's listeners on Locust's event hooks."""
    events.init_command_line_parser.add_listener(add_arguments)  # type: ignore[no-untyped-call]

    @events.init.add_listener  # type: ignore[untyped-decorator]
    def _init(environment: Environment, **_: Any) -> None:
        store_of(environment).scenario = scenario
        install_merging(environment)

    @events.test_start.add_listener  # type: ignore[untyped-decorator]
    def _start(environment: Environment, **_: Any) -> None:
        # every run starts fresh, also the second one started from the web UI
        runner, opts = environment.runner, _opts(environment)
        if isinstance(runner, MasterRunner):
            # sent to the workers with this run's spawn messages (locust/runners.py MasterRunner
            # .start: "parsed_options"), so each takes its share of the arrival rate
            opts.kvops_processes = max(1, runner.worker_count)
        if not isinstance(runner, WorkerRunner) and hasattr(environment, "kvops_scraper"):
            _finish_once(environment)  # a web-UI run restarted before its delayed finish
        context.reset(environment)
        if isinstance(runner, WorkerRunner):
            return
        interval = float(getattr(context.config_of(environment), "scrape_interval_s", 1.0))
        scraper = _sampler(environment, interval)
        scraper.sample_now()
        environment.kvops_started_at = time.time()  # type: ignore[attr-defined]
        scraper.start()
        environment.kvops_scraper = scraper  # type: ignore[attr-defined]
        progress = ProgressPrinter(store_of(environment).records, scraper.samples,
                                   lambda: runner.user_count if runner else 0,
                                   float(opts.kvops_progress))
        progress.start()
        environment.kvops_progress = progress  # type: ignore[attr-defined]

    @events.test_stopping.add_listener  # type: ignore[untyped-decorator]
    def _stopping(environment: Environment, **_: Any) -> None:
        # in the processes with users (local, a worker), before they are killed; the master has
        # no schedule: its workers send theirs with their last records (hooks/store.py)
        context.note_overdue(environment)

    @events.test_stop.add_listener  # type: ignore[untyped-decorator]
    def _stop(environment: Environment, **_: Any) -> None:
        # headless runs finish on quitting; a web-UI run stops without quitting, so it finishes
        # here. Either way a master has its workers' last records by now: it drained them in
        # test_stopping, before Locust stopped them (hooks/store.py drain)
        if isinstance(environment.runner, WorkerRunner) or _opts(environment).headless:
            return
        gevent.spawn_later(0.0, _finish_once, environment, getattr(environment, "kvops_scraper", None))

    @events.quitting.add_listener  # type: ignore[untyped-decorator]
    def _quit(environment: Environment, **_: Any) -> None:
        if not isinstance(environment.runner, WorkerRunner):
            _finish_once(environment)


def _opts(environment: Environment) -> Any:
    return environment.parsed_options


def _sampler(environment: Environment, interval_s: float) -> MetricsScraper:
    """The host's own /metrics, or every replica's series from --kvops-prometheus."""
    opts = _opts(environment)
    prometheus = getattr(opts, "kvops_prometheus", "")
    if prometheus:
        return PrometheusSampler(prometheus, getattr(opts, "kvops_selector", DEFAULT_SELECTOR), interval_s)
    return MetricsScraper(str(environment.host), interval_s=interval_s,
                          headers=context.endpoint_of(environment).header_dict())


def _finish_once(environment: Environment, run: MetricsScraper | None = None) -> None:
    """Finish the current run once; ``run`` (its scraper) keeps a late call off the next run."""
    current = getattr(environment, "kvops_scraper", None)
    if current is None or (run is not None and run is not current):
        return
    environment.kvops_progress.stop()  # type: ignore[attr-defined]
    try:
        finish(environment)
    finally:
        del environment.kvops_scraper  # type: ignore[attr-defined]
