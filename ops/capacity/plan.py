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
from kvops.ops.capacity.constants import (
    ACTIVATION_PEAK_GIB_PER_8K_TOKENS,
    CUDA_GRAPH_GIB_PER_CAPTURE_SIZE,
    CUDA_GRAPH_MAX_CAPTURE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GIB,
    GPU_CATALOG_GIB,
    MODEL_DTYPE_BYTES,
    NON_TORCH_GIB,
    SERVER_BATCH_DEFAULTS,
)
from kvops.ops.capacity.model import ModelKV, text_config
from kvops.ops.errors import BadInputError

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class Workload:
    max_model_len: int
    p50: int
    p95: int
    p99: int


@dataclass(frozen=True)
class PlanInputs:
    gpu_total_gib: float
    tp: int = 1
    gpu_memory_utilization: float | None = None
    target_concurrency: int | None = None
    risk_quantile: str = "p95"
    max_num_batched_tokens: int | None = None
    weights_bytes: int | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None


def gpu_total_gib(name: str | None, gib: float | None) -> float:
    if gib is not None:
        if gib <= 0:
            raise BadInputError(f"--gpu-memory-gib must be > 0, got {gib}")
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
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"]) * _SAFETENSORS_BYTES.get(info["dtype"], 2)
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


def default_batch(total_gib: float, gpu: str | None) -> tuple[int, int]:
    for min_gib, not_a100, seqs, mnbt in SERVER_BATCH_DEFAULTS:
        if total_gib >= min_gib and not (not_a100 and (gpu or "").upper().startswith("A100")):
            return seqs, mnbt
    return 256, 2048


def non_kv_gib(inp: PlanInputs, max_num_seqs: int, mnbt: int) -> dict[str, float]:
    weights = (inp.weights_bytes or 0) / inp.tp / GIB
    act = inp.activation_gib if inp.activation_gib is not None else ACTIVATION_PEAK_GIB_PER_8K_TOKENS * mnbt / 8192
    non_torch = inp.non_torch_gib if inp.non_torch_gib is not None else NON_TORCH_GIB[inp.tp > 1]
    cg = inp.cudagraph_gib if inp.cudagraph_gib is not None else CUDA_GRAPH_GIB_PER_CAPTURE_SIZE * capture_sizes(max_num_seqs)
    return {"weights_gib": weights, "activation_gib": act, "non_torch_gib": non_torch, "cudagraph_gib": cg}


def blocks_for_tokens(cap: KVCapacity, flags: SizingFlags, tokens: int) -> int:
    probe = replace(flags, max_model_len=max(1, min(tokens, flags.max_model_len)))
    return sum(g.spec.blocks_per_request(probe) for g in cap.groups)


