"""``kvops trace stats FILE``: lengths, arrival rate and prefix reuse of a production trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvops.core.errors import BadInputError
from kvops.ops.cli.options import JsonOut

trace_app = typer.Typer(help="Production request traces (Mooncake JSONL, BurstGPT CSV).",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace")


def parse_blocks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise BadInputError(f"--cache-blocks {text!r}: give whole numbers separated by commas") from exc
    if not sizes or min(sizes) < 0:
        raise BadInputError(f"--cache-blocks {text!r}: give block counts >= 0, e.g. 1024,4096")
    return sizes


@trace_app.command("stats")
def stats(
    file: Annotated[Path, typer.Argument(help="Mooncake JSONL or BurstGPT CSV trace.")],
    cache_blocks: Annotated[Optional[str], typer.Option(  # noqa: UP045 - typer needs Optional
        help="LRU cache sizes in blocks, e.g. 1024,4096 (default: powers of two up to full reuse).")] = None,
    json_out: JsonOut = False,
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Write the hit-ratio-versus-cache-size curve as a PNG here.")] = None,
) -> None:
    """Exit code 2 on an unreadable file or a malformed line (named with its number)."""
    from kvops.core.trace.read import read_trace
    from kvops.core.trace.summary import trace_stats
    from kvops.ops.trace.render import summary_text, write_plot

    result = trace_stats(read_trace(file), parse_blocks(cache_blocks))
    if plot is not None:
        write_plot(result, plot)
    typer.echo(json.dumps(result.to_dict()) if json_out else summary_text(result))
