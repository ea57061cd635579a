"""Front-end fp8 KV checks: refuse combinations that would fail deep in a worker (or run
silently wrong), and decide which scales the workers will apply.

Runs inside vLLM's platform config hook (vllm/config/vllm.py:1991), before any engine process
starts. vLLM itself finds these problems only at worker KV init
(vllm/v1/attention/backends/cpu_attn.py ``_get_attn_isa``) or at weight load
(vllm/model_executor/layers/attention/attention.py ``_init_kv_cache_quant``).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError, KvopsPluginError
from kvops.core.fp8.scales import (
    ScalesFile,
    ScaleSource,
    checkpoint_kv_scale_names,
    choose_scale_source,
    fingerprint_of_config,
    fp8_kv_support,
    load_scales_file,
    normalize_fp8_dtype,
    read_cpu_flags,
    read_model_config,
    scales_mismatch,
)
from kvops.core.fp8.settings import KvScalesSettings
from kvops.core.kv_dtypes import KV_DTYPES, calibratable_names, device_names, is_quantized

FAKE_CPU_FLAGS_ENV = "KVOPS_FAKE_CPU_FLAGS"
"""Replaces /proc/cpuinfo's flags (comma-separated) in the fp8 check. Only for tests: a CPU
without AVX-512 cannot be produced for real on the machines that run them."""


@dataclass(frozen=True)
class Fp8Plan:
    """What fp8 KV will do in this server."""

    dtype: str
    source: ScaleSource
    scales: ScalesFile | None
    scales_path: str | None
    checkpoint_scale_names: tuple[str, ...]


def cpu_flags() -> frozenset[str]:
    fake = os.environ.get(FAKE_CPU_FLAGS_ENV)
    if fake is not None:
        return frozenset(f for f in fake.split(",") if f)
    return read_cpu_flags()


def model_dir_of(vllm_config: Any) -> Path | None:
    """The served model's local directory, or None for a hub id (not readable here)."""
    path = Path(str(vllm_config.model_config.model))
    return path if path.is_dir() else None


def _runs_on_cpu(cache_dtype: str, use_mla: bool) -> bool:
    return any(row.name == cache_dtype and row.runs_on("cpu", use_mla) for row in KV_DTYPES)


