"""``kvops runbook [NAME] [--path]``: the runbook pages installed with kvops, so that a verdict's
``next`` (``kvops runbook kv-exhaustion``) works wherever kvops is installed, not only in a checkout."""

from __future__ import annotations

from typing import Annotated

import typer

from kvops.core import runbooks


def register(app: typer.Typer) -> None:
    app.command("runbook")(runbook)


def runbook(
    name: Annotated[str | None, typer.Argument(
        help="The page, e.g. kv-exhaustion (as verdicts name it); none: list the pages.")] = None,
    path: Annotated[bool, typer.Option(
        "--path", help="Print where the page (or, with no NAME, the folder) is installed.")] = False,
) -> None:
    """List the runbook pages, print one (Meaning, Impact, Diagnosis, Mitigation, ...), or its path."""
    if name is None:
        if path:
            typer.echo(str(runbooks.folder()))
            return
        pages = runbooks.page_names()
        width = max(len(page) for page in pages)
        for page in pages:
            typer.echo(f"{page:<{width}}  {_title(runbooks.page_path(page).read_text())}")
        return
    page_path = runbooks.page_path(name)
    typer.echo(str(page_path) if path else page_path.read_text(), nl=path)


def _title(text: str) -> str:
    """The page's heading: its first line, without the '# '."""
    return text.split("\n", 1)[0].removeprefix("# ").strip()
