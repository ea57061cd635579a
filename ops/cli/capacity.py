"""``kvops kv-capacity``, ``kvops kv``, ``kvops plan``, ``kvops verify``: glue over kvops.ops.capacity."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvops.core.errors import BadInputError, CheckFailedError
from kvops.core.kv_dtypes import KV_DTYPE_NAMES
from kvops.ops.cli.options import (
    DEVICE_PANEL,
    MEMORY_PANEL,
    MODEL_PANEL,
    OFFLOAD_PANEL,
    OUTPUT_PANEL,
    WORKLOAD_PANEL,
    ConfigAlias,
    JsonOut,
    ModelConfig,
    OptionalServerUrl,
    Timeout,
    bytes_option,
    model_path,
    tokens_option,
)

# Options of the capacity commands (kv-capacity, kv, plan), grouped into --help panels.
MaxLen = Annotated[int, typer.Option(
    "--max-model-len", parser=tokens_option, metavar="TOKENS",
    help="Tokens per request (prompt + output): 32768, 32k (32,000) or 32K (32,768) as vllm serve reads them.",
    rich_help_panel=MODEL_PANEL)]
# every KV dtype vLLM 0.32 accepts (kvops.core.kv_dtypes, one row per vLLM CacheDType)
KvCacheDtype = StrEnum("KvCacheDtype", {v: v for v in KV_DTYPE_NAMES})  # type: ignore[misc]
KV_AUTO = KvCacheDtype("auto")
KvDtype = Annotated[KvCacheDtype, typer.Option(
    "--kv-cache-dtype", help="KV cache dtype as vllm serve takes it (auto: the model's); one the device cannot "
    "run is refused.", rich_help_panel=MODEL_PANEL)]
SkipLayers = Annotated[str | None, typer.Option(
    "--kv-cache-dtype-skip-layers", help="Layers vLLM keeps at the model dtype: indices and/or sliding_window, "
    "e.g. 0,1,sliding_window.", rich_help_panel=MODEL_PANEL)]
Draft = Annotated[int, typer.Option(
    "--draft-layers", help="Drafter KV layers (MTP: num_nextn_predict_layers; EAGLE: 1), target's attention spec.",
    rich_help_panel=MODEL_PANEL)]
SpecTokens = Annotated[int, typer.Option(
    "--num-speculative-tokens", help="K of --speculative-config: mamba states and sliding reserves grow with it.",
    rich_help_panel=MODEL_PANEL)]
SpecMethod = Annotated[str | None, typer.Option(
    "--speculative-method", help="method of --speculative-config: mtp, eagle, eagle3, ngram, draft_model ...",
    rich_help_panel=MODEL_PANEL)]
Tp = Annotated[int, typer.Option(
    "--tensor-parallel-size", "-tp", help="TP size (KV heads split per rank).", rich_help_panel=DEVICE_PANEL)]
Pp = Annotated[int, typer.Option(
    "--pipeline-parallel-size", "-pp", help="PP size (layers split over stages).", rich_help_panel=DEVICE_PANEL)]
PpPartition = Annotated[str | None, typer.Option(
    "--pp-layer-partition", help="VLLM_PP_LAYER_PARTITION as exported for vllm serve, e.g. 15,16,15,15.",
    rich_help_panel=DEVICE_PANEL)]
class DeviceKind(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


Device = Annotated[DeviceKind, typer.Option(
    "--device", help="cuda (block 16, async scheduling) or cpu (block 128; planned from host memory).",
    rich_help_panel=DEVICE_PANEL)]
BlockSize = Annotated[int | None, typer.Option(
    "--block-size", help="As passed to vllm serve.", rich_help_panel=DEVICE_PANEL)]
Async = Annotated[bool | None, typer.Option(
    "--async-scheduling/--no-async-scheduling", help="Default: on for cuda.", rich_help_panel=DEVICE_PANEL)]
Mnbt = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", parser=tokens_option, metavar="TOKENS", help="As passed to vllm serve; default: 2048 (kv-capacity), vLLM's default "
    "for the device (plan).", rich_help_panel=MEMORY_PANEL)]
YamlOut = Annotated[bool, typer.Option("--yaml", help="Print kvops.yaml.", rich_help_panel=OUTPUT_PANEL)]


def register(app: typer.Typer) -> None:
    app.command("kv-capacity", help="num_blocks, tokens and concurrency exactly as vLLM 0.32 sizes them.")(kv_capacity_cmd)
    app.command("kv", help="Textbook KV bytes per token and for request lengths (GiB and GB).")(kv_cmd)
    app.command("plan", help="GPU + model + workload → vllm serve flags and a kvops.yaml.")(plan_cmd)
    app.command("verify", help="Compare a live server (--url) or its log (--log) with a plan.")(verify_cmd)


def _flags(max_model_len: int, device: str, block_size: int | None, mnbt: int | None, is_async: bool | None,
           pp: int = 1, pp_partition: str | None = None) -> Any:
    from kvops.ops.capacity.allocator import SizingFlags, parse_pp_layer_partition

    return SizingFlags(max_model_len=max_model_len, device=device, block_size=block_size,
                       max_num_batched_tokens=mnbt, async_scheduling=is_async, pipeline_parallel_size=pp,
                       pp_layer_partition=parse_pp_layer_partition(pp_partition))


def _model(config: str | None, alias: str | None, tp: int, kv_dtype: str, draft_layers: int = 0, spec_tokens: int = 0,
           spec_method: str | None = None, skip_layers: str | None = None, device: str | None = None) -> Any:
    from kvops.core.kv_dtypes import parse_skip_layers
    from kvops.ops.capacity.model import load_config, read_model

    return read_model(load_config(model_path(config, alias)), tp=tp, kv_cache_dtype=kv_dtype, draft_layers=draft_layers,
                      num_speculative_tokens=spec_tokens, speculative_method=spec_method,
                      skip_layers=parse_skip_layers(skip_layers), device=device)


def kv_capacity_cmd(
    max_model_len: MaxLen,
    kv_cache_memory_bytes: Annotated[int, typer.Option(
        "--kv-cache-memory-bytes", parser=bytes_option, metavar="BYTES",
        help="KV bytes on one rank: 8589934592, 8G or 8GiB (2**30 each), 8g (10**9), or '3.52 GiB' as "
        "vLLM's log prints it.", rich_help_panel=DEVICE_PANEL)],
    kv_cache_dtype: KvDtype = KV_AUTO, kv_cache_dtype_skip_layers: SkipLayers = None,
    tensor_parallel_size: Tp = 1, pipeline_parallel_size: Pp = 1,
    device: Device = DeviceKind.cuda, block_size: BlockSize = None, max_num_batched_tokens: Mnbt = None,
    async_scheduling: Async = None, draft_layers: Draft = 0, num_speculative_tokens: SpecTokens = 0,
    speculative_method: SpecMethod = None, pp_layer_partition: PpPartition = None, json_out: JsonOut = False,
    config: ModelConfig = None, config_alias: ConfigAlias = None,
) -> None:
    """Reproduce vLLM's 'KV cache size' and 'Maximum concurrency' for one rank."""
    from kvops.ops.capacity.allocator import check_context, kv_capacity

    flags = _flags(max_model_len, device.value, block_size, max_num_batched_tokens, async_scheduling,
                   pipeline_parallel_size, pp_layer_partition)
    model = _model(config, config_alias, tensor_parallel_size, kv_cache_dtype.value, draft_layers, num_speculative_tokens,
                   speculative_method, kv_cache_dtype_skip_layers, device.value)
    check_context(model, max_model_len)
    result = kv_capacity(model, kv_cache_memory_bytes, flags).summary()
    typer.echo(result.to_json() if json_out else result.log_line)


