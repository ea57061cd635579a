"""Run a scenario headless as real Locust processes (one, or a master and N workers) and read
back the result it wrote. Used by ``kvops loadtest`` and the bench; imports no Locust itself,
since Locust monkey-patches the process with gevent at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.endpoint import endpoint
from kvops.core.errors import BadInputError, KvopsError
from kvops.core.http import deadline
from kvops.core.proc import free_port, log_tail
from kvops.core.promql import DEFAULT_SELECTOR, Prometheus, answers_from_many, check_selector
from kvops.loadtest.analysis.kv import load_expectation
from kvops.loadtest.analysis.replay import planned_seconds
from kvops.loadtest.analysis.tokens import served_model
from kvops.loadtest.baseline import load_baseline
from kvops.loadtest.config import (
    HERE,
    SCENARIOS,
    KvExhaustionConfig,
    TraceReplayConfig,
    load_config,
)
from kvops.loadtest.hooks.progress import PREFIX as PROGRESS_PREFIX
from kvops.loadtest.scenarios.workloads import load_dataset


@dataclass(frozen=True)
class LoadtestRequest:
    scenario: str
    url: str
    out_dir: Path
    duration_s: float | None = None
    users: int | None = None
    rate: float | None = None
    dataset: Path | None = None
    baseline: Path | None = None
    scenario_file: Path | None = None
    workers: int = 0
    expect: Path | None = None
    """kv-exhaustion: `kvops plan --json` / `kvops kv-capacity --json` to set the knee beside."""
    trace: Path | None = None
    """trace-replay: the Mooncake JSONL or BurstGPT CSV to replay."""
    speedup: float | None = None
    length_scale: float | None = None
    api_key: str | None = None
    headers: tuple[str, ...] = ()
    """'Name: value' lines for every request (a proxy's, a tenant's)."""
    model: str | None = None
    """The served model name; None: the first of /v1/models."""
    progress_s: float = 5.0
    prometheus: str | None = None
    """Read the metrics per replica from this Prometheus (required behind a load balancer)."""
    selector: str = DEFAULT_SELECTOR
    timeout_s: float = 30.0
    """The preflight (/v1/models, /metrics) ends within this, however slowly the server answers."""

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"LoadtestRequest({self.scenario!r}, {self.url!r}, out_dir={str(self.out_dir)!r})"


def locustfile(scenario: str) -> Path:
    return Path(HERE / f"{SCENARIOS[scenario]}.py")


def validate(req: LoadtestRequest) -> float:
    """Fail fast on bad input before any process starts; returns the planned run length (s)."""
    config = load_config(req.scenario, req.scenario_file, users=req.users, rate=req.rate,
                         duration_s=req.duration_s, speedup=req.speedup, length_scale=req.length_scale)
    if req.trace is not None and not isinstance(config, TraceReplayConfig):
        raise BadInputError(f"--trace applies to trace-replay only, not {req.scenario}")
    if isinstance(config, TraceReplayConfig):
        return planned_seconds(config, req.trace)
    if req.dataset is not None:
        load_dataset(req.dataset)
    if req.baseline is not None:
        load_baseline(req.baseline)
    if req.expect is not None:
        if req.scenario != "kv-exhaustion":
            raise BadInputError(f"--expect applies to kv-exhaustion only, not {req.scenario}")
        load_expectation(req.expect)
    if isinstance(config, KvExhaustionConfig):
        return float(len(config.steps) * config.step_s) if config.steps else config.max_duration_s
    return float(config.duration_s)


def _kvops_args(req: LoadtestRequest) -> list[str]:
    args = ["--kvops-out", str(req.out_dir), "--kvops-progress", str(req.progress_s)]
    for flag, value in (("--kvops-config", req.scenario_file), ("--kvops-users", req.users),
                        ("--kvops-rate", req.rate), ("--kvops-duration", req.duration_s),
                        ("--kvops-dataset", req.dataset), ("--kvops-baseline", req.baseline),
                        ("--kvops-expect", req.expect), ("--kvops-trace", req.trace),
                        ("--kvops-speedup", req.speedup), ("--kvops-length-scale", req.length_scale), ("--kvops-model", req.model)):
        if value is not None:
            args += [flag, str(value)]
    if req.prometheus:
        args += ["--kvops-prometheus", req.prometheus, "--kvops-selector", req.selector]
    return args


def check_metrics_source(req: LoadtestRequest, url: str, headers: dict[str, str]) -> None:
    """The server-side evidence must come from one process per series: a load balancer's
    /metrics mixes replicas between reads, so behind one the metrics come from Prometheus."""
    if req.prometheus is None:
        if answers_from_many(url, headers):
            raise BadInputError(
                f"--url {url} answers from more than one server process (a load balancer): pass "
                "--prometheus URL to read each replica's metrics, or one replica's own URL")
        return
    selector = check_selector(req.selector)
    if not Prometheus(req.prometheus).by_instance(f"up{selector}"):
        raise BadInputError(f"--prometheus {req.prometheus} scrapes no target matching {selector}: "
                            "check --selector (the job name of your vLLM scrape config)")


def _env(req: LoadtestRequest) -> dict[str, str]:
    """Secrets travel in the environment, not on a command line `ps` shows."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("KVOPS_API_KEY", "KVOPS_HEADERS"):
        env.pop(name, None)
    if req.api_key:
        env["KVOPS_API_KEY"] = req.api_key
    if req.headers:
        env["KVOPS_HEADERS"] = "\n".join(req.headers)
    return env


