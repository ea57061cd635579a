"""What a plan hands the operator: the ``vllm serve`` line, the kvops.yaml, and the why of each number.

The kvops.yaml is the plugin's own settings file (kvops.core.settings.KvopsSettings): it is
validated with the plugin's ``parse_settings`` before it is printed, so a plan can never emit a
file the server would refuse. Admission settings come from the admission policy's own
recommendation (kvops.core.admission.policy.recommended_settings), fed with this plan's
blocks and max_num_seqs; both imports are pydantic-only (no vLLM).
"""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

from kvops.core.errors import KvopsError
from kvops.core.kv_dtypes import is_quantized
from kvops.core.plan import OffloadAdvice, Plan, PlanSizing
from kvops.ops.capacity.offload import LMCACHE_CHUNK_TOKENS

DISK_PATH_PLACEHOLDER = "/var/lib/kvops/lmcache"
DEFAULT_ADMISSION_HEADROOM = 0.02  # recommended_settings' own default, used when --headroom is 0


def offload_chunk_tokens(block_size: int) -> int:
    """LMCache's chunk must be a multiple of vLLM's block size (plugin/offload/settings.py)."""
    return int(block_size * math.ceil(LMCACHE_CHUNK_TOKENS / block_size))


def kvops_settings(plan: PlanSizing, offload: OffloadAdvice, transfer_mode: str | None = None) -> dict[str, Any]:
    """The ``kvops`` mapping for this plan, checked by the plugin's own validator (``transfer_mode``:
    written into the offload section when the operator chose one; absent, the default auto)."""
    from kvops.core.admission.policy import recommended_settings
    from kvops.core.errors import KvopsPluginError
    from kvops.core.settings import parse_settings

    cap = plan.capacity
    headroom = plan.max_num_seqs_why.headroom_fraction or DEFAULT_ADMISSION_HEADROOM
    doc: dict[str, Any] = {"admission": recommended_settings(
        cap.num_blocks, cap.block_size, plan.max_num_seqs, plan.workload.p50, 0, headroom)}
    if offload.lmcache_cpu_gib:
        section: dict[str, Any] = {"l1_gib": offload.lmcache_cpu_gib, "chunk_size": offload.chunk_tokens}
        if offload.lmcache_disk_gib:
            section.update(disk_path=DISK_PATH_PLACEHOLDER, disk_gib=offload.lmcache_disk_gib)
        if transfer_mode:
            section["transfer_mode"] = transfer_mode
        doc["offload"] = section
    try:
        parse_settings(doc, "kvops plan")
    except KvopsPluginError as exc:  # a planner bug, not bad input: say so loudly
        raise KvopsError(f"planner produced an invalid kvops.yaml: {exc}") from None
    return doc


def serve_command(model_ref: str, plan: PlanSizing, kvops_yaml: str = "kvops.yaml") -> str:
    """The ready ``vllm serve`` line for the plan, every argument shell-quoted (shlex).

    A CPU plan gives the KV bytes themselves (--kv-cache-memory-bytes): the CPU worker then takes
    exactly that many (vllm/v1/worker/cpu_worker.py "Explicitly set"), so its log line equals the
    plan; a GPU plan gives the utilization vLLM subtracts its measured non-KV memory from.
    """
    argv = ["vllm", "serve", model_ref, "--tensor-parallel-size", str(plan.tensor_parallel_size)]
    if plan.pp_layer_partition:  # get_pp_indices reads it from the environment; digits and
        # commas need no quotes, so shlex leaves the assignment a shell assignment
        argv = ["VLLM_PP_LAYER_PARTITION=" + ",".join(map(str, plan.pp_layer_partition)), *argv]
    if plan.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(plan.pipeline_parallel_size)]
    if plan.device == "cpu":
        argv += ["--kv-cache-memory-bytes", str(plan.capacity.available_kv_bytes)]
    else:
        argv += ["--gpu-memory-utilization", f"{plan.gpu_memory_utilization:.2f}"]
    argv += ["--max-model-len", str(plan.max_model_len), "--max-num-seqs", str(plan.max_num_seqs),
             "--max-num-batched-tokens", str(plan.max_num_batched_tokens)]
    if is_quantized(plan.kv_cache_dtype):
        argv += ["--kv-cache-dtype", plan.kv_cache_dtype]
    if plan.kv_cache_dtype_skip_layers:  # vLLM's list flag: one argument per entry
        argv += ["--kv-cache-dtype-skip-layers", *plan.kv_cache_dtype_skip_layers]
    argv += ["--additional-config", json.dumps({"kvops": {"config": kvops_yaml}})]
    return shlex.join(argv)


def explain(plan: Plan) -> list[tuple[str, str, str]]:
    """(quantity, value, why) rows for the human table."""
    cap, nk, src, why = plan.capacity, plan.non_kv.items(), plan.non_kv_sources, plan.max_num_seqs_why
    dominant = max(nk, key=lambda term: term[1])[0]
    caps = ", ".join(f"{k} {v}" for k, v in why.caps.items())
    rows = [
        ("gpu_memory_utilization", f"{plan.gpu_memory_utilization:.2f}",
         f"of {plan.gpu_total_gib:.2f} GiB host memory (the serve line gives the KV bytes: "
         "--kv-cache-memory-bytes)" if plan.device == "cpu"
         else f"of {plan.gpu_total_gib} GiB total (as the device reports it)"),
        *[(f"  {key[:-4]}", f"{value:.2f} GiB", getattr(src, key)) for key, value in nk],
        ("non-KV memory", f"{plan.non_kv.total():.2f} GiB", f"{dominant[:-4]} dominates"),
        ("available KV", f"{plan.available_kv_gib:.2f} GiB", "ceil(total × util) − non-KV"),
        ("num_blocks", f"{cap.num_blocks:,}", f"{cap.bytes_per_block:,} B per block of {cap.block_size} tokens"),
        ("KV cache size", f"{cap.kv_cache_size_tokens:,} tokens",
         f"the server's log line; {cap.max_concurrency:.2f}x at {plan.max_model_len:,} tokens"),
        ("max_num_seqs", str(plan.max_num_seqs),
         f"{why.fit_at_quantile} requests of {why.length_at_quantile} tokens ({why.risk_quantile}, "
         f"{why.blocks_per_request_at_quantile} blocks) fit in {why.budget_blocks} of {why.usable_blocks} "
         f"usable blocks (headroom {why.headroom_fraction:.0%}); "
         f"caps: {caps}; bound by {why.binding}; rounded down to a multiple of {why.rounded_to_capture_step}; "
         f"at the mean length ({why.mean_length:.0f} tokens) {why.mean_load_concurrency} would fit"),
        ("max_num_batched_tokens", str(plan.max_num_batched_tokens), "as given, else vLLM's default for this device"),
    ]
    if plan.fp8_alternative:
        f8 = plan.fp8_alternative
        rows.append(("with --kv-cache-dtype fp8", f"{f8.kv_cache_size_tokens:,} tokens",
                     f"{f8.capacity_ratio:.2f}x the capacity; check accuracy first (kvops bench fp8)"))
    off = plan.offload
    if off.lmcache_cpu_gib:
        rows.append(("LMCache L1 / disk", f"{off.lmcache_cpu_gib} / {off.lmcache_disk_gib or 0} GiB", off.why or ""))
    if off.warning:
        rows.append(("offload", "warning", off.warning))
    rows += [("note", "", note) for note in plan.notes]
    return rows
