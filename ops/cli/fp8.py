"""``kvops fp8 check``: is fp8 KV safe for this model on these prompts (offline A/B)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import EXIT_CHECK_FAILED, BadInputError
from kvops.ops.cli.options import JsonOut


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="fp8 KV accuracy on your own model and prompts.", no_args_is_help=True)
    group.command("check")(check)
    app.add_typer(group, name="fp8")


def check(
    model: Annotated[Path, typer.Option(help="Local model directory (as `vllm serve` takes it).")],
    prompts: Annotated[Path, typer.Option(
        help="Prompts: plain text one per line, or OpenAI request bodies (JSON with prompt or messages) one per line.")],
    scales: Annotated[Path | None, typer.Option(
        help="Scales file from `kvops calibrate` [default: calibrate on these prompts].")] = None,
    threshold: Annotated[float, typer.Option(help="Safe when the perplexity ratio to bf16 KV and exp(mean KL) are both at most this.")] = 1.005,
    max_tokens: Annotated[int, typer.Option(help="Tokens scored per prompt (longer prompts are cut).")] = 256,
    greedy_tokens: Annotated[int, typer.Option(help="Greedy tokens generated per prompt to compare (0: none).")] = 0,
    json_out: JsonOut = False,
) -> None:
    """Run bf16 KV, fp8 at scale 1.0, calibrated fp8 (and advised skip layers) offline; exit 3 when not safe."""
    from kvops.core.fp8.scales import load_scales_file
    from kvops.ops.fp8.check import (
        CheckRequest,
        capacity_line,
        load_check_prompts,
        render,
        run_check,
    )

    if not threshold >= 1.0:
        raise BadInputError(f"--threshold {threshold}: a perplexity ratio, >= 1.0 (e.g. 1.005)")
    if max_tokens < 2 or greedy_tokens < 0:
        raise BadInputError("--max-tokens must be >= 2 and --greedy-tokens >= 0")
    scales_file = load_scales_file(scales) if scales is not None else None
    request = CheckRequest(model_dir=model, prompts=load_check_prompts(prompts), scales=scales_file,
                           threshold=threshold, max_tokens=max_tokens, greedy_tokens=greedy_tokens,
                           dtype=scales_file.dtype if scales_file else "fp8_e4m3")
    result = run_check(request, say=lambda line: typer.echo(line, err=True))
    if json_out:
        typer.echo(json.dumps(result.as_json(), indent=2))
    else:
        for line in [*render(result), *capacity_line(model, result.skip_layers)]:
            typer.echo(line)
    if not result.safe:
        raise typer.Exit(EXIT_CHECK_FAILED)
