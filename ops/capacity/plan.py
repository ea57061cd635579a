"""GPU + model + workload → vLLM serve flags, with every number explained.

KV bytes come from vLLM 0.32's own formula (gpu_worker.py): ``ceil(total × util) − weights −
activation peak − non-torch − CUDA-graph estimate``. Weights are read from safetensors headers
when a model directory is given; the other non-KV terms are documented defaults
(constants.py), overridable, or taken from a calibration file written by ``kvops verify``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvops.ops.capacity.allocator import KVCapacity, SizingFlags, kv_capacity
from kvops.ops.capacity.calibration import MAX_GIB, Calibration
from kvops.ops.capacity.constants import (
    ACTIVATION_PEAK_GIB_PER_8K_TOKENS,
    CPU_SERVER_BATCH_DEFAULTS,
    CUDA_GRAPH_GIB_PER_CAPTURE_SIZE,
    CUDA_GRAPH_MAX_CAPTURE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GIB,
    GPU_CATALOG_GIB,
    MODEL_DTYPE_BYTES,
    NON_TORCH_GIB,
    SERVER_BATCH_DEFAULTS,
    VLLM_VERSION,
)
from kvops.ops.capacity.model import ModelKV, text_config
from kvops.ops.capacity.workload import Workload
from kvops.ops.errors import BadInputError

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class PlanInputs:
    gpu_total_gib: float
    tp: int = 1
    pp: int = 1
    device: str = "cuda"
    gpu_memory_utilization: float | None = None
    target_concurrency: int | None = None
    risk_quantile: str = "p95"
    headroom_fraction: float = 0.0  # KV blocks kept free beyond max_num_seqs risk-quantile requests
    max_num_batched_tokens: int | None = None
    weights_bytes: int | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    calibration: Calibration | None = None
    model_ref: str | None = None  # what vllm serve gets; matches Calibration.model for the same model


def gpu_total_gib(name: str | None, gib: float | None) -> float:
    if gib is not None:
        if not 0 < gib <= MAX_GIB:
            raise BadInputError(f"--gpu-memory-gib must be in (0, {MAX_GIB:.0f}], got {gib}")
        return gib
    key = (name or "H100").upper()
    if key not in GPU_CATALOG_GIB:
        raise BadInputError(f"--gpu {name!r} not in the catalog ({', '.join(GPU_CATALOG_GIB)}); "
                            "pass --gpu-memory-gib with the total CUDA reports")
    return float(GPU_CATALOG_GIB[key])


def safetensors_bytes(model_dir: Path) -> int:
    """Σ tensor bytes from every *.safetensors header (8-byte length + JSON), no data read."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"{model_dir}: no *.safetensors files; drop --model-dir to estimate from config")
    total = 0
    for file in files:
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            total += sum(math.prod(info["shape"]) * _SAFETENSORS_BYTES.get(info["dtype"], 2)
                         for name, info in header.items() if name != "__metadata__")
        except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadInputError(f"{file}: not a readable safetensors header ({exc})") from None
    return total


def estimate_weights_bytes(raw: dict[str, Any], dtype: str) -> int:
    """Dense decoder estimate from config (MoE: all experts); exact needs --model-dir."""
    cfg = text_config(raw)
    h, n = int(cfg.get("hidden_size") or 0), int(cfg.get("num_hidden_layers") or 0)
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * h)
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 1)
    vocab = int(cfg.get("vocab_size") or 0)
    params = n * (4 * h * h + 3 * h * inter * experts) + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return params * int(MODEL_DTYPE_BYTES[dtype])


def capture_sizes(max_num_seqs: int) -> int:
    """How many CUDA graphs vLLM captures (config/vllm.py): [1,2,4] + 8..248 step 8 + 256.. step 16."""
    top = min(2 * max_num_seqs, CUDA_GRAPH_MAX_CAPTURE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, min(top, 255) + 1, 8))
    return len(sizes) + len(range(256, top + 1, 16))


