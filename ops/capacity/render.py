"""Assemble a plan from CLI inputs and render it as a table, JSON or kvops.yaml."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.ops.capacity.allocator import SizingFlags, parse_pp_layer_partition
from kvops.ops.capacity.calibration import MAX_GIB, load_calibration
from kvops.ops.capacity.model import ModelKV, load_config, model_dtype, read_model, text_config
from kvops.ops.capacity.offload import OffloadInputs, recommend_offload
from kvops.ops.capacity.outputs import explain, kvops_settings, offload_chunk_tokens, serve_command
from kvops.ops.capacity.plan import (
    PlanInputs,
    estimate_weights_bytes,
    gpu_total_gib,
    make_plan,
    safetensors_bytes,
)
from kvops.ops.capacity.workload import Workload, from_file, from_quantiles, parse_quantile
from kvops.ops.errors import BadInputError


@dataclass(frozen=True)
class PlanRequest:
    """Everything ``kvops plan`` was given (None: not given)."""

    config: Path
    max_model_len: int
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    tp: int = 1
    pp: int = 1
    device: str = "cuda"
    kv_cache_dtype: str = "auto"
    draft_layers: int = 0
    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    pp_layer_partition: str | None = None  # VLLM_PP_LAYER_PARTITION
    model_dir: Path | None = None
    quantiles: tuple[int | None, int | None, int | None] = (None, None, None)
    lengths_file: Path | None = None
    risk_quantile: str = "p95"
    headroom_fraction: float = 0.0
    target_concurrency: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    calibration: Path | None = None
    distinct_prefixes: int = 0
    prefix_tokens: int = 0
    host_memory_gib: float | None = None


def _workload(req: PlanRequest) -> Workload:
    if req.lengths_file is not None:
        if any(q is not None for q in req.quantiles):
            raise BadInputError("give either --lengths-file or --p50/--p95/--p99, not both")
        work = from_file(req.lengths_file, req.max_model_len)
    else:
        work = from_quantiles(req.max_model_len, *req.quantiles)
    parse_quantile(req.risk_quantile)
    work.length_at(req.risk_quantile)  # fails early for a quantile the input cannot answer
    return work


def _inputs(req: PlanRequest, raw: dict[str, Any]) -> PlanInputs:
    if req.gpu_memory_utilization is not None and not 0 < req.gpu_memory_utilization <= 1:
        raise BadInputError(f"--gpu-memory-utilization {req.gpu_memory_utilization} must be in (0, 1]")
    if not 0 <= req.headroom_fraction <= 0.9:
        raise BadInputError(f"--headroom must be in [0, 0.9], got {req.headroom_fraction}")
    if req.target_concurrency is not None and req.target_concurrency < 1:
        raise BadInputError(f"--target-concurrency must be >= 1, got {req.target_concurrency}")
    calibration = load_calibration(req.calibration) if req.calibration else None
    total = req.gpu_memory_gib
    if total is None and req.gpu is None and calibration is not None:
        total = calibration.device_total_gib  # the device the calibration measured
    weights = safetensors_bytes(req.model_dir) if req.model_dir else estimate_weights_bytes(
        raw, model_dtype(text_config(raw)))
    return PlanInputs(
        gpu_total_gib=gpu_total_gib(req.gpu, total), tp=req.tp, pp=req.pp, device=req.device,
        gpu_memory_utilization=req.gpu_memory_utilization, target_concurrency=req.target_concurrency,
        risk_quantile=req.risk_quantile, headroom_fraction=req.headroom_fraction, max_num_batched_tokens=req.max_num_batched_tokens,
        weights_bytes=weights, activation_gib=req.activation_gib, non_torch_gib=req.non_torch_gib,
        cudagraph_gib=req.cudagraph_gib, calibration=calibration, model_ref=_model_ref(req.config, req.model_dir))


def _read_model(raw: dict[str, Any], req: PlanRequest, kv_cache_dtype: str) -> ModelKV:
    return read_model(raw, tp=req.tp, kv_cache_dtype=kv_cache_dtype, draft_layers=req.draft_layers,
                      num_speculative_tokens=req.num_speculative_tokens, speculative_method=req.speculative_method)


def run_plan(req: PlanRequest) -> dict[str, Any]:
    if req.max_model_len < 1:
        raise BadInputError(f"--max-model-len must be >= 1, got {req.max_model_len}")
    if req.distinct_prefixes < 0 or req.prefix_tokens < 0:
        raise BadInputError("--distinct-prefixes and --prefix-tokens must be >= 0")
    if req.host_memory_gib is not None and not 0 <= req.host_memory_gib <= MAX_GIB:
        raise BadInputError(f"--host-memory-gib must be in [0, {MAX_GIB:.0f}], got {req.host_memory_gib}")
    raw = load_config(req.config)
    model = _read_model(raw, req, req.kv_cache_dtype)
    fp8 = None
    if req.kv_cache_dtype in ("auto", "bfloat16", "float16") and not model.use_mla:
        fp8 = _read_model(raw, req, "fp8")
    work = _workload(req)
    flags = SizingFlags(max_model_len=req.max_model_len, pp_layer_partition=parse_pp_layer_partition(req.pp_layer_partition))
    plan: dict[str, Any] = make_plan(model, flags, _inputs(req, raw), work, req.gpu, fp8)
    plan["weights_source"] = "safetensors headers" if req.model_dir else "estimate from config.json"
    if req.model_dir is None and not plan["non_kv_sources"]["weights_gib"].startswith("calibration"):
        plan["notes"].append("weights estimated from config.json (dense formula); pass --model-dir for the "
                             "exact safetensors bytes")
    if req.draft_layers:
        plan["notes"].append(f"KV sized with {req.draft_layers} drafter layer(s): serve with your "
                             "--speculative-config (method mtp/eagle) so vLLM builds them")
    cap = plan["capacity"]
    plan["offload"] = recommend_offload(OffloadInputs(
        distinct_prefixes=req.distinct_prefixes, prefix_tokens=req.prefix_tokens,
        kv_bytes_per_token_per_rank=model.kv_bytes_per_token, ranks=req.tp,
        gpu_kv_bytes=int(cap["available_kv_bytes"]), host_memory_gib=req.host_memory_gib,
        chunk_tokens=offload_chunk_tokens(int(cap["block_size"]))))
    plan["kvops_yaml"] = kvops_settings(plan)
    plan["serve"] = serve_command(_model_ref(req.config, req.model_dir), plan)
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

        cap = plan["capacity"]
        header = [f"# kvops.yaml from `kvops plan` — serve with:\n#   {plan['serve']}",
                  *(f"# {key}: {plan[key]}" for key in ("gpu_memory_utilization", "max_num_seqs", "max_model_len",
                                                         "max_num_batched_tokens", "kv_cache_dtype")),
                  f"# expected: num_blocks {cap['num_blocks']}, block_size {cap['block_size']}, "
                  f"KV cache size {cap['kv_cache_size_tokens']} tokens (check with kvops verify)"]
        offload = plan["kvops_yaml"].get("offload")
        if offload:
            header.append("# offload: start `kvops offload serve --config kvops.yaml` first"
                          + ("; set disk_path to your disk tier directory" if "disk_path" in offload else ""))
        return "\n".join(header) + "\n" + str(yaml.safe_dump(plan["kvops_yaml"], sort_keys=False))
    rows = explain(plan)
    width = max(len(r[0]) for r in rows)
    lines = [f"{q:<{width}}  {v:>18}  {why}" for q, v, why in rows]
    return "\n".join([*lines, "", plan["serve"]])
