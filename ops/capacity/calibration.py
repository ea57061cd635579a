"""Non-KV memory measured from a real server's startup log, saved for later plans.

vLLM sizes KV as ``requested − non-KV`` (v1/worker/gpu_worker.py:740-744; CPU:
v1/worker/cpu_worker.py:233-258), and the non-KV part (weights, activation peak, non-torch
memory, CUDA-graph estimate) depends on the model, the vLLM version and the device. The
planner's defaults for those terms are estimates; a calibration file replaces them with what
one server actually measured. ``kvops verify --log FILE --calibration-out CAL`` writes it,
``kvops plan --calibration CAL`` reads it. Every GiB figure in the log is rounded to 0.01
(vllm/utils/mem_utils.py:30 ``format_gib``), so a calibrated plan is exact only to that
precision; the file records it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvops.core import kinds
from kvops.core.errors import BadInputError
from kvops.core.kinds import read_json_of_kind
from kvops.core.plan import Expectation
from kvops.ops.capacity.constants import GIB

CALIBRATION_FORMAT: Final = "kvops-calibration/1"
LOG_PRECISION_GIB = 0.005  # half of format_gib's 0.01 rounding
MAX_GIB = 1e6  # no device or term is this large; bounds keep the arithmetic finite
_NUM = r"([\d.]+)"
# v1/engine/core.py:133 "Initializing a V1 LLM engine (v0.32.0) with config: model='…', …"
_ENGINE = re.compile(r"Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config: model='(?P<model>[^']*)'"
                     r".*?tensor_parallel_size=(?P<tp>\d+), pipeline_parallel_size=(?P<pp>\d+)"
                     r".*?kv_cache_dtype=(?P<kv>\w+), device_config=(?P<device>\w+)")
# v1/worker/cpu_worker.py:229-258
_CPU_AUTO = re.compile(rf"Auto set \({_NUM}/{_NUM}\) GiB for KV cache on node \d+, with {_NUM} GiB requested "
                       rf"memory for the worker\. {_NUM} GiB memory was consumed by non-kv usages")
_CPU_EXPLICIT = re.compile(rf"Explicitly set \({_NUM}/{_NUM}\) GiB for KV cache")
# v1/worker/gpu_worker.py:1012-1031 (logged after CUDA-graph capture, unless --kv-cache-memory-bytes)
_GPU_SUMMARY = re.compile(
    rf"Free memory on device \({_NUM}/{_NUM} GiB\) on startup\. Desired GPU memory utilization is "
    rf"\({_NUM}, {_NUM} GiB\)\. Actual usage is {_NUM} GiB for consumed memory \(weights \+ non-torch\), "
    rf"{_NUM} GiB for peak activation, and {_NUM} GiB for CUDAGraph memory\..*?Current kv cache memory "
    rf"in use is {_NUM} GiB")
_GPU_WEIGHTS = re.compile(rf"Model loading took {_NUM} GiB memory")  # v1/worker/gpu_model_runner.py:5150
_GPU_CG_ESTIMATE = re.compile(rf"Estimated CUDA graph memory: {_NUM} GiB total")  # gpu_model_runner.py:6475
_GPU_CG_DISABLED = "CUDA graph memory profiling is disabled"  # gpu_worker.py:790
# config/scheduler.py:308, logged by the API server once chunked prefill is on (the V1 default)
_MNBT = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")


class Calibration(BaseModel):
    """What one server measured; term fields are None where the log does not split them."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    format: Literal["kvops-calibration/1"] = "kvops-calibration/1"
    vllm_version: str
    device: Literal["cuda", "cpu"]
    model: str
    tensor_parallel_size: int = Field(ge=1)
    pipeline_parallel_size: int = Field(ge=1)
    kv_cache_dtype: str
    device_total_gib: float = Field(gt=0, le=MAX_GIB)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    requested_gib: float = Field(gt=0, le=MAX_GIB)
    available_kv_gib: float = Field(ge=0, le=MAX_GIB)
    non_kv_gib: float = Field(ge=0, le=MAX_GIB)
    """requested − available KV: everything the server kept for itself."""
    includes_weights: bool
    """True when non_kv_gib is one lump that includes the weights (CPU: the worker's RSS)."""
    weights_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    activation_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    non_torch_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    cudagraph_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    max_num_batched_tokens: int | None = Field(None, ge=1, strict=True)  # true is not 1 batched token
    """The server's; the activation peak is rescaled from it when a plan batches differently."""
    precision_gib: float = LOG_PRECISION_GIB
    source: str


def _engine_fields(text: str) -> dict[str, object]:
    m = _ENGINE.search(text)
    if not m:
        raise BadInputError("log has no 'Initializing a V1 LLM engine (vX) with config: ...' line; "
                            "pass the server's whole startup log")
    return {"vllm_version": m["version"], "model": m["model"], "tensor_parallel_size": int(m["tp"]),
            "pipeline_parallel_size": int(m["pp"]), "kv_cache_dtype": m["kv"],
            "device": "cpu" if m["device"] == "cpu" else "cuda"}


def _cpu_terms(text: str) -> dict[str, object]:
    m = _CPU_AUTO.search(text)
    if m is None:
        if _CPU_EXPLICIT.search(text):
            raise BadInputError("the server ran with an explicit KV size (--kv-cache-memory-bytes or "
                                "VLLM_CPU_KVCACHE_SPACE), so it measured no non-KV memory; start it with "
                                "--gpu-memory-utilization instead to calibrate")
        raise BadInputError("log has no 'Auto set (...) GiB for KV cache' line of the CPU worker")
    kv, total, requested, consumed = (float(g) for g in m.groups())
    return {"available_kv_gib": kv, "device_total_gib": total, "requested_gib": requested,
            "gpu_memory_utilization": min(1.0, requested / total), "non_kv_gib": consumed,
            "includes_weights": True}