def default_batch(total_gib: float, gpu: str | None, device: str = "cuda", world: int = 1) -> tuple[int, int]:
    """vLLM's (max_num_seqs, max_num_batched_tokens) defaults for the OpenAI server."""
    if device == "cpu":
        return CPU_SERVER_BATCH_DEFAULTS[0] * world, CPU_SERVER_BATCH_DEFAULTS[1] * world
    for min_gib, not_a100, seqs, mnbt in SERVER_BATCH_DEFAULTS:
        if total_gib >= min_gib and not (not_a100 and (gpu or "").upper().startswith("A100")):
            return seqs, mnbt
    return 256, 2048


def _check_calibration(inp: PlanInputs) -> list[str]:
    """A calibration from another device is refused; other mismatches are noted."""
    cal = inp.calibration
    if cal is None:
        return []
    if cal.device != inp.device:
        raise BadInputError(f"--calibration was measured on {cal.device}, the plan is for --device {inp.device}; "
                            "calibrate against a server on the same device")
    notes = []
    if cal.vllm_version.split("+")[0] != VLLM_VERSION:
        notes.append(f"calibration is from vLLM {cal.vllm_version}, the planner models {VLLM_VERSION}")
    if (cal.tensor_parallel_size, cal.pipeline_parallel_size) != (inp.tp, inp.pp):
        notes.append(f"calibration ran at TP{cal.tensor_parallel_size}/PP{cal.pipeline_parallel_size}; "
                     "non-torch memory depends on it")
    if cal.includes_weights:
        notes.append(f"calibration non-KV {cal.non_kv_gib} GiB is one lump (weights included): "
                     f"valid for the model it measured ({cal.model})")
    return notes


def non_kv_terms(inp: PlanInputs, max_num_seqs: int, mnbt: int) -> tuple[dict[str, float], dict[str, str]]:
    """(GiB per term, where each came from): command line > calibration file > default."""
    cal = inp.calibration
    if cal is not None and cal.includes_weights:
        # CPU worker: vLLM measured one RSS figure for weights + activations + runtime.
        terms = {"weights_gib": 0.0, "activation_gib": inp.activation_gib or 0.0,
                 "non_torch_gib": cal.non_kv_gib, "cudagraph_gib": inp.cudagraph_gib or 0.0}
        sources = {"weights_gib": "inside the calibrated non-KV lump",
                   "activation_gib": "--activation-gib" if inp.activation_gib else "inside the calibrated lump",
                   "non_torch_gib": f"calibration ({cal.source}): all non-KV memory the worker held"
                   + (f" at max_num_batched_tokens {cal.max_num_batched_tokens} (not rescaled: one lump)"
                      if cal.max_num_batched_tokens not in (None, mnbt) else ""),
                   "cudagraph_gib": "--cudagraph-gib" if inp.cudagraph_gib else "none on this device"}
        return terms, sources
    cal_source = f"calibration ({cal.source})" if cal else ""
    defaults = {
        "activation_gib": (ACTIVATION_PEAK_GIB_PER_8K_TOKENS * mnbt / 8192,
                           f"default {ACTIVATION_PEAK_GIB_PER_8K_TOKENS} GiB per 8192 batched tokens (v0.19 H100)"),
        "non_torch_gib": (NON_TORCH_GIB[inp.tp * inp.pp > 1], "default by TP (v0.19 H100: NCCL/custom all-reduce)"),
        "cudagraph_gib": ((CUDA_GRAPH_GIB_PER_CAPTURE_SIZE * capture_sizes(max_num_seqs), "default per capture size "
                           f"({capture_sizes(max_num_seqs)} graphs at max_num_seqs {max_num_seqs})")
                          if inp.device == "cuda" else (0.0, "no CUDA graphs on cpu")),
    }
    terms = {"weights_gib": (inp.weights_bytes or 0) / (inp.tp * inp.pp) / GIB}
    sources = {"weights_gib": "model bytes / (TP × PP)"}
    if cal is not None and cal.weights_gib is not None and cal.model == inp.model_ref:
        terms["weights_gib"], sources["weights_gib"] = cal.weights_gib, f"{cal_source}, same model"
    for key, (default, why) in defaults.items():
        given, measured = getattr(inp, key), getattr(cal, key, None) if cal else None
        if given is not None:
            if not 0 <= given <= MAX_GIB:
                raise BadInputError(f"--{key[:-4].replace('_', '-')}-gib must be in [0, {MAX_GIB:.0f}], got {given}")
            terms[key], sources[key] = given, f"--{key[:-4].replace('_', '-')}-gib"
        elif measured is not None and key == "activation_gib":
            terms[key], sources[key] = scaled_activation(measured, cal, cal_source, mnbt)
        elif measured is not None:
            terms[key], sources[key] = measured, cal_source
        else:
            terms[key], sources[key] = default, why
    return terms, sources