def plan_fp8(vllm_config: Any, kv_scales: KvScalesSettings | None, on_cpu: bool) -> Fp8Plan | None:
    """Validate fp8 KV for this config; None when the KV is not fp8 (or we only record)."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    fmt = normalize_fp8_dtype(cache_dtype)
    recording = kv_scales is not None and kv_scales.record is not None
    model_config = vllm_config.model_config
    if kv_scales is not None and bool(model_config.use_mla):
        raise KvopsPluginError(
            "kv_scales does not support MLA models (their latent cache is written by "
            "MLAAttention, which kvops does not hook): drop kv_scales"
        )
    if on_cpu and fmt is None and is_quantized(cache_dtype) and not _runs_on_cpu(cache_dtype, bool(model_config.use_mla)):
        raise KvopsPluginError(
            f"--kv-cache-dtype {cache_dtype} does not run on vLLM's CPU backend (it fails at worker KV init): "
            f"the CPU runs {', '.join(device_names('cpu', bool(model_config.use_mla)))}")
    if fmt is None:
        if kv_scales is not None and not recording:
            raise KvopsPluginError(
                f"kv_scales is set but --kv-cache-dtype is {cache_dtype!r}: add --kv-cache-dtype fp8 "
                f"(kv_scales applies to {', '.join(calibratable_names())}) or drop kv_scales"
            )
        return None
    if on_cpu:
        ok, reason = fp8_kv_support(
            platform.machine(), cpu_flags(), int(model_config.get_head_size()),
            bool(model_config.use_mla),
        )
        if not ok:
            raise KvopsPluginError(reason)
    if recording:
        return None  # calibration observes K/V before quantization; no scales to apply
    model_dir = model_dir_of(vllm_config)
    ckpt = tuple(checkpoint_kv_scale_names(model_dir)) if model_dir else ()
    if fmt == "fp8_e5m2" and ckpt:
        raise KvopsPluginError(
            f"--kv-cache-dtype {cache_dtype} with a checkpoint that carries k/v scales "
            f"({ckpt[0]} ...): vLLM refuses fp8_e5m2 with fp8 checkpoints; use "
            "--kv-cache-dtype fp8_e4m3"
        )
    scales = _checked_scales(kv_scales, fmt, model_dir) if kv_scales else None
    source = choose_scale_source(
        bool(ckpt), scales is not None, bool(kv_scales and kv_scales.override_checkpoint)
    )
    return Fp8Plan(fmt, source, scales, kv_scales.path if kv_scales else None, ckpt)


def _checked_scales(kv_scales: KvScalesSettings, fmt: str, model_dir: Path | None) -> ScalesFile:
    assert kv_scales.path is not None
    try:
        scales = load_scales_file(Path(kv_scales.path))
        if model_dir is None:
            raise BadInputError(
                "kv_scales needs the model as a local directory to check the scales' "
                "fingerprint: serve the model by its path"
            )
        mismatch = scales_mismatch(scales, fingerprint_of_config(read_model_config(model_dir)))
    except BadInputError as exc:
        raise KvopsPluginError(str(exc)) from None
    if mismatch:
        raise KvopsPluginError(
            f"kv_scales file {kv_scales.path} was calibrated for another model ({mismatch}): "
            f"run `kvops calibrate --model {model_dir}`"
        )
    if scales.dtype != fmt:
        raise KvopsPluginError(
            f"kv_scales file {kv_scales.path} was calibrated for {scales.dtype} but the KV cache "
            f"is {fmt}: recalibrate with `kvops calibrate --dtype {fmt}` or serve {scales.dtype}"
        )
    return scales


def describe(plan: Fp8Plan) -> str:
    """The one log line that says which scales won, and why."""
    if plan.source == "file":
        override = " (overriding the checkpoint's)" if plan.checkpoint_scale_names else ""
        return f"kvops fp8: {plan.dtype} KV with calibrated per-layer scales from {plan.scales_path}{override}"
    if plan.source == "checkpoint":
        ignored = f"; kv_scales {plan.scales_path} ignored (set override_checkpoint)" if plan.scales_path else ""
        return f"kvops fp8: {plan.dtype} KV with the checkpoint's k/v scales{ignored}"
    return (
        f"kvops fp8: {plan.dtype} KV is running with scale 1.0 (no checkpoint or calibrated "
        "scales): K/V above the fp8 range saturate and tiny ones round to zero. Run "
        "`kvops calibrate` and set --additional-config '{\"kvops\": {\"kv_scales\": \"scales.json\"}}'"
    )


def skip_advice(plan: Fp8Plan, served_skips: list[str]) -> str | None:
    """A warning when the scales file advises layers to keep at the model dtype that this server
    quantizes (``kvops calibrate`` measured them: kvops.ops.fp8.sensitivity); None otherwise."""
    accuracy = plan.scales.accuracy if plan.source == "file" and plan.scales is not None else None
    if accuracy is None or not accuracy.skip_layers:
        return None
    missing = [layer for layer in accuracy.skip_layers if str(layer) not in served_skips]
    if not missing:
        return None
    advised = " ".join(str(layer) for layer in accuracy.skip_layers)
    return (f"kvops fp8: {plan.scales_path} advises keeping layers {advised} unquantized (calibrated fp8 "
            f"perplexity ratio {accuracy.calibrated_perplexity_ratio:.4f} without them, threshold "
            f"{accuracy.threshold}); this server quantizes {' '.join(map(str, missing))}: serve with "
            f"--kv-cache-dtype-skip-layers {advised} (`kvops plan --kv-scales` sizes what they cost)")


def check_fp8(vllm_config: Any, kv_scales: KvScalesSettings | None) -> Fp8Plan | None:
    """The front-end entry (plugin/hooks.py): validate, then log which scales won.

    Runs even without kvops settings: refusing fp8 on a CPU that cannot run it only moves a
    certain worker failure to the start, and the scale-1.0 warning is what operators lack.
    """
    from vllm.platforms import current_platform

    from kvops.plugin._compat import plugin_logger

    plan = plan_fp8(vllm_config, kv_scales, on_cpu=current_platform.is_cpu())
    if plan is not None:
        log = plugin_logger()
        (log.warning if plan.source == "default" else log.info)(describe(plan))
        advice = skip_advice(plan, [str(x) for x in vllm_config.cache_config.kv_cache_dtype_skip_layers or []])
        if advice is not None:
            log.warning(advice)
    return plan
