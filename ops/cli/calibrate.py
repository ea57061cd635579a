"""``kvops calibrate``: measure per-layer fp8 KV scales for a model in vLLM itself."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvops.core.errors import BadInputError

if TYPE_CHECKING:
    from kvops.core.fp8.scales import ScalesFile
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
    sensitivity_tokens: Annotated[int, typer.Option(
        help="Prompt tokens the offline scale search and per-layer accuracy sweep score (0: skip both).")] = 2048,
    search_steps: Annotated[int, typer.Option(
        help="Candidate scales per octave the offline search tries per layer (0: keep absmax × margin).")] = 16,
    threshold: Annotated[float, typer.Option(
        help="Perplexity ratio to bf16 KV the skip-layer advice aims for.")] = 1.005,
) -> None:
    """Serve MODEL with the plugin recording K/V, send the prompts, write per-layer scales, then
    offline: search each layer's scales by its attention output error, measure what each layer's
    fp8 KV costs and which layers to keep in bf16."""
    from kvops.ops.fp8.calibrate import CalibrationRequest, resolve_prompts, write_scales
    from kvops.ops.fp8.calibrate import calibrate as run_calibration

    fmt = fp8_format(dtype)
    if fmt is None:
        raise BadInputError(f"--dtype {dtype}: kvops calibrate measures per-tensor scales for "
                            f"{', '.join(calibratable_names())}")
    dtype = fmt
    if not out.parent.is_dir():
        raise BadInputError(f"--out {out}: directory {out.parent} does not exist")
    if sensitivity_tokens < 0 or search_steps < 0 or not threshold >= 1.0:
        raise BadInputError("--sensitivity-tokens and --search-steps must be >= 0 and --threshold >= 1.0 "
                            "(a perplexity ratio)")
    if not margin >= 1.0:
        raise BadInputError(f"--margin {margin}: must be >= 1.0 (values above the scale saturate)")
    prompt_list = tuple(resolve_prompts(prompts, synthetic))
    request = CalibrationRequest(
        model_dir=model, prompts=prompt_list, dtype=dtype, margin=margin, max_tokens=max_tokens
    )
    with typer.progressbar(length=len(prompt_list), label="calibrating", file=None) as bar:
        scales = run_calibration(request, log_path=log, progress=bar.update)
    if sensitivity_tokens:
        scales = _offline_steps(scales, model, prompt_list, sensitivity_tokens, search_steps, threshold)
    write_scales(scales, out)
    for line in calibrate_lines(scales, out):
        typer.echo(line)


def _offline_steps(scales: ScalesFile, model: Path, prompts: tuple[str, ...], tokens: int, search_steps: int,
                   threshold: float) -> ScalesFile:
    """The scale search (unless --search-steps 0), then each layer's cost and the advice."""
    from kvops.ops.fp8.calibrate_accuracy import with_accuracy, with_searched_scales

    if search_steps:
        with typer.progressbar(length=len(scales.layers), label="per-layer scale search", file=None) as bar:
            scales = with_searched_scales(scales, model, prompts, tokens, search_steps, bar.update)
    with typer.progressbar(length=len(scales.layers), label="per-layer fp8 cost", file=None) as bar:
        return with_accuracy(scales, model, prompts, threshold, tokens, bar.update)


def calibrate_lines(scales: ScalesFile, out: Path) -> list[str]:
    """What was written and what it means: saturation/subnormal shares at scale 1.0 vs the
    calibrated scales (the only places the scale changes fp8's error), then the accuracy."""
    from kvops.ops.fp8.calibrate_accuracy import method_lines, summary_lines

    def worst(field: str) -> float:
        return max((getattr(s, field) or 0.0) for s in scales.layers.values())

    lines = [f"wrote {len(scales.layers)} layers' {scales.dtype} scales to {out} ({scales.tokens_seen} tokens; "
             f"K/V saturated at scale 1.0: {max(worst('k_saturated_scale1'), worst('v_saturated_scale1')):.2%}, "
             f"calibrated: {max(worst('k_saturated'), worst('v_saturated')):.2%}; below fp8's smallest normal "
             f"at 1.0: {max(worst('k_subnormal_scale1'), worst('v_subnormal_scale1')):.2%}, calibrated: "
             f"{max(worst('k_subnormal'), worst('v_subnormal')):.2%}, worst layer)"]
    return lines + method_lines(scales) + (summary_lines(scales.accuracy) if scales.accuracy else [])
