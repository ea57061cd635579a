"""``kvops kv-capacity``, ``kvops kv``, ``kvops plan``, ``kvops verify``: glue over kvops.ops.capacity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kvops.ops.errors import BadInputError, CheckFailedError

Config = Annotated[Path, typer.Option("--config", help="config.json or a model directory.")]
MaxLen = Annotated[int, typer.Option("--max-model-len", help="Tokens per request (prompt + output).")]
KvDtype = Annotated[str, typer.Option("--kv-cache-dtype", help="auto|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2|fp8_ds_mla")]
Tp = Annotated[int, typer.Option("--tensor-parallel-size", "-tp", help="TP size (KV heads split per rank).")]
Pp = Annotated[int, typer.Option("--pipeline-parallel-size", "-pp", help="PP size (layers split over stages).")]
Draft = Annotated[int, typer.Option(
    "--draft-layers", help="Drafter KV layers (MTP: num_nextn_predict_layers; EAGLE: 1), target's attention spec.")]
SpecTokens = Annotated[int, typer.Option(
    "--num-speculative-tokens", help="K of --speculative-config: mamba states and sliding reserves grow with it.")]
SpecMethod = Annotated[str | None, typer.Option(
    "--speculative-method", help="method of --speculative-config: mtp, eagle, eagle3, ngram, draft_model ...")]
PpPartition = Annotated[str | None, typer.Option(
    "--pp-layer-partition", help="VLLM_PP_LAYER_PARTITION as exported for vllm serve, e.g. 15,16,15,15.")]
Device = Annotated[str, typer.Option("--device", help="cuda (block 16, async scheduling) or cpu (block 128).")]
BlockSize = Annotated[int | None, typer.Option("--block-size", help="As passed to vllm serve.")]
Mnbt = Annotated[int | None, typer.Option("--max-num-batched-tokens", help="Default 2048.")]
Async = Annotated[bool | None, typer.Option("--async-scheduling/--no-async-scheduling", help="Default: on for cuda.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


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


def _model(config: Path, tp: int, kv_dtype: str, draft_layers: int = 0, spec_tokens: int = 0,
           spec_method: str | None = None) -> Any:
    from kvops.ops.capacity.model import load_config, read_model

    return read_model(load_config(config), tp=tp, kv_cache_dtype=kv_dtype, draft_layers=draft_layers,
                      num_speculative_tokens=spec_tokens, speculative_method=spec_method)


def kv_capacity_cmd(
    config: Config, max_model_len: MaxLen,
    kv_cache_memory_bytes: Annotated[int, typer.Option("--kv-cache-memory-bytes", help="KV bytes on one rank.")],
    kv_cache_dtype: KvDtype = "auto", tensor_parallel_size: Tp = 1, pipeline_parallel_size: Pp = 1,
    device: Device = "cuda", block_size: BlockSize = None, max_num_batched_tokens: Mnbt = None,
    async_scheduling: Async = None, draft_layers: Draft = 0, num_speculative_tokens: SpecTokens = 0,
    speculative_method: SpecMethod = None, pp_layer_partition: PpPartition = None, json_out: JsonOut = False,
) -> None:
    """Reproduce vLLM's 'KV cache size' and 'Maximum concurrency' for one rank."""
    from kvops.ops.capacity.allocator import kv_capacity

    flags = _flags(max_model_len, device, block_size, max_num_batched_tokens, async_scheduling,
                   pipeline_parallel_size, pp_layer_partition)
    model = _model(config, tensor_parallel_size, kv_cache_dtype, draft_layers, num_speculative_tokens,
                   speculative_method)
    result = kv_capacity(model, kv_cache_memory_bytes, flags).as_dict()
    typer.echo(json.dumps(result) if json_out else result["log_line"])


def kv_cmd(
    config: Config,
    lengths: Annotated[str, typer.Option("--lengths", help="Comma-separated request lengths (Σ Tᵢ).")] = "",
    batch: Annotated[int, typer.Option("--batch", help="B requests ...")] = 0,
    seq_len: Annotated[int, typer.Option("--seq-len", help="... of L tokens each.")] = 0,
    kv_cache_dtype: KvDtype = "auto", tensor_parallel_size: Tp = 1, json_out: JsonOut = False,
) -> None:
    """Bytes per token per layer group, then for Σ Tᵢ and for B × L, in GiB and GB."""
    from kvops.ops.capacity.formula import kv_formula

    try:
        parsed = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise BadInputError(f"--lengths {lengths!r}: use comma-separated integers, e.g. 1024,4096") from None
    out = kv_formula(_model(config, tensor_parallel_size, kv_cache_dtype), parsed, batch, seq_len)
    if json_out:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"{out['kv_bytes_per_token']:,} B/token ({out['kv_dtype']})")
    for key in ("requests", "batch"):
        if key in out:
            item: Any = out[key]
            typer.echo(f"{key}: {item['bytes']:,} B = {item['gib']:.4f} GiB = {item['gb']:.8f} GB")


Gib = Annotated[float | None, typer.Option(help="GiB; overrides the calibration and the default.")]


