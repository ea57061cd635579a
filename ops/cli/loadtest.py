"""``kvops loadtest SCENARIO --url URL``: run a Locust scenario headless and print its verdicts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from kvops.ops.errors import EXIT_OK

SCENARIO_NAMES = "kv-exhaustion, prefix-miss, ttft-regression"


def register(app: typer.Typer) -> None:
    app.command("loadtest", help=f"Run a load-test scenario ({SCENARIO_NAMES}) and diagnose.")(loadtest)


def loadtest(
    scenario: Annotated[str, typer.Argument(help=SCENARIO_NAMES)],
    url: Annotated[str, typer.Option(help="Server base URL, e.g. http://127.0.0.1:8000.")],
    duration: Annotated[float | None, typer.Option(help="Run length in seconds.")] = None,
    users: Annotated[int | None, typer.Option(help="Users (kv-exhaustion: the last step).")] = None,
    rate: Annotated[float | None, typer.Option(help="Arrival rate, req/s (ttft-regression).")] = None,
    dataset: Annotated[Path | None, typer.Option(help="JSONL of request bodies to replay.")] = None,
    baseline: Annotated[Path | None, typer.Option(help="ttft-regression result JSON to compare.")] = None,
    scenario_file: Annotated[Path | None, typer.Option(help="Scenario YAML replacing the default.")] = None,
    workers: Annotated[int, typer.Option(help="Run distributed: a master and this many workers.")] = 0,
    expect: Annotated[Path | None, typer.Option(
        help="kv-exhaustion: JSON of `kvops plan --json` or `kvops kv-capacity --json` for this server.")] = None,
    out: Annotated[Path | None, typer.Option(help="Report folder.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON summary only.")] = False,
) -> None:
    """Exit code 3 when ttft-regression finds a significant regression against --baseline."""
    from kvops.loadtest.runner import LoadtestRequest, run
    from kvops.loadtest.scenarios.config import check_scenario

    check_scenario(scenario)
    out_dir = out or Path("kvops-loadtest") / f"{scenario}-{int(time.time())}"
    result = run(LoadtestRequest(
        scenario=scenario, url=url, out_dir=out_dir, duration_s=duration, users=users, rate=rate,
        dataset=dataset, baseline=baseline, scenario_file=scenario_file, workers=workers,
        expect=expect))
    summary = {"scenario": result["scenario"], "verdicts": result["verdicts"],
               "report_json": result["files"]["json"], "report_html": result["files"]["html"],
               "report_png": result["files"]["png"], "exit_code": result["exit_code"]}
    typer.echo(json.dumps(summary, indent=None if json_out else 2))
    if result["exit_code"] != EXIT_OK:
        raise typer.Exit(result["exit_code"])
