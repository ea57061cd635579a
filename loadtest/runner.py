"""Run a scenario headless as real Locust processes (one, or a master and N workers) and read
back the result it wrote. Used by ``kvops loadtest`` and the bench; imports no Locust itself,
since Locust monkey-patches the process with gevent at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.loadtest.analysis.kv import load_expectation
from kvops.loadtest.analysis.tokens import served_model
from kvops.loadtest.finalize import load_baseline
from kvops.loadtest.scenarios.config import HERE, SCENARIOS, KvExhaustionConfig, load_config
from kvops.loadtest.scenarios.workloads import load_dataset
from kvops.ops.errors import BadInputError, KvopsError
from kvops.ops.launch import free_port, log_tail


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


def locustfile(scenario: str) -> Path:
    return Path(HERE / f"{SCENARIOS[scenario]}.py")


def validate(req: LoadtestRequest) -> float:
    """Fail fast on bad input before any process starts; returns the planned run length (s)."""
    config = load_config(req.scenario, req.scenario_file, users=req.users, rate=req.rate,
                         duration_s=req.duration_s)
    if req.dataset is not None:
        load_dataset(req.dataset)
    if req.baseline is not None:
        load_baseline(req.baseline)
    if req.expect is not None:
        if req.scenario != "kv-exhaustion":
            raise BadInputError(f"--expect applies to kv-exhaustion only, not {req.scenario}")
        load_expectation(req.expect)
    if isinstance(config, KvExhaustionConfig):
        return float(len(config.steps) * config.step_s)
    return float(config.duration_s)


def _kvops_args(req: LoadtestRequest) -> list[str]:
    args = ["--kvops-out", str(req.out_dir), "--kvops-processes", str(max(1, req.workers))]
    for flag, value in (("--kvops-config", req.scenario_file), ("--kvops-users", req.users),
                        ("--kvops-rate", req.rate), ("--kvops-duration", req.duration_s),
                        ("--kvops-dataset", req.dataset), ("--kvops-baseline", req.baseline),
                        ("--kvops-expect", req.expect)):
        if value is not None:
            args += [flag, str(value)]
    return args


def run(req: LoadtestRequest) -> dict[str, Any]:
    """Run the scenario, wait for it, and return its result JSON (exit_code inside)."""
    planned_s = validate(req)
    served_model(req.url)  # an unreachable server fails here, in one line, not in Locust's log
    req.out_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "locust", "-f", str(locustfile(req.scenario))]
    common = ["--headless", "--only-summary", "--host", req.url.rstrip("/"), "--stop-timeout", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
        try:
            main.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise KvopsError(f"locust did not finish within {timeout:.0f}s (log {log}):\n"
                             f"{log_tail(log)}") from exc
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
