"""``kvops calibrate``: per-layer fp8 KV scales measured in vLLM itself.

vLLM 0.32 has no dynamic scale calculation, so a bf16 checkpoint runs fp8 KV at scale 1.0. We
start the real server (CPU or GPU, whatever ``vllm serve`` runs on) with the kvops plugin in
recording mode, send the calibration prompts, and read back what every attention layer wrote
to its cache: exact absmax of K and V and a random sample of values. The scale is
``absmax × margin / format max`` (kvops.core.fp8.scales.DEFAULT_MARGIN), and the sample gives the
quantization error with that scale and with 1.0. torch is imported only to compute errors.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import requests

from kvops.core.errors import BadInputError, KvopsError
from kvops.core.files import read_text
from kvops.core.fp8.scales import (
    DEFAULT_MARGIN,
    FORMAT_MAX,
    FORMAT_MIN_NORMAL,
    Fp8Format,
    LayerScales,
    ScalesFile,
    fingerprint_of_config,
    read_model_config,
    scale_from_absmax,
)
from kvops.core.kv_dtypes import calibratable_names, fp8_format
from kvops.ops.launch import ManagedServer, vllm_server

_SYNTHETIC_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can out up about time said into some them could new other then than "
    "data model cache value key token layer request memory block scale error python 0 1 2 "
    "3 4 5 6 7 8 9 ( ) , . ; : ? ! = + - * / < > [ ] { } # @"
).split()


@dataclass(frozen=True)
class CalibrationRequest:
    model_dir: Path
    prompts: tuple[str, ...]
    dtype: str = "fp8_e4m3"
    margin: float = DEFAULT_MARGIN
    max_tokens: int = 16
    max_model_len: int = 4096
    extra_server_args: tuple[str, ...] = ()


def load_prompts(path: Path) -> tuple[str, ...]:
    """One prompt per line; a ``.jsonl`` file holds objects with a "prompt" string."""
    if not path.exists():
        raise BadInputError(f"--prompts {path}: no such file")
    prompts: list[str] = []
    for number, line in enumerate(read_text(path, f"--prompts {path}").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                item = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                raise BadInputError(f"--prompts {path}:{number}: not a JSON object") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise BadInputError(f'--prompts {path}:{number}: expected {{"prompt": "..."}}')
            prompts.append(item["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise BadInputError(f"--prompts {path}: no prompts (one per line)")
    return tuple(prompts)


def synthetic_prompts(count: int, seed: int = 0) -> tuple[str, ...]:
    """Deterministic word salad of 50-400 words: exercises every position, not a substitute
    for real traffic on a real model."""
    if count < 1:
        raise BadInputError("--synthetic must be >= 1")
    rng = random.Random(seed)
    return tuple(
        " ".join(rng.choice(_SYNTHETIC_WORDS) for _ in range(rng.randint(50, 400)))
        for _ in range(count)
    )


def calibrate(
    req: CalibrationRequest, log_path: Path, progress: Callable[[int], None] | None = None
) -> ScalesFile:
    """Run the prompts through a recording server and turn what it saw into scales."""
    with recording_server(req, log_path) as (server, record_dir):
        return collect_scales(req, server.url, record_dir, progress)


@contextmanager
def recording_server(req: CalibrationRequest, log_path: Path) -> Iterator[tuple[ManagedServer, Path]]:
    """A started `vllm serve` of req.model_dir with the plugin recording K/V (bf16 KV unless
    req.extra_server_args say otherwise), and the directory its workers write to."""
    if fp8_format(req.dtype) is None:
        raise BadInputError(f"--dtype {req.dtype}: kvops calibrate measures per-tensor scales for "
                            f"{', '.join(calibratable_names())}")
    read_model_config(req.model_dir)
    with tempfile.TemporaryDirectory(prefix="kvops-calib-") as tmp:
        record_dir = Path(tmp)
        settings = {"kvops": {"kv_scales": {"record": str(record_dir)}}}
        args = ["--max-model-len", str(req.max_model_len), "--additional-config",
                json.dumps(settings), *req.extra_server_args]
        server = vllm_server(req.model_dir, args, log_path=log_path, name="vllm-calibrate")
        try:
            server.start()
            yield server, record_dir
        finally:
            server.stop()


def collect_scales(
    req: CalibrationRequest, url: str, record_dir: Path,
    progress: Callable[[int], None] | None = None,
) -> ScalesFile:
    """Send the prompts to a recording server, wait until its workers have reported every
    token, and compute the scales from what they saw."""
    baseline = _tokens_recorded(record_dir, settle_s=2.0)
    written = 0
    for prompt in req.prompts:
        written += _complete(url, str(req.model_dir), prompt, req.max_tokens)
        if progress:
            progress(1)
    _wait_for_tokens(record_dir, baseline + written)
    stats, samples = _merge_stats(record_dir), _merge_samples(record_dir)
    layers = {name: _layer_scales(stat, samples.get(name, {}), req) for name, stat in stats.items()}
    if not layers:
        raise KvopsError("the server recorded no K/V: is the kvops plugin installed in its venv?")
    return ScalesFile(
        dtype=cast(Fp8Format, fp8_format(req.dtype)),  # checked by recording_server
        margin=req.margin,
        model=fingerprint_of_config(read_model_config(req.model_dir)),
        vllm_version=_server_version(url),
        tokens_seen=int(min(s["tokens"] for s in stats.values())),
        layers=dict(sorted(layers.items(), key=lambda kv: _layer_order(kv[0]))),
    )


def _layer_order(name: str) -> tuple[int, str]:
    digits = [int(p) for p in name.split(".") if p.isdigit()]
    return (digits[0] if digits else -1, name)


def _complete(url: str, model: str, prompt: str, max_tokens: int) -> int:
    """Send one prompt; return how many tokens' K/V it wrote (the last sampled token's never)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = requests.post(url + "/v1/completions", json=body, timeout=600)
    if resp.status_code == 400:
        raise BadInputError(f"the server rejected a calibration prompt: {resp.text[:300]}")
    resp.raise_for_status()
    usage = resp.json()["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"]) - 1


