"""``kvops demo``: build a tiny model, serve it with the plugin, send a burst, report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    work_dir: Annotated[Path, typer.Option(help="Where the model, settings and server log go.")] = Path(".demo"),
    requests: Annotated[int, typer.Option(min=1, max=64, help="Concurrent requests in the burst.")] = 24,
) -> None:
    """Run the main job end to end on this machine (CPU, tiny model built on the spot)."""
    from kvops.ops.demo import DemoOptions, run_demo

    run_demo(DemoOptions(work_dir=work_dir.resolve(), requests=requests), typer.echo)
