"""``kvops demo``: build a real model, serve it with the plugin, ask it, send a burst, report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    work_dir: Annotated[Path, typer.Option(help="Where the model, settings and server log go.")] = Path(".demo"),
    model_dir: Annotated[
        Path | None,
        typer.Option(help="The SmolLM2 model folder (kvops model smollm2), built there if missing "
                     "[default: WORK_DIR/smollm2]."),
    ] = None,
    requests: Annotated[int, typer.Option(min=1, max=64, help="Concurrent requests in the burst.")] = 24,
) -> None:
    """Run the main job end to end on this machine (CPU, SmolLM2-135M-Instruct built once)."""
    from kvops.ops.demo import DemoOptions, run_demo

    model = model_dir.resolve() if model_dir else None
    run_demo(DemoOptions(work_dir=work_dir.resolve(), model_dir=model, requests=requests), typer.echo)