def run(req: LoadtestRequest, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the scenario, wait for it, and return its result JSON (exit_code inside).

    ``on_progress`` gets each progress line the owning Locust process prints while it runs.
    """
    planned_s = validate(req)
    server = endpoint(req.url, api_key=req.api_key, headers=req.headers)
    # an unreachable server, a missing key or an unknown model fails here, in one line
    with deadline(req.timeout_s):
        served_model(server.url, headers=server.header_dict(), wanted=req.model)
        check_metrics_source(req, server.url, server.header_dict())
    req.out_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "locust", "-f", str(locustfile(req.scenario))]
    common = ["--headless", "--only-summary", "--host", server.url, "--stop-timeout", "0"]
    env = _env(req)
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    if req.workers:
        port = free_port()
        master = base + common + ["--master", "--expect-workers", str(req.workers),
                                  "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                                  *_kvops_args(req)]
        procs.append(_spawn(master, req.out_dir / "locust-master.log", env))
        for i in range(req.workers):
            worker = base + ["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)]
            procs.append(_spawn(worker, req.out_dir / f"locust-worker-{i}.log", env))
    else:
        procs.append(_spawn(base + common + _kvops_args(req), req.out_dir / "locust.log", env))
    timeout = planned_s + 180.0
    try:
        main, log = procs[0]
        if not _wait_relaying(main, log, timeout, on_progress or (lambda _line: None)):
            raise KvopsError(f"locust did not finish within {timeout:.0f}s (log {log}):\n"
                             f"{log_tail(log)}")
        for proc, _ in procs[1:]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result_path = req.out_dir / "result.json"
    if not result_path.exists():
        raise KvopsError(f"the {req.scenario} run wrote no result (exit {procs[0][0].returncode}, "
                         f"log {procs[0][1]}):\n{log_tail(procs[0][1])}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    with open(log, "ab") as handle:
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)  # noqa: S603
    return proc, log


def _wait_relaying(proc: subprocess.Popen[bytes], log: Path, timeout_s: float,
                   on_progress: Callable[[str], None]) -> bool:
    """Wait for ``proc``, passing on the progress lines it writes to ``log``; False on timeout."""
    deadline, offset, pending = time.monotonic() + timeout_s, 0, b""
    while True:
        done = proc.poll() is not None
        with open(log, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
        offset += len(chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith(PROGRESS_PREFIX):
                on_progress(text.removeprefix("kvops: "))
        if done:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
