"""``kvops doctor``: is this environment able to run what kvops offers?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import EXIT_CHECK_FAILED
from kvops.ops.cli.options import JsonOut


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)


def doctor(
    offload_dir: Annotated[Path, typer.Option(help="Directory an SSD offload tier would use.")] = Path("/tmp"),
    shm_gib: Annotated[float, typer.Option(help="GiB offload needs in /dev/shm: l1_gib (L1 shared with the worker), or the KV cache for zero-copy.")] = 1.0,
    disk_gib: Annotated[float, typer.Option(help="GiB the disk tier needs free.")] = 1.0,
    json_out: JsonOut = False,
) -> None:
    """Check vLLM, fp8-KV support, LMCache, the torchvision trap, /dev/shm and disk.

    Exit code 3 when any check fails; each failing row says how to fix it.
    """
    from kvops.ops.doctor import DoctorInputs, run_checks

    rows = run_checks(DoctorInputs(offload_dir=offload_dir, shm_needed_gib=shm_gib, disk_needed_gib=disk_gib))
    if json_out:
        typer.echo(json.dumps({"checks": [row.as_dict() for row in rows]}, indent=2))
    else:
        width = max(len(row.name) for row in rows)
        for row in rows:
            typer.echo(f"{row.status.upper():4}  {row.name:<{width}}  {row.found}")
            if row.fix:
                typer.echo(f"{'':4}  {'':<{width}}  fix: {row.fix}")
    if any(row.status == "fail" for row in rows):
        raise typer.Exit(EXIT_CHECK_FAILED)
