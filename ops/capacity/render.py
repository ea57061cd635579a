"""Assemble a plan from CLI inputs and render it as a table, JSON or kvops.yaml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvops.ops.capacity.allocator import SizingFlags
from kvops.ops.capacity.model import load_config, model_dtype, read_model, text_config
from kvops.ops.capacity.plan import (
    PlanInputs,
    Workload,
    estimate_weights_bytes,
    explain,
    gpu_total_gib,
    make_plan,
    safetensors_bytes,
    serve_command,
)
from kvops.ops.errors import BadInputError


def _workload(max_model_len: int, quantiles: tuple[int | None, int | None, int | None]) -> Workload:
    p50, p95, p99 = (q if q is not None else max_model_len for q in quantiles)
    for name, value in (("--p50", p50), ("--p95", p95), ("--p99", p99)):
        if value < 1 or value > max_model_len:
            raise BadInputError(f"{name} {value} must be in [1, --max-model-len {max_model_len}]")
    if not p50 <= p95 <= p99:
        raise BadInputError("quantiles must satisfy --p50 <= --p95 <= --p99")
    return Workload(max_model_len, p50, p95, p99)


def run_plan(
    config: Path, max_model_len: int, gpu: str | None, gpu_gib: float | None, tp: int, kv_dtype: str,
    model_dir: Path | None, quantiles: tuple[int | None, int | None, int | None],
    target: int | None, util: float | None, mnbt: int | None,
) -> dict[str, Any]:
    raw = load_config(config)
    model = read_model(raw, tp=tp, kv_cache_dtype=kv_dtype)
    fp8 = None
    if kv_dtype in ("auto", "bfloat16", "float16") and not model.use_mla:
        fp8 = read_model(raw, tp=tp, kv_cache_dtype="fp8")
    if max_model_len < 1:
        raise BadInputError(f"--max-model-len must be >= 1, got {max_model_len}")
    if util is not None and not 0 < util <= 1:
        raise BadInputError(f"--gpu-memory-utilization {util} must be in (0, 1]")
    weights = safetensors_bytes(model_dir) if model_dir else estimate_weights_bytes(
        raw, model_dtype(text_config(raw)))
    inputs = PlanInputs(gpu_total_gib=gpu_total_gib(gpu, gpu_gib), tp=tp, gpu_memory_utilization=util,
                        target_concurrency=target, max_num_batched_tokens=mnbt, weights_bytes=weights)
    plan: dict[str, Any] = make_plan(model, SizingFlags(max_model_len=max_model_len), inputs,
                     _workload(max_model_len, quantiles), gpu, fp8)
    plan["weights_source"] = "safetensors headers" if model_dir else "estimate from config.json"
    plan["serve"] = serve_command(_model_ref(config, model_dir), plan)
    return plan


def _model_ref(config: Path, model_dir: Path | None) -> str:
    """What to pass to vllm serve: the model dir, else the config's dir, else org/name from the file."""
    if model_dir is not None:
        return str(model_dir)
    if config.is_dir() or config.name == "config.json":
        return str(config if config.is_dir() else config.parent)
    return config.stem.replace("--", "/", 1)


def render(plan: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(plan)
    if fmt == "yaml":
        import yaml

        doc = {"vllm": {k: plan[k] for k in ("tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs",
                                              "max_model_len", "max_num_batched_tokens", "kv_cache_dtype")},
               "serve": plan["serve"], "expected": {k: plan["capacity"][k] for k in
                                                   ("num_blocks", "block_size", "kv_cache_size_tokens")}}
        return str(yaml.safe_dump(doc, sort_keys=False))
    rows = explain(plan)
    width = max(len(r[0]) for r in rows)
    lines = [f"{q:<{width}}  {v:>18}  {why}" for q, v, why in rows]
    return "\n".join([*lines, "", plan["serve"]])