def scaled_activation(measured: float, cal: Calibration | None, source: str, mnbt: int) -> tuple[float, str]:
    """A calibrated activation peak at the plan's max_num_batched_tokens.

    Assumption: the profile run's peak grows linearly with the tokens it batches (its dummy batch
    is max_num_batched_tokens tokens, v1/worker/gpu_model_runner.py profile_run; planner.md §3.5
    item 8). The sampler warm-up rows (min(max_num_seqs, mnbt) × vocab × 4 B) scale with the same
    ratio here, an overestimate when only max_num_batched_tokens grew.
    """
    measured_at = cal.max_num_batched_tokens if cal else None
    if measured_at is None:
        return measured, f"{source}; the calibration recorded no max_num_batched_tokens, so not rescaled"
    if measured_at == mnbt:
        return measured, source
    return measured * mnbt / measured_at, (f"{source}: {measured:.3f} GiB at max_num_batched_tokens {measured_at} "
                                           f"× {mnbt}/{measured_at} (peak assumed ∝ batched tokens)")


def blocks_for_tokens(cap: KVCapacity, flags: SizingFlags, tokens: int) -> int:
    probe = replace(flags, max_model_len=max(1, min(tokens, flags.max_model_len)))
    return sum(g.spec.blocks_per_request(probe) for g in cap.groups)


def derive_max_num_seqs(
    cap: KVCapacity, flags: SizingFlags, work: Workload, risk: str, mnbt: int, default_seqs: int,
    headroom: float = 0.0,
) -> tuple[int, dict[str, Any]]:
    """Requests of the risk-quantile length that fit in the usable pool, then vLLM's caps.

    Returns the value and every number behind it: how many risk-quantile requests fit, the
    caps (vLLM's default for this device, which the CUDA-graph estimate assumed; the scheduler
    rule max_num_batched_tokens >= max_num_seqs, config/scheduler.py:328; for mamba hybrids
    the mamba-block rule, config/compilation.py:1503-1524), and the rounding to a capture size.
    """
    usable = cap.num_blocks - 1  # block 0 is the null block (v1/core/block_pool.py)
    budget = math.floor(usable * (1 - headroom))
    length = work.length_at(risk)
    per_request = blocks_for_tokens(cap, flags, length)
    fit = budget // per_request
    caps = {"vllm_default": default_seqs, "max_num_batched_tokens": mnbt}
    if any(g.kind == "mamba" for g in cap.groups):
        caps["mamba_blocks"] = cap.num_blocks
    binding = min(caps, key=lambda k: caps[k])
    seqs = max(1, min(fit, caps[binding]))
    step = 8 if seqs <= 256 else 16  # CUDA graph capture sizes step (config/vllm.py)
    rounded = seqs // step * step if seqs >= step else seqs
    mean_blocks = blocks_for_tokens(cap, flags, math.ceil(work.mean()))
    return rounded, {
        "risk_quantile": risk, "length_at_quantile": length, "blocks_per_request_at_quantile": per_request,
        "usable_blocks": usable, "headroom_fraction": headroom, "budget_blocks": budget,
        "fit_at_quantile": fit, "caps": caps,
        "binding": "fit_at_quantile" if fit <= caps[binding] else binding,
        "rounded_to_capture_step": step, "mean_length": work.mean(),
        "mean_load_concurrency": usable // mean_blocks,
    }


