"""The memory side of a plan: the resolved inputs, and the non-KV terms vLLM subtracts before KV.

KV bytes come from vLLM 0.32's own formula (gpu_worker.py): ``ceil(total × util) − weights −
activation peak − non-torch − CUDA-graph estimate``. Weights are read from safetensors headers
when a model directory is given; the other non-KV terms are documented defaults
(constants.py), overridable, or taken from a calibration file written by ``kvops verify``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from kvops.core.errors import BadInputError
from kvops.core.plan import NonKvSources, NonKvTerms
from kvops.ops.capacity.activation import FIT_HIDDEN, FIT_RUNS, NON_TORCH_GIB, ActivationShape
from kvops.ops.capacity.calibration import MAX_GIB, Calibration
from kvops.ops.capacity.constants import (
    CUDA_GRAPH_GIB_PER_CAPTURE_SIZE,
    CUDA_GRAPH_MAX_CAPTURE,
    GIB,
    GPU_CATALOG_GIB,
    VLLM_VERSION,
)

WEIGHTS_FROM_HEADERS, WEIGHTS_ESTIMATED = "safetensors headers", "estimate from config.json"
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner sizes from, resolved (GPU total looked up, calibration loaded,
    weights counted); kvops.ops.capacity.plan builds it from the command line."""

    gpu_total_gib: float
    tp: int = 1
    pp: int = 1
    device: str = "cuda"
    gpu: str | None = None  # the --gpu name: vLLM's batch defaults differ on A100
    gpu_memory_utilization: float | None = None
    target_concurrency: int | None = None
    risk_quantile: str = "p95"
    headroom_fraction: float = 0.0  # KV blocks kept free beyond max_num_seqs risk-quantile requests
    max_num_batched_tokens: int | None = None
    pp_layer_partition: tuple[int, ...] | None = None  # VLLM_PP_LAYER_PARTITION
    weights_rank_bytes: int | None = None  # one rank's (the largest pipeline stage's)
    activation: ActivationShape | None = None  # the model's shapes for the default activation terms
    weights_source: str = WEIGHTS_ESTIMATED
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    calibration: Calibration | None = None
    model_ref: str = ""  # what vllm serve gets; matches Calibration.model for the same model
    draft_layers: int = 0
    distinct_prefixes: int = 0
    prefix_tokens: int = 0
    host_memory_gib: float | None = None
    kvops_yaml_path: str = "kvops.yaml"  # as the serve line names it
    device_total_source: str = ""


MEMINFO = Path("/proc/meminfo")
CATALOG_HINT = "--gpu NAME (the catalog: {names}), --gpu-memory-gib N (the total CUDA reports) or --device cpu"


def device_total_gib(device: str, gpu: str | None, gpu_gib: float | None, memory_gib: float | None,
                     calibration: Calibration | None) -> tuple[float, str]:
    """The memory the plan divides, and where it came from: no device is ever assumed.

    GPU: the --gpu catalog entry or --gpu-memory-gib (else the calibrated device's total).
    CPU: --memory-gib (or --gpu-memory-gib), else the calibrated host's, else what this host has
    available now (MemAvailable in /proc/meminfo: vLLM's CPU worker refuses a KV size larger than
    the node's free memory, vllm/v1/worker/cpu_worker.py).
    """
    if device == "cpu":
        if gpu is not None:
            raise BadInputError(f"--gpu {gpu} names a GPU; with --device cpu give --memory-gib (default: "
                                "MemAvailable of this host)")
        given = memory_gib if memory_gib is not None else gpu_gib
        if given is not None:
            return _in_range(given, "--memory-gib"), "--memory-gib"
        if calibration is not None:
            return calibration.device_total_gib, f"calibration ({calibration.source})"
        return host_available_gib(), f"MemAvailable of this host ({MEMINFO}); --memory-gib for another host"
    if memory_gib is not None:
        raise BadInputError("--memory-gib is the host memory of --device cpu; for a GPU give --gpu or "
                            "--gpu-memory-gib")
    if gpu is None and gpu_gib is None:
        if calibration is not None:
            return calibration.device_total_gib, f"calibration ({calibration.source})"
        raise BadInputError("which device is this plan for? give " + CATALOG_HINT.format(
            names=", ".join(GPU_CATALOG_GIB)))
    return gpu_total_gib(gpu, gpu_gib), "--gpu-memory-gib" if gpu_gib is not None else f"--gpu {gpu}"


def host_available_gib(meminfo: Path = MEMINFO) -> float:
    try:
        line = next(x for x in meminfo.read_text().splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024 / GIB
    except (OSError, StopIteration, ValueError, IndexError) as exc:
        raise BadInputError(f"cannot read MemAvailable from {meminfo} ({exc}): pass --memory-gib") from None


def _in_range(gib: float, flag: str) -> float:
    if not 0 < gib <= MAX_GIB:
        raise BadInputError(f"{flag} must be in (0, {MAX_GIB:.0f}], got {gib}")
    return gib


def gpu_total_gib(name: str | None, gib: float | None) -> float:
    if gib is not None:
        if not 0 < gib <= MAX_GIB:
            raise BadInputError(f"--gpu-memory-gib must be in (0, {MAX_GIB:.0f}], got {gib}")
        return gib
    key = (name or "").upper()
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


def capture_sizes(max_num_seqs: int) -> int:
    """How many CUDA graphs vLLM captures (config/vllm.py): [1,2,4] + 8..248 step 8 + 256.. step 16."""
    top = min(2 * max_num_seqs, CUDA_GRAPH_MAX_CAPTURE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, min(top, 255) + 1, 8))
    return len(sizes) + len(range(256, top + 1, 16))


