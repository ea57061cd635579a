"""``kvops bench fp8 --json``: fp8 KV capacity and accuracy, scale 1.0 vs calibrated, against
bf16 KV, side by side on the same tiny models in one run.

Per model three real servers run one after another: bf16 KV with the plugin recording (it
calibrates and is the accuracy reference), fp8 at scale 1.0, fp8 with the calibrated scales.
Models: the ordinary tiny Llama, and the same function with K/V ×1000 (saturates e4m3 at
scale 1.0) and ×0.001 (rounds into e4m3's subnormals) — see kvops.ops.fp8.kv_scaled_model.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import KvopsError
from kvops.ops.fp8.accuracy import Drift, drift, score
from kvops.ops.fp8.calibrate import (
    CalibrationRequest,
    collect_scales,
    recording_server,
    synthetic_prompts,
)
from kvops.ops.launch import ManagedServer, vllm_server

BENCH_MODELS: tuple[tuple[str, float], ...] = (
    ("ordinary", 1.0),
    ("saturating-kv-x1000", 1000.0),
    ("underflowing-kv-x0.001", 0.001),
)
CALIBRATION_PROMPTS = 8
MAX_MODEL_LEN = 2048
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True)
class ModelRun:
    name: str
    bf16_tokens: int
    fp8_tokens: int
    scale1: Drift
    calibrated: Drift

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "drift_scale1": self.scale1.mean_abs_logprob_delta,
            "drift_calibrated": self.calibrated.mean_abs_logprob_delta,
            "max_drift_scale1": self.scale1.max_abs_logprob_delta,
            "max_drift_calibrated": self.calibrated.max_abs_logprob_delta,
            "greedy_agreement_scale1": self.scale1.top1_agreement,
            "greedy_agreement_calibrated": self.calibrated.top1_agreement,
            "positions": self.calibrated.positions,
            "bf16_kv_tokens": self.bf16_tokens,
            "fp8_kv_tokens": self.fp8_tokens,
        }


def kv_tokens_from_log(log: str) -> int:
    """The KV capacity the server itself logged (vllm/v1/core/kv_cache_utils.py:2316-2334)."""
    match = KV_LINE.search(log)
    if not match:
        raise KvopsError("the server did not log its KV cache size")
    return int(match.group(1).replace(",", ""))


def measure_model(model_dir: Path, name: str, work: Path) -> ModelRun:
    """Calibrate on a bf16 recording server, then score bf16 / fp8@1.0 / fp8@calibrated.

    The fp8@1.0 server starts alongside the recording one (start-up is mostly one core of
    Python imports); the calibrated one needs the scales, so it starts last.
    """
    req = CalibrationRequest(
        model_dir=model_dir, prompts=synthetic_prompts(CALIBRATION_PROMPTS, seed=1),
        max_model_len=MAX_MODEL_LEN,
    )
    plain = _fp8_server(model_dir, work / f"{name}-fp8-scale1.log", None)
    with ThreadPoolExecutor(max_workers=1) as pool:
        plain_started = pool.submit(plain.start)
        try:
            with recording_server(req, work / f"{name}-bf16.log") as (server, record_dir):
                scales = collect_scales(req, server.url, record_dir)
                reference = score(server.url, str(model_dir))
                bf16_tokens = kv_tokens_from_log(server.log_path.read_text())
            plain_started.result()
            scale1 = score(plain.url, str(model_dir))
            fp8_tokens = kv_tokens_from_log(plain.log_path.read_text())
        finally:
            plain_started.cancel()
            plain.stop()
    scales_path = work / f"{name}-scales.json"
    scales_path.write_text(json.dumps(scales.model_dump()))
    calibrated = _fp8_server(model_dir, work / f"{name}-fp8-calibrated.log", scales_path)
    try:
        calibrated.start()
        calibrated_scores = score(calibrated.url, str(model_dir))
    finally:
        calibrated.stop()
    return ModelRun(
        name, bf16_tokens, fp8_tokens, drift(reference, scale1), drift(reference, calibrated_scores)
    )


def _fp8_server(model_dir: Path, log: Path, scales: Path | None) -> ManagedServer:
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-dtype", "fp8"]
    if scales is not None:
        args += ["--additional-config", json.dumps({"kvops": {"kv_scales": str(scales)}})]
    return vllm_server(model_dir, args, log_path=log, name=log.stem)


def _fp8_servers_refused() -> str | None:
    """Why vLLM will not serve fp8 KV on this CPU (the bench's server keys need it), or None."""
    import platform

    from kvops.core.fp8.scales import fp8_kv_support
    from kvops.plugin.fp8.validate import cpu_flags

    ok, reason = fp8_kv_support(platform.machine(), cpu_flags(), 64, False)
    return None if ok else reason


def run(models: Sequence[tuple[str, float]] = BENCH_MODELS) -> dict[str, Any]:
    from kvops.ops.bench import fp8_real
    from kvops.ops.fp8.kv_scaled_model import build_kv_scaled_model

    started = time.monotonic()
    real = fp8_real.run()
    refused = _fp8_servers_refused()
    if refused is not None:
        return {"capacity_ratio": None, "models": [], "servers_skipped": refused, "real_model": real,
                "bench_seconds": round(time.monotonic() - started, 1)}
    with tempfile.TemporaryDirectory(prefix="kvops-bench-fp8-") as tmp:
        work = Path(tmp)
        runs = [
            measure_model(build_kv_scaled_model(work / name, factor), name, work)
            for name, factor in models
        ]
    ratios = {r.fp8_tokens / r.bf16_tokens for r in runs}
    return {
        "capacity_ratio": min(ratios),
        "models": [r.as_json() for r in runs],
        "mean_drift_scale1": sum(r.scale1.mean_abs_logprob_delta for r in runs) / len(runs),
        "mean_drift_calibrated": sum(r.calibrated.mean_abs_logprob_delta for r in runs) / len(runs),
        "max_drift_scale1": max(r.scale1.max_abs_logprob_delta for r in runs),
        "max_drift_calibrated": max(r.calibrated.max_abs_logprob_delta for r in runs),
        "real_model": real,
        "bench_seconds": round(time.monotonic() - started, 1),
    }