def _solve_util(model: ModelKV, flags: SizingFlags, inp: PlanInputs, work: Workload, nonkv_bytes: int) -> float:
    util = inp.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if inp.target_concurrency:
        probe = kv_capacity(model, 1 << 62, flags)
        blocks = inp.target_concurrency * blocks_for_tokens(probe, flags, work.length_at(inp.risk_quantile))
        need = probe.bytes_per_block * (math.ceil(blocks / (1 - inp.headroom_fraction)) + 1)
        util = math.ceil((nonkv_bytes + need) / (inp.gpu_total_gib * GIB) * 100) / 100
    if not 0 < util <= 1:
        raise BadInputError(f"gpu_memory_utilization {util:.2f} is outside (0, 1]: the target does not fit this GPU")
    return util


def make_plan(
    model: ModelKV, flags: SizingFlags, inp: PlanInputs, work: Workload, gpu: str | None,
    fp8_model: ModelKV | None = None,
) -> dict[str, Any]:
    """The whole plan as one dict (rendered as a table, JSON or kvops.yaml by the CLI)."""
    notes = _check_calibration(inp)
    default_seqs, default_mnbt = default_batch(inp.gpu_total_gib, gpu, inp.device, inp.tp * inp.pp)
    mnbt = inp.max_num_batched_tokens or default_mnbt
    flags = replace(flags, max_num_batched_tokens=mnbt, max_model_len=work.max_model_len, device=inp.device,
                    pipeline_parallel_size=inp.pp)
    nonkv, sources = non_kv_terms(inp, default_seqs, mnbt)
    nonkv_bytes = math.ceil(sum(nonkv.values()) * GIB)
    util = _solve_util(model, flags, inp, work, nonkv_bytes)
    available = math.ceil(inp.gpu_total_gib * GIB * util) - nonkv_bytes
    if available <= 0:
        raise BadInputError(f"non-KV memory {nonkv_bytes / GIB:.2f} GiB exceeds {util:.2f} of {inp.gpu_total_gib} GiB; "
                            "raise --tensor-parallel-size or use a larger GPU")
    cap = kv_capacity(model, available, flags)
    notes += cap.notes
    seqs, seqs_why = derive_max_num_seqs(cap, flags, work, inp.risk_quantile, mnbt, default_seqs,
                                         inp.headroom_fraction)
    fp8 = None
    if fp8_model is not None:
        fcap = kv_capacity(fp8_model, available, flags)
        fp8 = {"kv_cache_dtype": fp8_model.kv_dtype, "kv_cache_size_tokens": fcap.kv_cache_size_tokens,
               "max_concurrency": fcap.max_concurrency, "num_blocks": fcap.num_blocks,
               "capacity_ratio": fcap.kv_cache_size_tokens / max(1, cap.kv_cache_size_tokens)}
    return {
        "device": inp.device, "gpu_total_gib": inp.gpu_total_gib, "tensor_parallel_size": inp.tp,
        "pipeline_parallel_size": inp.pp,
        "pp_layer_partition": list(flags.pp_layer_partition) if flags.pp_layer_partition else None,
        "gpu_memory_utilization": util, "max_num_seqs": seqs, "max_num_seqs_why": seqs_why,
        "max_model_len": work.max_model_len,
        "max_num_batched_tokens": mnbt, "kv_cache_dtype": model.kv_dtype,
        "non_kv": nonkv, "non_kv_sources": sources, "available_kv_gib": available / GIB, "capacity": cap.as_dict(),
        "workload": {"source": work.source, "p50": work.p50, "p95": work.p95, "p99": work.p99,
                     "mean": work.mean(), "risk_quantile": inp.risk_quantile,
                     "blocks_per_request_at_quantile": seqs_why["blocks_per_request_at_quantile"]},
        "fp8_alternative": fp8, "calibration": inp.calibration.source if inp.calibration else None,
        "notes": notes,
    }
