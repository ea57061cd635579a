"""The ``kvops`` entry point and the single error boundary of the CLI.

Each command module under ``kvops.ops.cli`` exposes ``register(app)``; importing them must stay
cheap (no vLLM, no torch) so that ``kvops --help`` is instant.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from types import FrameType
from typing import Any

import typer
from typer.core import TyperGroup

from kvops import __version__
from kvops.core.errors import EXIT_ERROR, KvopsError

# One line per command module; each defines register(app: typer.Typer) -> None.
COMMAND_MODULES: tuple[str, ...] = (
    "model",
    "doctor",
    "capacity",
    "bench",
    "calibrate",
    "demo",
    "offload",
    "diagnose",
    "alerts",
    "loadtest",
    "trace",
)


class KvopsGroup(TyperGroup):
    """Turns every KvopsError into a one-line message and its exit code (STYLE rule 5)."""

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]  # typer vendors click's Context
        try:
            return super().invoke(ctx)
        except KvopsError as exc:
            _report(exc)
            ctx.exit(exc.exit_code)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except Terminated:
            typer.echo("kvops: terminated (SIGTERM); stopped what this command had started", err=True)
            ctx.exit(EXIT_TERMINATED)
        except KeyboardInterrupt:
            typer.echo("kvops: interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # the boundary: anything else is our bug
            if os.environ.get("KVOPS_DEBUG") == "1":
                raise
            typer.echo(
                f"kvops: internal error: {type(exc).__name__}: {exc} "
                "(rerun with KVOPS_DEBUG=1 for a traceback)",
                err=True,
            )
            ctx.exit(EXIT_ERROR)


def _report(exc: KvopsError) -> None:
    if os.environ.get("KVOPS_DEBUG") == "1":
        import traceback

        traceback.print_exception(exc)
    message = " ".join(str(exc).split("\n")).strip()
    typer.echo(f"kvops: {message}", err=True)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kvops {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(
        cls=KvopsGroup,
        name="kvops",
        help="KV-cache operations for vLLM: plan, verify, calibrate, diagnose, load-test.",
        no_args_is_help=True,
        add_completion=True,  # kvops --install-completion / --show-completion (bash, zsh, fish)
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
        ),
    ) -> None:
        """KV-cache operations for vLLM."""

    for name in COMMAND_MODULES:
        importlib.import_module(f"kvops.ops.cli.{name}").register(app)
    return app


app = build_app()


EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cancelled CI job, `timeout`, `kill`, a pod's stop): it unwinds the command as
    Ctrl-C does, so the ``finally`` blocks that stop its vLLM servers, LMCache servers and Locust
    processes run. Python's default SIGTERM ends the process at once and leaves them running,
    holding their ports and memory (a killed `kvops bench offload` left two vLLM servers)."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)  # a second SIGTERM must not cut the cleanup
    raise Terminated


def main() -> None:
    """Console-script entry: usage errors become one line too, exit code 2; SIGTERM stops what
    the command started (``Terminated``), exit code 143."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        typer.echo("kvops: aborted", err=True)
        sys.exit(130)
    except typer.TyperException as exc:  # click's UsageError/BadParameter family
        message = " ".join(exc.format_message().split())
        if message:  # empty when help was shown for a bare group
            typer.echo(f"kvops: {message} (see `kvops --help`)", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)