def check_calibration(inp: PlanInputs) -> list[str]:
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


def non_kv_terms(inp: PlanInputs, max_num_seqs: int, mnbt: int) -> tuple[NonKvTerms, NonKvSources]:
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
        return NonKvTerms(**terms), NonKvSources(**sources)
    cal_source = f"calibration ({cal.source})" if cal else ""
    defaults = {
        "activation_gib": default_activation(inp, max_num_seqs, mnbt),
        "non_torch_gib": default_non_torch(inp),
        "cudagraph_gib": ((CUDA_GRAPH_GIB_PER_CAPTURE_SIZE * capture_sizes(max_num_seqs), "default per capture size "
                           f"({capture_sizes(max_num_seqs)} graphs at max_num_seqs {max_num_seqs})")
                          if inp.device == "cuda" else (0.0, "no CUDA graphs on cpu")),
    }
    terms = {"weights_gib": (inp.weights_rank_bytes or 0) / GIB}
    sources = {"weights_gib": inp.weights_source.replace(WEIGHTS_FROM_HEADERS, f"{WEIGHTS_FROM_HEADERS} / (TP × PP)", 1)
               if inp.weights_source.startswith(WEIGHTS_FROM_HEADERS) else inp.weights_source}
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
    return NonKvTerms(**terms), NonKvSources(**sources)


def default_activation(inp: PlanInputs, max_num_seqs: int, mnbt: int) -> tuple[float, str]:
    """The profile run's peak when nothing measured it: the larger of the forward at mnbt tokens
    and the sampler warm-up, plus what stays allocated through both."""
    shape = inp.activation
    if shape is None:  # no config shapes (a calibration lump without weights): the old flat default
        return 2.0 * mnbt / 8192, "default 2.0 GiB per 8192 batched tokens (v0.19 H100)"
    forward, sampler, held = shape.forward_gib(mnbt), shape.sampler_gib(max_num_seqs, mnbt), shape.held_gib(mnbt)
    kept = f" + {held:.2f} GiB held through both (fused-MoE workspace, dummy images)" if held else ""
    return shape.peak_gib(max_num_seqs, mnbt), (
        f"default: the larger of the forward ({forward:.2f} GiB at {mnbt} batched tokens) and the sampler warm-up "
        f"({sampler:.2f} GiB: {min(max_num_seqs, mnbt)} rows x {shape.vocab_padded} logits, last pipeline stage)"
        f"{kept}; coefficients from {FIT_RUNS}")


def terms_notes(inp: PlanInputs, sources: NonKvSources) -> list[str]:
    """Which non-KV terms were measured and which defaulted (from which vLLM), and how to make them exact."""
    terms = sources.model_dump()
    measured = [k[:-4] for k, why in terms.items() if why.startswith(("calibration", "--", "inside", "safetensors"))]
    estimated = [k[:-4] for k, why in terms.items() if why.startswith("estimate")]
    defaulted = [k[:-4] for k in terms if k[:-4] not in (*measured, *estimated)
                 and not terms[k].startswith("no CUDA graphs")]
    if not defaulted and not estimated:
        return [f"non-KV terms all measured or given ({', '.join(measured)})"]
    notes = [f"non-KV terms: measured or given: {', '.join(measured) or 'none'}; estimated from config.json: "
             f"{', '.join(estimated) or 'none'}; defaulted: {', '.join(defaulted) or 'none'} "
             f"(the planner models vLLM {VLLM_VERSION}; activation and non-torch defaults come from vLLM 0.19 H100 "
             "logs). Make them exact for this model and device: `kvops verify --url http://SERVER:8000 "
             "--calibration-out cal.json` against a server of this model, then `kvops plan ... --calibration cal.json`"]
    shape = inp.activation
    if "activation" in defaulted and shape is not None and (shape.moe or shape.multimodal):
        kind = "MoE" if shape.moe else "multimodal"
        notes.append(f"the default activation was read off dense text models; on held-out {kind} logs it left up "
                     "to 0.5% more KV than the server had (kvops bench planner, gpu_logs): calibrate before "
                     "counting on the last percent")
    return notes


def default_non_torch(inp: PlanInputs) -> tuple[float, str]:
    if inp.activation is not None:
        wider = (" and, with TP, rising with the model's width to the 8192-wide logs' figure"
                 if inp.tp > 1 and inp.activation.hidden > FIT_HIDDEN else "")
        return inp.activation.non_torch_gib(), (f"default for TP{inp.tp}/PP{inp.pp} (CUDA context, NCCL, "
                                                f"custom all-reduce) from {FIT_RUNS}{wider}")
    return NON_TORCH_GIB[2 if inp.tp * inp.pp > 1 else 1], "default by TP (v0.19 H100: NCCL/custom all-reduce)"


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
