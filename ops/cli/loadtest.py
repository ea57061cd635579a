"""``kvops loadtest SCENARIO --url URL``: run a Locust scenario headless and print its verdicts;
``kvops loadtest locustfile SCENARIO``: the path to give plain ``locust -f``.

One subcommand per scenario, so the scenario is a closed choice the shell completes and
``kvops loadtest --help`` lists.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import EXIT_OK
from kvops.loadtest.config import SCENARIOS
from kvops.ops.cli.options import JsonOut, ServerUrl

Scenario = StrEnum("Scenario", {name: name for name in SCENARIOS})  # type: ignore[misc]

HELP = {
    "kv-exhaustion": "Step users up until the KV cache runs out; the knee beside the plan.",
    "prefix-miss": "Shared system prompts: is the prefix cache hit as often as it could be?",
    "ttft-regression": "Poisson arrivals at a rate; TTFT against a --baseline result.",
    "trace-replay": "Replay a production trace (--trace): measured prefix hit ratio vs the trace's.",
}


def register(app: typer.Typer) -> None:
    group = typer.Typer(no_args_is_help=True, help="Load-test a server with a scenario and diagnose it.")
    for name in SCENARIOS:
        group.command(name, help=HELP.get(name, f"Run the {name} scenario."))(_run_command(name))
    group.command("locustfile", help="Print the path of a scenario's locustfile (for `locust -f`).")(
        locustfile)
    app.add_typer(group, name="loadtest")


def locustfile(scenario: Annotated[Scenario, typer.Argument(help="The scenario.")]) -> None:
    """`locust -f $(kvops loadtest locustfile kv-exhaustion) --host URL` runs it as Locust does."""
    from kvops.loadtest.runner import locustfile as path_of

    typer.echo(str(path_of(scenario.value)))


def _run_command(scenario: str) -> Callable[..., None]:
    def command(
        url: ServerUrl,
        api_key: Annotated[str | None, typer.Option(
            envvar="OPENAI_API_KEY", show_envvar=True,
            help="The server's key (vllm serve --api-key), sent as 'Authorization: Bearer KEY'.")] = None,
        header: Annotated[list[str] | None, typer.Option(
            help="'Name: value' for every request, /metrics and /tokenize too (repeat it).")] = None,
        model: Annotated[str | None, typer.Option(
            help="Served model name (--served-model-name); default the first of /v1/models.")] = None,
        duration: Annotated[float | None, typer.Option(help="Run length in seconds.")] = None,
        users: Annotated[int | None, typer.Option(help="Users (kv-exhaustion: the last step).")] = None,
        rate: Annotated[float | None, typer.Option(help="Arrival rate, req/s (ttft-regression).")] = None,
        dataset: Annotated[Path | None, typer.Option(help="JSONL of request bodies to replay.")] = None,
        baseline: Annotated[Path | None, typer.Option(help="ttft-regression result JSON to compare.")] = None,
        scenario_file: Annotated[Path | None, typer.Option(help="Scenario YAML replacing the default.")] = None,
        workers: Annotated[int, typer.Option(help="Run distributed: a master and this many workers.")] = 0,
        expect: Annotated[Path | None, typer.Option(
            help="kv-exhaustion: JSON of `kvops plan --json` or `kvops kv-capacity --json` for this server.")] = None,
        trace: Annotated[Path | None, typer.Option(
            help="trace-replay: Mooncake JSONL or BurstGPT CSV to replay.")] = None,
        speedup: Annotated[float | None, typer.Option(help="trace-replay: arrival times ÷ this.")] = None,
        length_scale: Annotated[float | None, typer.Option(
            help="trace-replay: prompt/output lengths and the trace block × this.")] = None,
        out: Annotated[Path | None, typer.Option(help="Report folder.")] = None,
        progress: Annotated[float, typer.Option(
            help="Seconds between progress lines on stderr; 0 for none.")] = 5.0,
        timeout: Annotated[float, typer.Option(
            help="Seconds the preflight (/v1/models, /metrics) may take, however slowly the server "
            "answers.")] = 30.0,
        prometheus: Annotated[str | None, typer.Option(
            help="Behind a load balancer: read each replica's metrics from this Prometheus.")] = None,
        selector: Annotated[str, typer.Option(
            help="With --prometheus: the replicas' label matchers.")] = '{job="vllm"}',
        json_out: JsonOut = False,
    ) -> None:
        """Exit code 3 when a verdict names a problem (a knee, a miss, a regression)."""
        from kvops.loadtest.runner import LoadtestRequest, run
        from kvops.loadtest.summary import render, summary

        out_dir = out or Path("kvops-loadtest") / f"{scenario}-{int(time.time())}"
        result = run(LoadtestRequest(
            scenario=scenario, url=url, out_dir=out_dir, duration_s=duration, users=users, rate=rate,
            dataset=dataset, baseline=baseline, scenario_file=scenario_file, workers=workers,
            expect=expect, trace=trace, speedup=speedup, length_scale=length_scale, api_key=api_key, headers=tuple(header or ()), model=model,
            progress_s=progress, prometheus=prometheus, selector=selector, timeout_s=timeout), on_progress=lambda line: typer.echo(line, err=True))
        brief = summary(result)
        typer.echo(json.dumps(brief) if json_out else render(brief))
        if result["exit_code"] != EXIT_OK:
            raise typer.Exit(result["exit_code"])

    return command
