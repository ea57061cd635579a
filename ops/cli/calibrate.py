"""``kvops calibrate``: measure per-layer fp8 KV scales for a model in vLLM itself."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvops.core.errors import BadInputError
from kvops.core.kv_dtypes import calibratable_names, fp8_format


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    model: Annotated[Path, typer.Option(help="Local model directory (as `vllm serve` takes it).")],
    out: Annotated[Path, typer.Option(help="Scales file to write (JSON).")],
    prompts: Annotated[
        Path | None, typer.Option(help="Calibration prompts: one per line, or .jsonl with \"prompt\".")
    ] = None,
    synthetic: Annotated[int | None, typer.Option(help="Use N generated prompts instead.")] = None,
    dtype: Annotated[str, typer.Option(
        help=f"The --kv-cache-dtype to calibrate for: {', '.join(calibratable_names())} (fp8 = fp8_e4m3).")
    ] = "fp8_e4m3",
    margin: Annotated[float, typer.Option(help="scale = absmax × margin / format max.")] = 1.25,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 16,
    log: Annotated[Path, typer.Option(help="Where the recording server logs.")] = Path("kvops-calibrate.log"),
) -> None:
    """Serve MODEL with the plugin recording K/V, send the prompts, write per-layer scales."""
    from kvops.ops.fp8.calibrate import CalibrationRequest, resolve_prompts, write_scales
    from kvops.ops.fp8.calibrate import calibrate as run_calibration

    fmt = fp8_format(dtype)
    if fmt is None:
        raise BadInputError(f"--dtype {dtype}: kvops calibrate measures per-tensor scales for "
                            f"{', '.join(calibratable_names())}")
    dtype = fmt
    if not out.parent.is_dir():
        raise BadInputError(f"--out {out}: directory {out.parent} does not exist")
    if not margin >= 1.0:
        raise BadInputError(f"--margin {margin}: must be >= 1.0 (values above the scale saturate)")
    prompt_list = tuple(resolve_prompts(prompts, synthetic))
    request = CalibrationRequest(
        model_dir=model, prompts=prompt_list, dtype=dtype, margin=margin, max_tokens=max_tokens
    )
    with typer.progressbar(length=len(prompt_list), label="calibrating", file=None) as bar:
        scales = run_calibration(request, log_path=log, progress=bar.update)
    write_scales(scales, out)
    worst = max(scales.layers.items(), key=lambda kv: max(kv[1].k_error or 0, kv[1].v_error or 0))
    typer.echo(
        f"wrote {len(scales.layers)} layers' {dtype} scales to {out} ({scales.tokens_seen} tokens; "
        f"worst layer {worst[0]}: k error {worst[1].k_error:.4f}, v error {worst[1].v_error:.4f})"
    )