def kv_cmd(
    config: ModelConfig = None, config_alias: ConfigAlias = None,
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated request lengths (Σ Tᵢ).")] = "",
    batch: Annotated[int, typer.Option("--batch", help="B requests ...")] = 0,
    seq_len: Annotated[int, typer.Option("--seq-len", help="... of L tokens each.")] = 0,
    kv_cache_dtype: KvDtype = KV_AUTO, tensor_parallel_size: Tp = 1, json_out: JsonOut = False,
) -> None:
    """Bytes per token per layer group, then for Σ Tᵢ and for B × L, in GiB and GB."""
    from kvops.ops.capacity.formula import kv_formula

    try:
        parsed = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise BadInputError(f"--lengths {lengths!r}: use comma-separated integers, e.g. 1024,4096") from None
    out = kv_formula(_model(config, config_alias, tensor_parallel_size, kv_cache_dtype.value), parsed, batch, seq_len)
    if json_out:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"{out['kv_bytes_per_token']:,} B/token ({out['kv_dtype']})")
    for key in ("requests", "batch"):
        if key in out:
            item: Any = out[key]
            typer.echo(f"{key}: {item['bytes']:,} B = {item['gib']:.4f} GiB = {item['gb']:.8f} GB")


# kvops plan's own options (with the shared ones above: every field of PlanRequest).
Gpu = Annotated[str | None, typer.Option(
    "--gpu", help="GPU from the catalog: H100, H200, B200, A100 ... No default: give --gpu, --gpu-memory-gib "
    "or --device cpu.", rich_help_panel=DEVICE_PANEL)]
