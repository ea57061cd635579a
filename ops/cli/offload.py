"""``kvops offload serve|status|check``: run and inspect the LMCache server behind kvops offload,
and prove a vLLM server's load path works."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvops.ops.cli.options import JsonOut, ServerUrl
from kvops.ops.launch import ManagedServer

offload_app = typer.Typer(help="LMCache CPU/SSD offload: run and inspect its server.",
                          no_args_is_help=True)

ConfigOpt = Annotated[Optional[Path], typer.Option(  # noqa: UP045 - typer needs Optional
    "--config", help="kvops.yaml whose 'offload' section to use (flags override it).")]


def register(app: typer.Typer) -> None:
    app.add_typer(offload_app, name="offload")


@offload_app.command("serve")
def serve(
    config: ConfigOpt = None,
    l1_gib: Annotated[Optional[float], typer.Option(help="L1 (DRAM) GiB.")] = None,  # noqa: UP045
    disk_path: Annotated[Optional[str], typer.Option(help="Disk tier directory.")] = None,  # noqa: UP045
    disk_gib: Annotated[Optional[float], typer.Option(help="Disk tier cap, GiB.")] = None,  # noqa: UP045
    port: Annotated[Optional[int], typer.Option(help="LMCache MP (ZMQ) port.")] = None,  # noqa: UP045
    http_port: Annotated[Optional[int], typer.Option(help="LMCache HTTP port.")] = None,  # noqa: UP045
    log: Annotated[Path, typer.Option(help="Where the server's log is kept.")] = Path(
        "lmcache-server.log"),
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for health.")] = 180.0,
) -> None:
    """Start `lmcache server` from kvops settings, wait for health, forward its log, stop on SIGTERM."""
    from kvops.ops.offload.serve import serve as run_server
    from kvops.ops.offload.server import load_offload_settings

    settings = load_offload_settings(config, {
        "l1_gib": l1_gib, "disk_path": disk_path, "disk_gib": disk_gib, "port": port,
        "http_port": http_port,
    })

    def ready(server: ManagedServer) -> None:
        typer.echo(f"kvops: lmcache server ready: KV on {settings.mp_url}, HTTP {server.url} "
                   f"(pid {server.process.pid if server.process else '?'})", err=True)

    raise typer.Exit(run_server(settings, log, ready_timeout, ready))


@offload_app.command("status")
def status(
    config: ConfigOpt = None,
    url: Annotated[str, typer.Option(help="LMCache HTTP API (default: from --config).")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the whole answer.")] = 10.0,
    json_out: JsonOut = False,
) -> None:
    """Summarise L1/L2 usage, hit tokens by tier and evictions of a running LMCache server."""
    from kvops.core.endpoint import check_url
    from kvops.core.http import deadline
    from kvops.ops.offload.server import load_offload_settings
    from kvops.ops.offload.status import fetch_status, render

    base = check_url(url) if url else load_offload_settings(config, {}).http_url
    with deadline(timeout):
        summary = fetch_status(base)
    typer.echo(json.dumps(summary) if json_out else render(summary))


@offload_app.command("check")
def check(
    url: ServerUrl,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the canary's whole answer.")] = 120.0,
    json_out: JsonOut = False,
) -> None:
    """Run the server's load-path canary now: store a synthetic prefix, load it back through the
    connector, compare checksums. Exit 3 when loads do not happen, 1 when the server fails."""
    from kvops.core.endpoint import check_url
    from kvops.core.errors import CheckFailedError
    from kvops.core.http import deadline
    from kvops.ops.offload.check import run_check

    with deadline(timeout):
        verdict = run_check(check_url(url), timeout)
    typer.echo(json.dumps(verdict) if json_out else
               f"load path {'ok' if verdict['ok'] else 'FAILED'}: {verdict.get('reason', '')}")
    if not verdict["ok"]:
        raise CheckFailedError(f"offload load path failed: {verdict.get('reason', '')}")
