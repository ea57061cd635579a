"""The ``kvops`` entry point and the single error boundary of the CLI.

Each command module under ``kvops.ops.cli`` exposes ``register(app)``; importing them must stay
cheap (no vLLM, no torch) so that ``kvops --help`` is instant.
"""

from __future__ import annotations

import importlib
import io
import os
import signal
import sys
from types import FrameType
from typing import Any, NoReturn

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
    "fp8",
    "demo",
    "offload",
    "diagnose",
    "alerts",
    "runbook",
    "loadtest",
    "trace",
)


class KvopsGroup(TyperGroup):
    """Turns every KvopsError into a one-line message and its exit code (STYLE rule 5)."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: Any = None, **extra: Any) -> Any:
        """``kvops --help | head``: the group's own help is written while its context is made,
        before ``invoke``'s boundary (typer would exit 1 there)."""
        try:
            return super().make_context(info_name, args, parent, **extra)
        except BrokenPipeError:
            _end_on_broken_pipe()

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]  # typer vendors click's Context
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _end_on_broken_pipe()
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


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _end_on_broken_pipe() -> NoReturn:
    """The reader of our stdout has gone (``kvops plan … | head``, a closed ``less``): end as a
    shell's pipeline expects, quietly with 141 as if by SIGPIPE. Python ignores SIGPIPE, so the
    write raised instead; by then the ``finally`` blocks of the command have run. stdout is
    pointed at /dev/null so that the interpreter's last flush of what is still buffered does not
    fail again ("Exception ignored ... BrokenPipeError", exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    raise SystemExit(EXIT_BROKEN_PIPE)


def _stdout_identity() -> tuple[int, int] | None:
    """The file behind stdout; None when stdout is no file (main() called in-process with a
    captured stream, as the hostile-input tests and embedders do)."""
    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    return (st.st_dev, st.st_ino)


def _file_identity_of(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _report(exc: KvopsError) -> None:
    if os.environ.get("KVOPS_DEBUG") == "1":
        import traceback

        traceback.print_exception(exc)
    message = " ".join(str(exc).split("\n")).strip()
    typer.echo(f"kvops: {message}", err=True)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(versions_line())
        raise typer.Exit()


def versions_line() -> str:
    """kvops and the vLLM and LMCache it would run with, from the installed distributions'
    metadata (importing vLLM takes ~10 s): what a bug report or an install check needs."""
    from importlib import metadata

    from kvops.ops.doctor import vllm_platform

    platform, vllm = vllm_platform()
    try:
        lmcache = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        lmcache = "not installed"
    vllm_text = f"{vllm} ({platform})" if vllm else "not installed"
    return f"kvops {__version__}, vLLM {vllm_text}, LMCache {lmcache}"


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
    stdout_before = _stdout_identity()
    try:
        code = app(standalone_mode=False)
    except SystemExit as exc:
        # rich, which writes typer's help, meets a gone reader by pointing stdout at /dev/null
        # and exiting 1 (rich/console.py on_broken_pipe): the same end as ours, with our code
        now = _stdout_identity()
        if exc.code == 1 and now is not None and now != stdout_before and now == _file_identity_of(os.devnull):
            sys.exit(EXIT_BROKEN_PIPE)
        raise
    except typer.Abort:
        typer.echo("kvops: aborted", err=True)
        sys.exit(130)
    except typer.TyperException as exc:  # click's UsageError/BadParameter family
        message = " ".join(exc.format_message().split())
        if message:  # empty when help was shown for a bare group
            typer.echo(f"kvops: {message} (see `kvops --help`)", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)