MemoryGib = Annotated[float | None, typer.Option(
    "--memory-gib", help="--device cpu: host memory for vLLM, GiB (default: MemAvailable in /proc/meminfo).",
    rich_help_panel=DEVICE_PANEL)]
OutDir = Annotated[Path | None, typer.Option(
    "--out-dir", help="Write plan.json, kvops.yaml and serve.sh (runs vllm serve with that kvops.yaml) here.",
    rich_help_panel=OUTPUT_PANEL)]
GpuGib = Annotated[float | None, typer.Option(
    "--gpu-memory-gib", help="Total GiB as the device reports it (instead of --gpu).", rich_help_panel=DEVICE_PANEL)]
ModelDir = Annotated[Path | None, typer.Option(
    "--model-dir", hidden=True, help="Read weights from safetensors headers (default: estimate from config).",
    rich_help_panel=MODEL_PANEL)]
Quantization = Annotated[str | None, typer.Option(
    "--quantization", help="As vllm serve takes it: a bf16 checkpoint quantized while loading (fp8, bitsandbytes, "
    "experts_int8); a quantized checkpoint's own method is read from its config.json.", rich_help_panel=MODEL_PANEL)]
KvScales = Annotated[Path | None, typer.Option(
    "--kv-scales", help="A scales file from kvops calibrate (fp8 KV): kvops.yaml loads it, and the layers it advises "
    "keeping at the model dtype are sized and passed as --kv-cache-dtype-skip-layers.", rich_help_panel=MODEL_PANEL)]
ModelDtype = Annotated[str | None, typer.Option(
    "--dtype", help="As vllm serve takes it: auto (the checkpoint's; float32 served as bfloat16), bfloat16, "
    "float16, float32.", rich_help_panel=MODEL_PANEL)]
P50 = Annotated[int | None, typer.Option(
    "--p50", help="Median request length, prompt + output tokens.", rich_help_panel=WORKLOAD_PANEL)]
P95 = Annotated[int | None, typer.Option(
    "--p95", help="95th-percentile request length (default: --p99).", rich_help_panel=WORKLOAD_PANEL)]
P99 = Annotated[int | None, typer.Option(
    "--p99", help="99th-percentile request length (default: --max-model-len).", rich_help_panel=WORKLOAD_PANEL)]
LengthsFile = Annotated[Path | None, typer.Option(
    "--lengths-file", help="CSV of real request lengths: tokens | prompt_tokens,output_tokens [,count].",
    rich_help_panel=WORKLOAD_PANEL)]
RiskQuantile = Annotated[str, typer.Option(
    "--risk-quantile", help="Length quantile max_num_seqs must fit without preemption: p95 or 0.95.",
    rich_help_panel=WORKLOAD_PANEL)]
Headroom = Annotated[float, typer.Option(
    "--headroom", help="Fraction of KV blocks kept free beyond max_num_seqs requests (also admission's).",
    rich_help_panel=WORKLOAD_PANEL)]
TargetConcurrency = Annotated[int | None, typer.Option(
    "--target-concurrency", help="Requests of the risk-quantile length that must fit: solves "
    "gpu_memory_utilization for them.", rich_help_panel=WORKLOAD_PANEL)]
GpuUtil = Annotated[float | None, typer.Option(
    "--gpu-memory-utilization", help="Fraction of the device vLLM may use, (0, 1] (default 0.92, or "
    "solved from --target-concurrency).", rich_help_panel=MEMORY_PANEL)]
ActivationGib = Annotated[float | None, typer.Option(
    "--activation-gib", help="Activation peak, GiB (overrides the calibration and the default).",
    rich_help_panel=MEMORY_PANEL)]
NonTorchGib = Annotated[float | None, typer.Option(
    "--non-torch-gib", help="Non-torch memory, GiB (overrides the calibration and the default).",
    rich_help_panel=MEMORY_PANEL)]
CudagraphGib = Annotated[float | None, typer.Option(
    "--cudagraph-gib", help="CUDA-graph estimate, GiB (overrides the calibration and the default).",
    rich_help_panel=MEMORY_PANEL)]
CalibrationFile = Annotated[Path | None, typer.Option(
    "--calibration", help="File from kvops verify --calibration-out: measured non-KV terms.",
    rich_help_panel=MEMORY_PANEL)]