def derive_max_num_seqs(cap: KVCapacity, flags: SizingFlags, tokens: int, mnbt: int, hi: int) -> int:
    """Requests of the risk-quantile length that fit in the usable pool, capped and rounded."""
    fit = (cap.num_blocks - 1) // blocks_for_tokens(cap, flags, tokens)
    cap_hi = min(hi, mnbt)
    if any(g.kind == "mamba" for g in cap.groups):
        cap_hi = min(cap_hi, cap.num_blocks)  # config/compilation.py: max_num_seqs <= mamba blocks
    seqs = max(1, min(fit, cap_hi))
    step = 8 if seqs <= 256 else 16
    return int(max(1, seqs // step * step) if seqs >= step else seqs)


def make_plan(
    model: ModelKV, flags: SizingFlags, inp: PlanInputs, work: Workload, gpu: str | None,
    fp8_model: ModelKV | None = None,
) -> dict[str, Any]:
    """The whole plan as one dict (rendered as a table, JSON or kvops.yaml by the CLI)."""
    default_seqs, default_mnbt = default_batch(inp.gpu_total_gib, gpu)
    mnbt = inp.max_num_batched_tokens or default_mnbt
    flags = replace(flags, max_num_batched_tokens=mnbt, max_model_len=work.max_model_len)
    nonkv = non_kv_gib(inp, default_seqs, mnbt)
    nonkv_bytes = math.ceil(sum(nonkv.values()) * GIB)
    total_bytes = inp.gpu_total_gib * GIB
    util = inp.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if inp.target_concurrency:
        probe = kv_capacity(model, 1 << 62, flags)
        need = probe.bytes_per_block * (inp.target_concurrency * blocks_for_tokens(
            probe, flags, getattr(work, inp.risk_quantile)) + 1)
        util = math.ceil((nonkv_bytes + need) / total_bytes * 100) / 100
    if not 0 < util <= 1:
        raise BadInputError(f"gpu_memory_utilization {util:.2f} is outside (0, 1]: the target does not fit this GPU")
    available = math.ceil(total_bytes * util) - nonkv_bytes
    if available <= 0:
        raise BadInputError(f"non-KV memory {nonkv_bytes / GIB:.2f} GiB exceeds {util:.2f} of {inp.gpu_total_gib} GiB; "
                            "raise --tensor-parallel-size or use a larger GPU")
    cap = kv_capacity(model, available, flags)
    seqs = derive_max_num_seqs(cap, flags, getattr(work, inp.risk_quantile), mnbt, default_seqs)
    fp8 = None
    if fp8_model is not None:
        fcap = kv_capacity(fp8_model, available, flags)
        fp8 = {"kv_cache_dtype": fp8_model.kv_dtype, "kv_cache_size_tokens": fcap.kv_cache_size_tokens,
               "max_concurrency": fcap.max_concurrency, "num_blocks": fcap.num_blocks,
               "capacity_ratio": fcap.kv_cache_size_tokens / max(1, cap.kv_cache_size_tokens)}
    return {
        "gpu_total_gib": inp.gpu_total_gib, "tensor_parallel_size": inp.tp,
        "gpu_memory_utilization": util, "max_num_seqs": seqs, "max_model_len": work.max_model_len,
        "max_num_batched_tokens": mnbt, "kv_cache_dtype": model.kv_dtype,
        "non_kv": nonkv, "available_kv_gib": available / GIB, "capacity": cap.as_dict(),
        "workload": {"p50": work.p50, "p95": work.p95, "p99": work.p99, "risk_quantile": inp.risk_quantile,
                     "blocks_per_request_at_quantile": blocks_for_tokens(cap, flags, getattr(work, inp.risk_quantile))},
        "fp8_alternative": fp8,
        "offload": {"lmcache_cpu_gib": None, "lmcache_disk_gib": None,
                    "note": "placeholder: offload sizing lands with the offload work"},
    }


def serve_command(model_ref: str, plan: dict[str, Any]) -> str:
    """The ready ``vllm serve`` line for the plan."""
    parts = [f"vllm serve {model_ref}",
             f"--tensor-parallel-size {plan['tensor_parallel_size']}",
             f"--gpu-memory-utilization {plan['gpu_memory_utilization']:.2f}",
             f"--max-model-len {plan['max_model_len']}",
             f"--max-num-seqs {plan['max_num_seqs']}",
             f"--max-num-batched-tokens {plan['max_num_batched_tokens']}"]
    if str(plan["kv_cache_dtype"]).startswith("fp8"):
        parts.append(f"--kv-cache-dtype {plan['kv_cache_dtype']}")
    return " ".join(parts)


def explain(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(quantity, value, why) rows for the human table."""
    cap, nk = plan["capacity"], plan["non_kv"]
    dominant = max(nk, key=nk.get)
    rows = [
        ("gpu_memory_utilization", f"{plan['gpu_memory_utilization']:.2f}",
         f"of {plan['gpu_total_gib']} GiB total (as CUDA reports it)"),
        ("non-KV memory", f"{sum(nk.values()):.2f} GiB",
         ", ".join(f"{k[:-4]} {v:.2f}" for k, v in nk.items()) + f"; {dominant[:-4]} dominates"),
        ("available KV", f"{plan['available_kv_gib']:.2f} GiB", "ceil(total × util) − non-KV"),
        ("num_blocks", f"{cap['num_blocks']:,}", f"{cap['bytes_per_block']:,} B per block of {cap['block_size']} tokens"),
        ("KV cache size", f"{cap['kv_cache_size_tokens']:,} tokens",
         f"the server's log line; {cap['max_concurrency']:.2f}x at {plan['max_model_len']:,} tokens"),
        ("max_num_seqs", str(plan["max_num_seqs"]),
         f"{plan['workload']['risk_quantile']} request = {plan['workload']['blocks_per_request_at_quantile']} blocks; "
         "capped by max_num_batched_tokens and vLLM's default"),
        ("max_num_batched_tokens", str(plan["max_num_batched_tokens"]), "vLLM's default for this GPU class"),
    ]
    if plan.get("fp8_alternative"):
        f8 = plan["fp8_alternative"]
        rows.append(("with --kv-cache-dtype fp8", f"{f8['kv_cache_size_tokens']:,} tokens",
                     f"{f8['capacity_ratio']:.2f}x the capacity; check accuracy first"))
    return rows