def _server_version(url: str) -> str:
    try:
        return str(requests.get(url + "/version", timeout=10).json().get("version", ""))
    except (requests.RequestException, ValueError):
        return ""


def _tokens_recorded(record_dir: Path, settle_s: float = 0.0) -> int:
    """Tokens every layer has seen (min over layers, max over workers)."""
    time.sleep(settle_s)
    stats = _merge_stats(record_dir)
    return int(min((s["tokens"] for s in stats.values()), default=0))


def _wait_for_tokens(record_dir: Path, target: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _tokens_recorded(record_dir) < target:
        if time.monotonic() > deadline:
            raise KvopsError(
                f"the recording workers reported fewer tokens than were sent ({target}) "
                f"under {record_dir}"
            )
        time.sleep(0.5)


def _merge_stats(record_dir: Path) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, float]] = {}
    for path in sorted(record_dir.glob("stats-*.json")):
        for name, stat in json.loads(path.read_text())["layers"].items():
            into = merged.setdefault(name, {"k_absmax": 0.0, "v_absmax": 0.0, "tokens": 0})
            into["k_absmax"] = max(into["k_absmax"], stat["k_absmax"])
            into["v_absmax"] = max(into["v_absmax"], stat["v_absmax"])
            into["tokens"] = max(into["tokens"], stat["tokens"])
    return merged


def _merge_samples(record_dir: Path) -> dict[str, dict[str, Any]]:
    import torch

    merged: dict[str, dict[str, Any]] = {}
    for path in sorted(record_dir.glob("samples-*.pt")):
        for name, parts in torch.load(path).items():
            into = merged.setdefault(name, {})
            for kind, values in parts.items():
                into[kind] = values if kind not in into else torch.cat([into[kind], values])
    return merged


def _layer_scales(stat: dict[str, float], sample: dict[str, Any], req: CalibrationRequest) -> LayerScales:
    k_scale = scale_from_absmax(stat["k_absmax"], req.dtype, req.margin)
    v_scale = scale_from_absmax(stat["v_absmax"], req.dtype, req.margin)
    shares: dict[str, float | None] = {}
    for kind, scale in (("k", k_scale), ("v", v_scale)):
        for suffix, at in (("", scale), ("_scale1", 1.0)):
            saturated, subnormal = range_shares(sample.get(kind), at, req.dtype)
            shares[f"{kind}_saturated{suffix}"], shares[f"{kind}_subnormal{suffix}"] = saturated, subnormal
    return LayerScales(
        k_scale=k_scale, v_scale=v_scale, k_absmax=stat["k_absmax"], v_absmax=stat["v_absmax"],
        k_error=quantization_error(sample.get("k"), k_scale, req.dtype),
        v_error=quantization_error(sample.get("v"), v_scale, req.dtype),
        k_error_scale1=quantization_error(sample.get("k"), 1.0, req.dtype),
        v_error_scale1=quantization_error(sample.get("v"), 1.0, req.dtype),
        **shares,
    )


def range_shares(values: Any, scale: float, dtype: str) -> tuple[float | None, float | None]:
    """Shares of values that saturate (|x / scale| > max) and that fall below the smallest
    normal (nonzero |x / scale| < min normal: fewer mantissa bits, or zero) at this scale: the
    two places where the scale changes fp8's error at all."""
    if values is None or values.numel() == 0:
        return None, None
    scaled = values.float().abs() / scale
    count = float(scaled.numel())
    saturated = float((scaled > FORMAT_MAX[dtype]).sum()) / count
    subnormal = float(((scaled < FORMAT_MIN_NORMAL[dtype]) & (scaled > 0)).sum()) / count
    return saturated, subnormal


def quantization_error(values: Any, scale: float, dtype: str) -> float | None:
    """Relative RMS error of ``values`` stored as fp8(x / scale) × scale, saturating at the
    format's max like vLLM's kernels (clamped, not inf).

    On an H200 (device tool, 2026-12-04) this clamp and torch cast wrote the same bytes as
    ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, …)``, the conversion of vLLM's CUDA cache
    kernels, for all of 25 M bf16 values: e4m3 and e5m2, calibrated scales and 1.0, magnitudes
    from 1e-3 to 3000, with exact and fast division. So the errors ``kvops calibrate`` reports
    hold for a CUDA server's fp8 cache too."""
    if values is None or values.numel() == 0:
        return None
    import torch

    torch_dtype = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.float8_e5m2
    x = values.float()
    limit = FORMAT_MAX[dtype]
    stored = (x / scale).clamp(-limit, limit).to(torch_dtype).float() * scale
    norm = float(x.pow(2).mean().sqrt())
    if norm == 0:
        return 0.0
    return float((x - stored).pow(2).mean().sqrt()) / norm


def write_scales(scales: ScalesFile, out: Path) -> None:
    out.write_text(json.dumps(scales.model_dump(), indent=2) + "\n")


def resolve_prompts(prompts_file: Path | None, synthetic: int | None) -> Sequence[str]:
    """Exactly one of --prompts / --synthetic."""
    if (prompts_file is None) == (synthetic is None):
        raise BadInputError("give exactly one of --prompts FILE or --synthetic N")
    return load_prompts(prompts_file) if prompts_file is not None else synthetic_prompts(synthetic or 0)