DistinctPrefixes = Annotated[int, typer.Option(
    "--distinct-prefixes", help="Shared prefixes reused.", rich_help_panel=OFFLOAD_PANEL)]
PrefixTokens = Annotated[int, typer.Option(
    "--prefix-tokens", help="Tokens per shared prefix.", rich_help_panel=OFFLOAD_PANEL)]
HostMemoryGib = Annotated[float | None, typer.Option(
    "--host-memory-gib", help="Cap of LMCache L1 (CPU DRAM), GiB; the rest goes to disk (without it, "
    "L1 holds the whole target).",
    rich_help_panel=OFFLOAD_PANEL)]
TraceFile = Annotated[Path | None, typer.Option(
    "--trace", help="A production trace (Mooncake JSONL, BurstGPT CSV): lengths, arrival rate, and offload sized "
    "from its LRU hit-ratio curve (see `kvops trace stats`).", rich_help_panel=WORKLOAD_PANEL)]
TargetHitFraction = Annotated[float, typer.Option(
    "--target-hit-fraction", help="With --trace: size the offload tiers (beyond the GPU KV cache the plan "
    "sizes) to find this fraction of the prefix reuse an unbounded cache would.", rich_help_panel=OFFLOAD_PANEL)]
OffloadMode = Annotated[str | None, typer.Option(
    "--offload-mode", help="Judge offload in this transfer mode (auto, engine_driven, lmcache_driven): L1/disk "
    "sizes from the reuse, the expected hit ratio, and 'leave it off' when the prefill time hits save is below "
    "the mode's measured miss overhead.", rich_help_panel=OFFLOAD_PANEL)]
OffloadCosts = Annotated[Path | None, typer.Option(
    "--offload-costs", help="The JSON of `kvops bench offload --json` from your hardware: its load figures "
    "(share of memcpy, fixed time per hit, memcpy and prefill rate; --device cpu: the hit ratios recomputed for "
    "this model) or, from an older bench, its hit ratios, its miss ratio and transfer mode replace the built-in "
    "measurements; implies --offload-mode.",
    rich_help_panel=OFFLOAD_PANEL)]
_OUTPUT_FLAGS = ("json_out", "yaml_out", "out_dir", "config_alias")


def plan_cmd(
    ctx: typer.Context,
    max_model_len: MaxLen, config: ModelConfig = None, config_alias: ConfigAlias = None,
    kv_cache_dtype: KvDtype = KV_AUTO, kv_cache_dtype_skip_layers: SkipLayers = None, draft_layers: Draft = 0,
    num_speculative_tokens: SpecTokens = 0, speculative_method: SpecMethod = None, model_dir: ModelDir = None,
    quantization: Quantization = None, dtype: ModelDtype = None, kv_scales: KvScales = None,
    gpu: Gpu = None, gpu_memory_gib: GpuGib = None, tensor_parallel_size: Tp = 1, pipeline_parallel_size: Pp = 1,
    pp_layer_partition: PpPartition = None, device: Device = DeviceKind.cuda, memory_gib: MemoryGib = None,
    p50: P50 = None, p95: P95 = None, p99: P99 = None, lengths_file: LengthsFile = None,
    risk_quantile: RiskQuantile = "p95", headroom: Headroom = 0.0, target_concurrency: TargetConcurrency = None,
    gpu_memory_utilization: GpuUtil = None, max_num_batched_tokens: Mnbt = None,
    activation_gib: ActivationGib = None, non_torch_gib: NonTorchGib = None, cudagraph_gib: CudagraphGib = None,
    calibration: CalibrationFile = None,
    distinct_prefixes: DistinctPrefixes = 0, prefix_tokens: PrefixTokens = 0, host_memory_gib: HostMemoryGib = None,
    trace: TraceFile = None, target_hit_fraction: TargetHitFraction = 0.9,
    offload_mode: OffloadMode = None, offload_costs: OffloadCosts = None,
    json_out: JsonOut = False, yaml_out: YamlOut = False, out_dir: OutDir = None,
) -> None:
    """Derive gpu_memory_utilization, max_num_seqs, ... and print the serve line.

    Every option but the output flags is a field of PlanRequest under the same name.
    """
    from kvops.ops.capacity.plan import PlanRequest, run_plan
    from kvops.ops.capacity.render import YAML_HINT, plan_dir_yaml, render, write_plan_dir

    params = {k: v for k, v in ctx.params.items() if k not in _OUTPUT_FLAGS}
    params.update(device=device.value, kv_cache_dtype=kv_cache_dtype.value, config=model_path(config, config_alias))
    if out_dir is not None:
        params["kvops_yaml_path"] = str(plan_dir_yaml(out_dir))
    plan = run_plan(PlanRequest(**params))
    typer.echo(render(plan, "json" if json_out else "yaml" if yaml_out else "table"))
    if out_dir is not None:
        typer.echo(f"wrote {', '.join(str(p) for p in write_plan_dir(plan, out_dir))}", err=True)
    elif not (json_out or yaml_out):
        typer.echo(YAML_HINT)