def _gpu_terms(text: str) -> dict[str, object]:
    m = _GPU_SUMMARY.search(text)
    if m is None:
        raise BadInputError("log has no 'Free memory on device ... Current kv cache memory in use' line: "
                            "the server ran with --kv-cache-memory-bytes or the log is cut; start it with "
                            "--gpu-memory-utilization to calibrate")
    _free, total, util, requested, consumed, peak, _cg_actual, kv = (float(g) for g in m.groups())
    weights = _GPU_WEIGHTS.search(text)
    estimate = _GPU_CG_ESTIMATE.search(text)
    cudagraph = float(estimate[1]) if estimate and _GPU_CG_DISABLED not in text else 0.0
    w = float(weights[1]) if weights else None
    # gpu_worker.py:735-744: peak activation = transient peak + the CUDA-graph estimate applied.
    return {"available_kv_gib": kv, "device_total_gib": total, "requested_gib": requested,
            "gpu_memory_utilization": util, "non_kv_gib": round(requested - kv, 4),
            "includes_weights": False, "weights_gib": w,
            "non_torch_gib": round(consumed - w, 4) if w is not None else None,
            "activation_gib": round(peak - cudagraph, 4), "cudagraph_gib": cudagraph}


def calibration_from_log(text: str, source: str) -> Calibration:
    """Read the non-KV terms a server logged at startup; a log without them exits 2."""
    engine = _engine_fields(text)
    terms = _cpu_terms(text) if engine["device"] == "cpu" else _gpu_terms(text)
    mnbt = _MNBT.search(text)
    return _validated({**engine, **terms, "source": source,
                       "max_num_batched_tokens": int(mnbt[1]) if mnbt else None},
                      f"log {source}", "its figures cannot be a server's; pass the server's own startup log")


def calibration_from_metrics(
    labels: dict[str, str], plan: Expectation | Mapping[str, Any], version: str, model: str, source: str,
) -> Calibration:
    """Non-KV memory from a live server's block count: ``ceil(total × util) − num_blocks ×
    bytes_per_block``, exact to half a block. The device total and bytes per block come from
    the plan the server was started from (``kvops plan --json``, read or as decoded JSON);
    /metrics carries neither."""
    doc = plan if isinstance(plan, Expectation) else Expectation.from_document(dict(plan))
    total, block_bytes = doc.gpu_total_gib, doc.capacity.bytes_per_block
    if not doc.is_plan or total is None:
        raise BadInputError("--calibration-out with --url needs --expect from `kvops plan --json` "
                            "(its device total and bytes per block)")
    if labels.get("kv_cache_memory_bytes") not in (None, "None", ""):
        raise BadInputError("the server ran with --kv-cache-memory-bytes, so it measured no non-KV memory; "
                            "start it with --gpu-memory-utilization instead to calibrate")
    try:
        util, blocks = float(labels["gpu_memory_utilization"]), int(labels["num_gpu_blocks"])
    except (KeyError, ValueError, TypeError) as exc:
        raise BadInputError(f"cannot calibrate from these metrics and this plan: missing {exc}") from None
    if block_bytes is None:
        raise BadInputError("cannot calibrate from these metrics and this plan: missing 'bytes_per_block'")
    requested = math.ceil(total * GIB * util)  # v1/worker/utils.py:724-726, cpu_worker.py:74
    available = blocks * block_bytes + block_bytes / 2  # floor(available / bytes_per_block) = blocks
    return _validated({
        "vllm_version": version, "device": doc.device or "cuda", "model": model,
        "tensor_parallel_size": doc.tensor_parallel_size or 1,
        "pipeline_parallel_size": doc.pipeline_parallel_size or 1,
        "kv_cache_dtype": labels.get("cache_dtype", "auto"), "device_total_gib": total,
        "gpu_memory_utilization": util, "requested_gib": requested / GIB, "available_kv_gib": available / GIB,
        "non_kv_gib": (requested - available) / GIB, "includes_weights": True,
        "precision_gib": block_bytes / 2 / GIB, "source": source,
        "max_num_batched_tokens": doc.max_num_batched_tokens},
        f"the server at {source} and this plan", "check that --expect is the plan this server was started from")


def measured_from_log(text: str, source: str, *, required: bool) -> Calibration | None:
    """The non-KV terms a log shows; None when it shows none and they were not asked for
    (a server run with --kv-cache-memory-bytes can still be verified, just not calibrated)."""
    try:
        return calibration_from_log(text, source)
    except BadInputError:
        if required:
            raise
        return None


def write_calibration(calibration: Calibration, path: Path) -> None:
    try:
        path.write_text(calibration.model_dump_json(indent=2) + "\n")
    except OSError as exc:
        raise BadInputError(f"--calibration-out {path}: {exc}") from None


def load_calibration(path: Path) -> Calibration:
    """A calibration file written by ``kvops verify --calibration-out``; anything else exits 2."""
    label = f"--calibration {path}"
    raw = read_json_of_kind(path, label, kinds.CALIBRATION)
    return _validated(raw, label, "write it again with `kvops verify --log FILE --calibration-out CAL`")


def _validated(fields: object, label: str, remedy: str) -> Calibration:
    """A Calibration, or one line naming the field: a negative, NaN or infinite term (memory a
    server kept cannot be below zero) would plan more KV than the device holds."""
    try:
        return Calibration.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise BadInputError(f"{label}: {where}: {err['msg']}; {remedy}") from None
