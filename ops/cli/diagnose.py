"""``kvops diagnose --url URL [--result FILE]``: verdicts from a live server's /metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("diagnose", help="Diagnose a live vLLM server (and optionally a loadtest result).")(diagnose)


def diagnose(
    url: Annotated[str, typer.Option(help="Server base URL, e.g. http://127.0.0.1:8000.")],
    result: Annotated[Path | None, typer.Option(help="A kvops loadtest result JSON.")] = None,
    window: Annotated[float, typer.Option(help="Seconds between the two /metrics samples.")] = 5.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Each verdict names the problem, its cause, the evidence and the next command."""
    from kvops.ops.diagnose import diagnose_live, merge, verdicts_from_result

    from_result = verdicts_from_result(result) if result else []
    verdicts = merge(diagnose_live(url, window), from_result)
    if json_out:
        typer.echo(json.dumps({"verdicts": [v.to_dict() for v in verdicts]}, indent=2))
        return
    for v in verdicts:
        typer.echo(f"{v.problem} / {v.cause}")
        for key, value in v.evidence.items():
            typer.echo(f"  {key}: {value}")
        typer.echo(f"  next: {v.next}")