def plan_cmd(
    config: Config, max_model_len: MaxLen,
    gpu: Annotated[str | None, typer.Option("--gpu", help="H100, H200, B200, A100 ...")] = None,
    gpu_memory_gib: Annotated[float | None, typer.Option("--gpu-memory-gib", help="Total GiB as the device reports it.")] = None,
    tensor_parallel_size: Tp = 1, pipeline_parallel_size: Pp = 1, device: Device = "cuda",
    kv_cache_dtype: KvDtype = "auto", draft_layers: Draft = 0, num_speculative_tokens: SpecTokens = 0,
    speculative_method: SpecMethod = None, pp_layer_partition: PpPartition = None,
    model_dir: Annotated[Path | None, typer.Option("--model-dir", help="Read weights from safetensors headers.")] = None,
    p50: Annotated[int | None, typer.Option("--p50", help="Median prompt+output tokens.")] = None,
    p95: Annotated[int | None, typer.Option("--p95")] = None,
    p99: Annotated[int | None, typer.Option("--p99")] = None,
    lengths_file: Annotated[Path | None, typer.Option(
        "--lengths-file", help="CSV of real request lengths: tokens | prompt_tokens,output_tokens [,count].")] = None,
    risk_quantile: Annotated[str, typer.Option(
        "--risk-quantile", help="Length quantile max_num_seqs must fit without preemption: p95 or 0.95.")] = "p95",
    headroom: Annotated[float, typer.Option(
        "--headroom", help="Fraction of KV blocks kept free beyond max_num_seqs requests (also admission's).")] = 0.0,
    target_concurrency: Annotated[int | None, typer.Option("--target-concurrency")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option("--gpu-memory-utilization")] = None,
    max_num_batched_tokens: Mnbt = None,
    activation_gib: Annotated[float | None, typer.Option("--activation-gib", help="Activation peak, GiB.")] = None,
    non_torch_gib: Annotated[float | None, typer.Option("--non-torch-gib", help="Non-torch memory, GiB.")] = None,
    cudagraph_gib: Annotated[float | None, typer.Option("--cudagraph-gib", help="CUDA-graph estimate, GiB.")] = None,
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", help="File from kvops verify --calibration-out: measured non-KV terms.")] = None,
    distinct_prefixes: Annotated[int, typer.Option("--distinct-prefixes", help="Shared prefixes reused.")] = 0,
    prefix_tokens: Annotated[int, typer.Option("--prefix-tokens", help="Tokens per shared prefix.")] = 0,
    host_memory_gib: Annotated[float | None, typer.Option("--host-memory-gib", help="Cap of LMCache L1.")] = None,
    json_out: JsonOut = False,
    yaml_out: Annotated[bool, typer.Option("--yaml", help="Print kvops.yaml.")] = False,
) -> None:
    """Derive gpu_memory_utilization, max_num_seqs, ... and print the serve line."""
    from kvops.ops.capacity.render import PlanRequest, render, run_plan

    plan = run_plan(PlanRequest(
        config=config, max_model_len=max_model_len, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
        tp=tensor_parallel_size, pp=pipeline_parallel_size, device=device, kv_cache_dtype=kv_cache_dtype,
        draft_layers=draft_layers, num_speculative_tokens=num_speculative_tokens,
        speculative_method=speculative_method, pp_layer_partition=pp_layer_partition, model_dir=model_dir, quantiles=(p50, p95, p99), lengths_file=lengths_file, risk_quantile=risk_quantile,
        headroom_fraction=headroom, target_concurrency=target_concurrency, gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=max_num_batched_tokens, activation_gib=activation_gib, non_torch_gib=non_torch_gib,
        cudagraph_gib=cudagraph_gib, calibration=calibration, distinct_prefixes=distinct_prefixes,
        prefix_tokens=prefix_tokens, host_memory_gib=host_memory_gib))
    typer.echo(render(plan, "json" if json_out else "yaml" if yaml_out else "table"))


def verify_cmd(
    expect: Annotated[Path | None, typer.Option("--expect", help="JSON from kv-capacity --json or plan --json.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="Server base URL (reads /metrics).")] = None,
    log: Annotated[Path | None, typer.Option("--log", help="Server startup log.")] = None,
    calibration_out: Annotated[Path | None, typer.Option(
        "--calibration-out", help="Write measured non-KV memory for plan --calibration (--log, or --url with "
        "--expect from plan --json).")] = None,
    json_out: JsonOut = False,
) -> None:
    """Exit 0 when the server's KV sizing equals the plan, 3 when it differs."""
    from kvops.ops.capacity.calibration import write_calibration
    from kvops.ops.capacity.verify import read_server, verify_against

    if (url is None) == (log is None):
        raise BadInputError("pass exactly one of --url or --log")
    if expect is None and calibration_out is None:
        raise BadInputError("pass --expect (compare with a plan) and/or --calibration-out (write a calibration)")
    doc = _expected(expect) if expect else {}
    observed, cal = read_server(url, _read(log) if log else None, str(log), doc,
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


def _expected(expect: Path) -> dict[str, Any]:
    try:
        expected = json.loads(expect.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"--expect {expect}: {exc}") from None
    if not isinstance(expected, dict):
        raise BadInputError(f"--expect {expect}: must be a JSON object from kv-capacity/plan --json")
    return expected


def _read(path: Path | None) -> str:
    assert path is not None
    try:
        return path.read_text(errors="replace")
    except OSError as exc:
        raise BadInputError(f"--log {path}: {exc}") from None
