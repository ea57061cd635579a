"""The planner: a ``kvops plan`` request in, one typed Plan out (kvops.core.plan).

``run_plan`` resolves the command line (model config, workload, GPU, calibration, weights) into
PlanInputs; ``make_plan`` sizes the KV pool as vLLM 0.32 will (kvops.ops.capacity.allocator),
derives max_num_seqs, gpu_memory_utilization and the offload advice, and writes the kvops.yaml
and the ``vllm serve`` line (kvops.ops.capacity.outputs). The non-KV memory terms live in
kvops.ops.capacity.memory; turning a Plan into text lives in kvops.ops.capacity.render.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.kv_dtypes import kv_dtype, parse_skip_layers
from kvops.core.offload.costs import OffloadCosts
from kvops.core.plan import Fp8Alternative, MaxNumSeqsWhy, Plan, PlanSizing, WorkloadSummary
from kvops.core.trace.read import Trace, read_trace
from kvops.core.trace.reuse import ReuseProfile
from kvops.ops.capacity.activation import activation_shape
from kvops.ops.capacity.allocator import (
    KVCapacity,
    SizingFlags,
    check_context,
    kv_capacity,
    parse_pp_layer_partition,
)
from kvops.ops.capacity.calibration import MAX_GIB, load_calibration
from kvops.ops.capacity.constants import (
    CPU_SERVER_BATCH_DEFAULTS,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GIB,
    SERVER_BATCH_DEFAULTS,
)
from kvops.ops.capacity.memory import (
    WEIGHTS_ESTIMATED,
    WEIGHTS_FROM_HEADERS,
    PlanInputs,
    check_calibration,
    device_total_gib,
    non_kv_terms,
    safetensors_bytes,
    terms_notes,
)
from kvops.ops.capacity.model import ModelKV, load_config, model_dtype, read_model, text_config
from kvops.ops.capacity.offload import OffloadInputs, recommend_offload
from kvops.ops.capacity.outputs import kvops_settings, offload_chunk_tokens, serve_command
from kvops.ops.capacity.quantization import weight_format
from kvops.ops.capacity.scales_advice import read_scales, request_with_advice, with_scales
from kvops.ops.capacity.tiers import (
    machine_costs,
    prefix_curves,
    resolve_costs,
    trace_curves,
    with_offload_decision,
)
from kvops.ops.capacity.trace import trace_profile, trace_workload, with_trace
from kvops.ops.capacity.weights import beyond_checkpoint, prefill_flops_per_token, stage_weights
from kvops.ops.capacity.workload import Workload, from_file, from_quantiles, parse_quantile


@dataclass(frozen=True)
class PlanRequest:
    """Everything ``kvops plan`` was given, one field per option (None: not given).

    The field names are the command's parameter names, so the CLI hands its parsed options over
    as they are; a new option is one field here and one line in ops/cli/capacity.py.
    """

    config: Path
    max_model_len: int
    # model
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: str | None = None  # layer indices / sliding_window kept at the model dtype
    draft_layers: int = 0
    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    model_dir: Path | None = None
    quantization: str | None = None  # vllm serve --quantization (a bf16 checkpoint quantized while loading)
    dtype: str | None = None  # vllm serve --dtype (auto: the checkpoint's, float32 served as bfloat16)
    kv_scales: Path | None = None  # a kvops calibrate scales file: loaded by kvops.yaml, its skip advice sized
    # device
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None  # VLLM_PP_LAYER_PARTITION
    device: str = "cuda"
    memory_gib: float | None = None  # --device cpu: the host's memory (default: MemAvailable)
    # workload
    p50: int | None = None
    p95: int | None = None
    p99: int | None = None
    lengths_file: Path | None = None
    risk_quantile: str = "p95"
    headroom: float = 0.0
    target_concurrency: int | None = None
    # memory
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    calibration: Path | None = None
    # offload
    distinct_prefixes: int = 0
    prefix_tokens: int = 0
    host_memory_gib: float | None = None
    # a production trace (kvops.core.trace): the workload and the offload sizing from it
    trace: Path | None = None
    target_hit_fraction: float = 0.9
    # whether offload pays (kvops.ops.capacity.tiers); neither given: not judged
    offload_mode: str | None = None  # auto | engine_driven | lmcache_driven
    offload_costs: Path | None = None  # the JSON of `kvops bench offload --json`
    # output
    kvops_yaml_path: str = "kvops.yaml"
    """The kvops.yaml as the serve line names it (an absolute path once --out-dir wrote it)."""


def run_plan(req: PlanRequest) -> Plan:
    """The plan for one request; bad input exits 2 naming the option."""
    if req.max_model_len < 1:
        raise BadInputError(f"--max-model-len must be >= 1, got {req.max_model_len}")
    if req.distinct_prefixes < 0 or req.prefix_tokens < 0:
        raise BadInputError("--distinct-prefixes and --prefix-tokens must be >= 0")
    if not 0 < req.target_hit_fraction <= 1:  # NaN fails too
        raise BadInputError(f"--target-hit-fraction must be in (0, 1], got {req.target_hit_fraction}")
    if req.host_memory_gib is not None and not 0 <= req.host_memory_gib <= MAX_GIB:
        raise BadInputError(f"--host-memory-gib must be in [0, {MAX_GIB:.0f}], got {req.host_memory_gib}")
    raw = load_config(req.config)
    scales = read_scales(req.kv_scales, req.kv_cache_dtype, raw) if req.kv_scales is not None else None
    given_skips = req.kv_cache_dtype_skip_layers
    if scales is not None:
        req = request_with_advice(req, scales)
    model = _read_model(raw, req, req.kv_cache_dtype)
    check_context(model, req.max_model_len)
    fp8 = None
    if not kv_dtype(req.kv_cache_dtype).quantized and not model.use_mla and kv_dtype("fp8").runs_on(req.device):
        fp8 = _read_model(raw, req, "fp8")
    trace = read_trace(req.trace) if req.trace is not None else None
    over = 0
    if trace is not None:
        if req.lengths_file is not None or any(q is not None for q in (req.p50, req.p95, req.p99)):
            raise BadInputError("give either --trace or --lengths-file/--p50/--p95/--p99, not both")
        if req.distinct_prefixes or req.prefix_tokens:
            raise BadInputError("--trace sizes offload from the trace's own reuse: drop "
                                "--distinct-prefixes/--prefix-tokens")
        work, over = trace_workload(trace, req.max_model_len)
        parse_quantile(req.risk_quantile)
        work.length_at(req.risk_quantile)
    else:
        work = _workload(req)
    judge = req.offload_mode is not None or req.offload_costs is not None
    costs = resolve_costs(req.offload_mode, req.offload_costs, req.device) if judge else None
    inputs = _inputs(req, raw)
    plan = make_plan(model, inputs, work, fp8)
    kv_bytes = model.kv_bytes_per_token * req.tensor_parallel_size  # cache sizes for all ranks
    profile = trace_profile(trace) if trace is not None and judge else None
    if trace is not None:
        plan = with_trace(plan, trace, over, kv_bytes, req.target_hit_fraction, req.host_memory_gib, profile)
    if costs is not None:
        plan = _decide_offload(req, plan, costs, kv_bytes, prefill_flops_per_token(raw), trace, profile,
                               inputs.weights_rank_bytes)
    if scales is not None and req.kv_scales is not None:
        plan = with_scales(plan, raw, scales, req.kv_scales, given_skips)
    return plan


def _decide_offload(req: PlanRequest, plan: Plan, costs: tuple[OffloadCosts, str], kv_bytes: int,
                    flops_per_token: float, trace: Trace | None, profile: ReuseProfile | None,
                    weight_bytes: int | None) -> Plan:
    """``--offload-mode``/``--offload-costs``: whether the sized tiers pay (kvops.ops.capacity.tiers)."""
    if trace is not None and profile is not None:
        curves = trace_curves(profile, trace.block_tokens, trace.path.name)
    else:
        curves = prefix_curves(req.distinct_prefixes, req.prefix_tokens, plan.workload.mean,
                               plan.capacity.block_size, offload_chunk_tokens(plan.capacity.block_size))
    explicit = req.offload_mode not in (None, "auto") or req.offload_costs is not None
    mean = plan.workload.mean
    hit_tokens = min(req.prefix_tokens, mean) if trace is None and req.prefix_tokens else mean
    scaled = machine_costs(costs[0], req.offload_costs is not None, req.device, kv_bytes, flops_per_token, hit_tokens,
                           weight_bytes)
    return with_offload_decision(plan, curves, scaled, costs[1], kv_bytes, explicit, req.kvops_yaml_path)


def _workload(req: PlanRequest) -> Workload:
    if req.lengths_file is not None:
        if any(q is not None for q in (req.p50, req.p95, req.p99)):
            raise BadInputError("give either --lengths-file or --p50/--p95/--p99, not both")
        work = from_file(req.lengths_file, req.max_model_len)
    else:
        work = from_quantiles(req.max_model_len, req.p50, req.p95, req.p99)
    parse_quantile(req.risk_quantile)
    work.length_at(req.risk_quantile)  # fails early for a quantile the input cannot answer
    return work


def _inputs(req: PlanRequest, raw: dict[str, Any]) -> PlanInputs:
    if req.gpu_memory_utilization is not None and not 0 < req.gpu_memory_utilization <= 1:
        raise BadInputError(f"--gpu-memory-utilization {req.gpu_memory_utilization} must be in (0, 1]")
    if not 0 <= req.headroom <= 0.9:
        raise BadInputError(f"--headroom must be in [0, 0.9], got {req.headroom}")
    if req.target_concurrency is not None and req.target_concurrency < 1:
        raise BadInputError(f"--target-concurrency must be >= 1, got {req.target_concurrency}")
    calibration = load_calibration(req.calibration) if req.calibration else None
    total, total_source = device_total_gib(req.device, req.gpu, req.gpu_memory_gib, req.memory_gib,
                                           calibration)
    weights, weights_source = _weights(req, raw)
    return PlanInputs(
        gpu_total_gib=total, device_total_source=total_source, kvops_yaml_path=req.kvops_yaml_path,
        tp=req.tensor_parallel_size, pp=req.pipeline_parallel_size,
        device=req.device, gpu=req.gpu, gpu_memory_utilization=req.gpu_memory_utilization,
        target_concurrency=req.target_concurrency, risk_quantile=req.risk_quantile, headroom_fraction=req.headroom,
        max_num_batched_tokens=req.max_num_batched_tokens,
        pp_layer_partition=parse_pp_layer_partition(req.pp_layer_partition), weights_rank_bytes=weights,
        activation=activation_shape(raw, model_dtype(text_config(raw), req.dtype), req.tensor_parallel_size,
                                    req.pipeline_parallel_size, req.gpu if req.device == "cuda" else None),
        weights_source=weights_source,
        activation_gib=req.activation_gib, non_torch_gib=req.non_torch_gib, cudagraph_gib=req.cudagraph_gib,
        calibration=calibration, model_ref=_model_ref(req.config, req.model_dir), draft_layers=req.draft_layers,
        distinct_prefixes=req.distinct_prefixes, prefix_tokens=req.prefix_tokens,
        host_memory_gib=req.host_memory_gib)


def _weights(req: PlanRequest, raw: dict[str, Any]) -> tuple[int, str]:
    """One rank's weights: the safetensors headers split evenly, or counted from config.json as
    vLLM shards them (the largest pipeline stage: vLLM sizes every rank's cache alike)."""
    ranks = req.tensor_parallel_size * req.pipeline_parallel_size
    if req.model_dir and req.quantization is not None:
        raise BadInputError("--quantization with --model-dir: the safetensors headers already hold the "
                            "checkpoint's bytes; drop --quantization")
    checkpoint = safetensors_bytes(req.model_dir) // ranks if req.model_dir else None
    cfg, cuda = text_config(raw), req.device == "cuda"
    fmt = weight_format(cfg.get("quantization_config"), req.quantization, req.gpu if cuda else None)
    dtype = model_dtype(cfg, req.dtype)
    shape = (req.tensor_parallel_size, req.pipeline_parallel_size, parse_pp_layer_partition(req.pp_layer_partition))
    if checkpoint is not None:
        rotary, rounding = beyond_checkpoint(raw, dtype, fmt, *shape, cuda=cuda)
        extra = f" + rotary cos/sin caches {rotary / GIB:.3f} GiB" if rotary else ""
        extra += (f" + the CUDA caching allocator's rounding of each large tensor {rounding / GIB:.3f} GiB "
                  "(shapes from config.json)" if cuda else "")
        return checkpoint + rotary + rounding, WEIGHTS_FROM_HEADERS + extra
    weights = stage_weights(raw, dtype, fmt, *shape, cuda=cuda)
    return weights.max_bytes, f"{WEIGHTS_ESTIMATED} ({fmt.source if fmt else dtype})"


def _read_model(raw: dict[str, Any], req: PlanRequest, kv_cache_dtype: str) -> ModelKV:
    return read_model(raw, tp=req.tensor_parallel_size, kv_cache_dtype=kv_cache_dtype, dtype=req.dtype,
                      draft_layers=req.draft_layers, num_speculative_tokens=req.num_speculative_tokens,
                      speculative_method=req.speculative_method,
                      skip_layers=parse_skip_layers(req.kv_cache_dtype_skip_layers), device=req.device)


def _model_ref(config: Path, model_dir: Path | None) -> str:
    """What to pass to vllm serve: the model dir, else the config's dir, else org/name from the file."""
    if model_dir is not None:
        return str(model_dir)
    if config.is_dir() or config.name == "config.json":
        return str(config if config.is_dir() else config.parent)
    return config.stem.replace("--", "/", 1)


def default_batch(total_gib: float, gpu: str | None, device: str = "cuda", world: int = 1) -> tuple[int, int]:
    """vLLM's (max_num_seqs, max_num_batched_tokens) defaults for the OpenAI server."""
    if device == "cpu":
        return CPU_SERVER_BATCH_DEFAULTS[0] * world, CPU_SERVER_BATCH_DEFAULTS[1] * world
    for min_gib, not_a100, seqs, mnbt in SERVER_BATCH_DEFAULTS:
        if total_gib >= min_gib and not (not_a100 and (gpu or "").upper().startswith("A100")):
            return seqs, mnbt
    return 256, 2048


def request_blocks(cap: KVCapacity, flags: SizingFlags, tokens: int) -> int:
    """Blocks one request of ``tokens`` tokens holds, summed over every KV cache group (a
    sliding-window group stops growing at its window). Not ``core.admission.policy.
    blocks_for_tokens``, which is one group's ceiling division."""
    probe = replace(flags, max_model_len=max(1, min(tokens, flags.max_model_len)))
    return sum(g.spec.blocks_per_request(probe) for g in cap.groups)


def derive_max_num_seqs(
    cap: KVCapacity, flags: SizingFlags, work: Workload, risk: str, mnbt: int, default_seqs: int,
    headroom: float = 0.0,
) -> tuple[int, MaxNumSeqsWhy]:
    """Requests of the risk-quantile length that fit in the usable pool, then vLLM's caps.

    Returns the value and every number behind it: how many risk-quantile requests fit, the
    caps (vLLM's default for this device, which the CUDA-graph estimate assumed; the scheduler
    rule max_num_batched_tokens >= max_num_seqs, config/scheduler.py:328; for mamba hybrids
    the mamba-block rule, config/compilation.py:1503-1524), and the rounding to a capture size.
    """
    usable = cap.num_blocks - 1  # block 0 is the null block (v1/core/block_pool.py)
    budget = math.floor(usable * (1 - headroom))
    length = work.length_at(risk)
    per_request = request_blocks(cap, flags, length)
    fit = budget // per_request
    caps = {"vllm_default": default_seqs, "max_num_batched_tokens": mnbt}
    if any(g.kind == "mamba" for g in cap.groups):
        caps["mamba_blocks"] = cap.num_blocks
    binding = min(caps, key=lambda k: caps[k])
    seqs = max(1, min(fit, caps[binding]))
    step = 8 if seqs <= 256 else 16  # CUDA graph capture sizes step (config/vllm.py)
    rounded = seqs // step * step if seqs >= step else seqs
    mean_blocks = request_blocks(cap, flags, math.ceil(work.mean()))
    return rounded, MaxNumSeqsWhy(
        risk_quantile=risk, length_at_quantile=length, blocks_per_request_at_quantile=per_request,
        usable_blocks=usable, headroom_fraction=headroom, budget_blocks=budget, fit_at_quantile=fit, caps=caps,
        binding="fit_at_quantile" if fit <= caps[binding] else binding, rounded_to_capture_step=step,
        mean_length=work.mean(), mean_load_concurrency=usable // mean_blocks,
    )


def _solve_util(model: ModelKV, flags: SizingFlags, inp: PlanInputs, work: Workload, nonkv_bytes: int) -> float:
    util = inp.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if inp.target_concurrency:
        probe = kv_capacity(model, 1 << 62, flags)
        blocks = inp.target_concurrency * request_blocks(probe, flags, work.length_at(inp.risk_quantile))
        need = probe.bytes_per_block * (math.ceil(blocks / (1 - inp.headroom_fraction)) + 1)
        util = math.ceil((nonkv_bytes + need) / (inp.gpu_total_gib * GIB) * 100) / 100
    if not 0 < util <= 1:
        raise BadInputError(f"gpu_memory_utilization {util:.2f} is outside (0, 1]: the target does not fit this GPU")
    return util


def make_plan(model: ModelKV, inp: PlanInputs, work: Workload, fp8_model: ModelKV | None = None) -> Plan:
    """The whole plan, built once: sizing, offload advice, kvops.yaml and the serve line."""
    notes = check_calibration(inp)
    default_seqs, default_mnbt = default_batch(inp.gpu_total_gib, inp.gpu, inp.device, inp.tp * inp.pp)
    mnbt = inp.max_num_batched_tokens or default_mnbt
    flags = SizingFlags(max_model_len=work.max_model_len, device=inp.device, max_num_batched_tokens=mnbt,
                        pipeline_parallel_size=inp.pp, pp_layer_partition=inp.pp_layer_partition)
    nonkv, sources = non_kv_terms(inp, default_seqs, mnbt)
    nonkv_bytes = math.ceil(nonkv.total() * GIB)
    util = _solve_util(model, flags, inp, work, nonkv_bytes)
    available = math.ceil(inp.gpu_total_gib * GIB * util) - nonkv_bytes
    if available <= 0:
        raise BadInputError(f"non-KV memory {nonkv_bytes / GIB:.2f} GiB exceeds {util:.2f} of {inp.gpu_total_gib} GiB; "
                            "raise --tensor-parallel-size or use a larger GPU")
    cap = kv_capacity(model, available, flags)
    seqs, why = derive_max_num_seqs(cap, flags, work, inp.risk_quantile, mnbt, default_seqs, inp.headroom_fraction)
    notes += [*cap.notes, *_input_notes(inp, sources.weights_gib), *terms_notes(inp, sources)]
    capacity = cap.summary()
    sizing = PlanSizing(
        device=inp.device, gpu_total_gib=inp.gpu_total_gib, tensor_parallel_size=inp.tp,
        pipeline_parallel_size=inp.pp, pp_layer_partition=inp.pp_layer_partition or None,
        gpu_memory_utilization=util, max_num_seqs=seqs, max_num_seqs_why=why, max_model_len=work.max_model_len,
        max_num_batched_tokens=mnbt, kv_cache_dtype=model.kv_dtype, kv_cache_dtype_skip_layers=model.skip_layers,
        non_kv=nonkv, non_kv_sources=sources,
        available_kv_gib=available / GIB, capacity=capacity,
        workload=WorkloadSummary(source=work.source, p50=work.p50, p95=work.p95, p99=work.p99, mean=work.mean(),
                                 risk_quantile=inp.risk_quantile,
                                 blocks_per_request_at_quantile=why.blocks_per_request_at_quantile),
        fp8_alternative=_fp8_alternative(fp8_model, available, flags, cap),
        calibration=inp.calibration.source if inp.calibration else None, notes=tuple(notes))
    offload = recommend_offload(OffloadInputs(
        distinct_prefixes=inp.distinct_prefixes, prefix_tokens=inp.prefix_tokens,
        kv_bytes_per_token_per_rank=model.kv_bytes_per_token, ranks=inp.tp,
        gpu_kv_bytes=capacity.available_kv_bytes, host_memory_gib=inp.host_memory_gib,
        chunk_tokens=offload_chunk_tokens(capacity.block_size)))
    return Plan(**dict(sizing), weights_source=inp.weights_source, offload=offload,
                kvops_yaml=kvops_settings(sizing, offload),
                serve=serve_command(inp.model_ref, sizing, inp.kvops_yaml_path))


def _input_notes(inp: PlanInputs, weights_source: str) -> list[str]:
    notes = []
    if inp.device_total_source:
        notes.append(f"device memory {inp.gpu_total_gib:.2f} GiB: {inp.device_total_source}")
    if not inp.weights_source.startswith(WEIGHTS_FROM_HEADERS) and not weights_source.startswith("calibration"):
        rounding = ", with the CUDA caching allocator's rounding of each large tensor" if inp.device == "cuda" else ""
        notes.append(f"weights {inp.weights_source}: counted per rank as vLLM shards them{rounding}; pass "
                     "--model-dir for the safetensors bytes")
    if inp.draft_layers:
        notes.append(f"KV sized with {inp.draft_layers} drafter layer(s): serve with your "
                     "--speculative-config (method mtp/eagle) so vLLM builds them")
    return notes


def _fp8_alternative(fp8_model: ModelKV | None, available: int, flags: SizingFlags,
                     cap: KVCapacity) -> Fp8Alternative | None:
    """The same KV bytes with fp8 KV: what --kv-cache-dtype fp8 would hold."""
    if fp8_model is None:
        return None
    fcap = kv_capacity(fp8_model, available, flags)
    return Fp8Alternative(kv_cache_dtype=fp8_model.kv_dtype, kv_cache_size_tokens=fcap.kv_cache_size_tokens,
                          max_concurrency=fcap.max_concurrency, num_blocks=fcap.num_blocks,
                          capacity_ratio=fcap.kv_cache_size_tokens / max(1, cap.kv_cache_size_tokens))
