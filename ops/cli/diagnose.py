"""``kvops diagnose --url URL [--result FILE]`` or ``--prometheus URL [--selector ...]``:
verdicts from a live server's /metrics, or per replica of a fleet from Prometheus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import EXIT_CHECK_FAILED, BadInputError, CheckFailedError
from kvops.ops.cli.options import JsonOut, Timeout


def register(app: typer.Typer) -> None:
    app.command("diagnose", help="Diagnose a live vLLM server or a fleet (and optionally a loadtest result).")(diagnose)


def diagnose(
    url: Annotated[str | None, typer.Option(help="One replica's own base URL, e.g. http://127.0.0.1:8000.")] = None,
    prometheus: Annotated[str | None, typer.Option(
        help="Prometheus base URL: one verdict list per replica it scrapes, from PromQL over --window.")] = None,
    selector: Annotated[str, typer.Option(
        help="With --prometheus: label matchers of the vLLM targets.")] = '{job="vllm"}',
    result: Annotated[Path | None, typer.Option(help="A kvops loadtest result JSON.")] = None,
    window: Annotated[float | None, typer.Option(
        help="Seconds between the two /metrics samples (--url, default 5) or PromQL window (--prometheus, default 30).")] = None,
    timeout: Timeout = None,
    json_out: JsonOut = False,
) -> None:
    """Each verdict names the problem, its cause, the evidence and the next command."""
    from kvops.core.endpoint import check_url
    from kvops.core.http import deadline
    from kvops.core.verdict import any_problem
    from kvops.ops.diagnose import diagnose_live, merge, verdicts_from_result

    if (url is None) == (prometheus is None):
        raise BadInputError("pass exactly one of --url (one replica) or --prometheus (a fleet)")
    seconds = _window(window, prometheus is not None)
    if prometheus is not None:
        if result is not None:
            raise BadInputError("--result goes with --url (one server's run), not --prometheus")
        with deadline(60.0 if timeout is None else timeout):
            _fleet(check_url(prometheus, "--prometheus"), selector, seconds, json_out)
        return
    assert url is not None
    from_result = verdicts_from_result(result) if result else []
    if timeout is not None and timeout <= seconds:
        raise BadInputError(f"--timeout {timeout} must be longer than --window {seconds}: the window is "
                            "spent waiting between the two samples")
    with deadline(seconds + 60.0 if timeout is None else timeout):
        verdicts = merge(diagnose_live(check_url(url), seconds), from_result)
    if json_out:
        typer.echo(json.dumps({"verdicts": [v.to_dict() for v in verdicts]}, indent=2))
    else:
        for v in verdicts:
            _echo(v)
    if any_problem(verdicts):
        raise typer.Exit(EXIT_CHECK_FAILED)  # README: 3 whenever a verdict names a problem


def _window(window: float | None, fleet: bool) -> float:
    """--window: slept through with --url (so at most an hour), a PromQL range with --prometheus."""
    if window is None:
        return 30.0 if fleet else 5.0
    top = 30 * 86400.0 if fleet else 3600.0
    if not 0 <= window <= top:  # NaN fails too
        raise BadInputError(f"--window {window}: give seconds in [0, {top:.0f}]")
    return window


def _fleet(prometheus: str, selector: str, window: float, json_out: bool) -> None:
    from kvops.ops.fleet import diagnose_fleet

    fleet = diagnose_fleet(prometheus, selector, window)
    if json_out:
        typer.echo(json.dumps(fleet.to_dict(), indent=2))
    else:
        for instance, verdicts in fleet.replicas.items():
            typer.echo(f"== {instance}")
            for v in verdicts:
                _echo(v)
        typer.echo(fleet.fleet_line())
    if fleet.unhealthy():
        raise CheckFailedError(fleet.fleet_line())


def _echo(v: object) -> None:
    from kvops.core.verdict import Verdict

    assert isinstance(v, Verdict)
    typer.echo(f"{v.problem} / {v.cause}")
    for key, value in v.evidence.items():
        typer.echo(f"  {key}: {value}")
    typer.echo(f"  next: {v.next}")