def verify_cmd(
    expect: Annotated[Path | None, typer.Option("--expect", help="JSON from kv-capacity --json or plan --json.")] = None,
    url: OptionalServerUrl = None,
    log: Annotated[Path | None, typer.Option("--log", help="Server startup log.")] = None,
    calibration_out: Annotated[Path | None, typer.Option(
        "--calibration-out", help="Write measured non-KV memory for plan --calibration (--log, or --url with "
        "--expect from plan --json).")] = None,
    prometheus: Annotated[str | None, typer.Option(
        help="Prometheus base URL: compare every replica it scrapes with --expect.")] = None,
    selector: Annotated[str, typer.Option(
        help="With --prometheus: label matchers of the vLLM targets.")] = '{job="vllm"}',
    timeout: Timeout = None,
    json_out: JsonOut = False,
) -> None:
    """Exit 0 when the server's KV sizing equals the plan, 3 when it differs."""
    from kvops.core.http import deadline

    with deadline(60.0 if timeout is None else timeout):
        _verify(expect, url, log, calibration_out, prometheus, selector, json_out)


def _verify(expect: Path | None, url: str | None, log: Path | None, calibration_out: Path | None,
            prometheus: str | None, selector: str, json_out: bool) -> None:
    from kvops.core.endpoint import check_url
    from kvops.core.plan import Expectation, read_expectation
    from kvops.ops.capacity.calibration import write_calibration
    from kvops.ops.capacity.verify import read_server, verify_against

    if prometheus is not None:
        _verify_fleet(check_url(prometheus, "--prometheus"), selector, expect, url, log, calibration_out, json_out)
        return
    if (url is None) == (log is None):
        raise BadInputError("pass exactly one of --url or --log")
    if expect is None and calibration_out is None:
        raise BadInputError("pass --expect (compare with a plan) and/or --calibration-out (write a calibration)")
    doc = read_expectation(expect) if expect else Expectation.from_document({})
    observed, cal = read_server(check_url(url) if url else None, _read(log) if log else None, str(log), doc,
                                compare=expect is not None, calibrate=calibration_out is not None)
    if calibration_out is not None and cal is not None:
        write_calibration(cal, calibration_out)
        typer.echo(f"calibration written to {calibration_out}: non-KV {cal.non_kv_gib:.3f} GiB of "
                   f"{cal.requested_gib:.3f} GiB requested ({cal.device}, vLLM {cal.vllm_version})")
    if observed is None:
        return
    result = verify_against(doc, observed, cal)
    typer.echo(json.dumps(result) if json_out else result["explanation"])
    if not result["match"]:
        raise CheckFailedError(f"server differs from the plan: {json.dumps(result['differences'])}")


def _verify_fleet(prometheus: str, selector: str, expect: Path | None, url: str | None,
                  log: Path | None, calibration_out: Path | None, json_out: bool) -> None:
    from kvops.core.plan import read_expectation
    from kvops.ops.fleet import verify_fleet

    if url is not None or log is not None or calibration_out is not None:
        raise BadInputError("--prometheus checks a fleet: pass it without --url, --log and --calibration-out")
    if expect is None:
        raise BadInputError("--prometheus compares every replica with a plan: pass --expect")
    result = verify_fleet(prometheus, selector, read_expectation(expect))
    if json_out:
        typer.echo(json.dumps(result))
    else:
        for instance, row in result["replicas"].items():
            typer.echo(f"{instance}: {row['explanation']}")
    unread = [i for i, row in result["replicas"].items() if row.get("compared") is False]
    bad = [i for i, row in result["replicas"].items() if not row["match"] and i not in unread]
    if bad or unread:
        raise CheckFailedError("; ".join(
            ([f"replicas differ from the plan: {', '.join(bad)}"] if bad else [])
            + ([f"replicas not compared (no current sizing in Prometheus): {', '.join(unread)}"] if unread else [])))


def _read(path: Path | None) -> str:
    from kvops.core.files import read_text

    assert path is not None
    return read_text(path, f"--log {path}", replace_bad_bytes=True)
