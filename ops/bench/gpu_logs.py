"""``kvops bench planner``'s ``gpu_logs``: the planner against published vLLM start-up logs on GPUs.

Each logged run (shared/fixtures/gpu-logs: vLLM's own "Model loading took", "Available KV cache
memory" and "GPU KV cache size" lines with the server's arguments) is planned with ``kvops plan``'s
code path from the model's real config.json, and the prediction is set beside the log. Where the
logging vLLM accounted differently from 0.32 (``ACCOUNTING``), the plan is asked for that
version's terms and the difference is named in the run's ``accounting``. The KV token count is
checked on its own from the logged available KV: the allocator alone, given what the server had.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.plan import Plan
from kvops.core.units import GIB
from kvops.ops.capacity.activation import activation_shape
from kvops.ops.capacity.allocator import SizingFlags, kv_capacity
from kvops.ops.capacity.model import load_config, model_dtype, read_model, text_config
from kvops.ops.capacity.plan import PlanRequest, run_plan
from kvops.ops.capacity.quantization import weight_format
from kvops.ops.capacity.weights import stage_weights

_REPO = Path(__file__).resolve().parents[2]
LOGS = _REPO.parent / "shared" / "fixtures" / "gpu-logs" / "llm-d-planner-pr205-vllm-0.19-h100.jsonl"
# More public start-up logs (other GPUs and vLLM versions), sources in the README beside it.
PUBLIC_LOGS = _REPO / "tests" / "fixtures" / "gpu-logs" / "public-vllm-logs.jsonl"
CONFIG_DIRS = (_REPO.parent / "shared" / "fixtures" / "model-configs", _REPO / "tests" / "fixtures" / "model-configs")
# A logged model whose config is published here only under its base (or instruct) twin, with the
# same sizes and no quantization of its own.
SAME_SIZES = {
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Meta-Llama-3.1-8B",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mistralai/Mixtral-8x7B-v0.1",
    "deepseek-ai/DeepSeek-V2-Lite-Chat": "deepseek-ai/DeepSeek-V2-Lite",
}
_OLD_ACCOUNTING = {"cudagraph_gib": 0.0, "default_utilization": 0.9, "legacy_tokens": True,
                   "text": "vLLM {v}: no CUDA-graph estimate deducted from KV (0.21+ deducts it); default "
                           "gpu_memory_utilization 0.9 (0.32: 0.92); 'GPU KV cache size' = num_blocks // groups × "
                           "block_size (0.32: max_concurrency × max_model_len)"}
_NEW_ACCOUNTING = {"text": "vLLM {v}: accounted as 0.32 (CUDA-graph estimate deducted, the default since 0.21, at "
                           "the planner's default size: the log does not print it; default utilization 0.92)"}


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = (int(x) for x in version.split(".")[:2])
    return major, minor


def accounting(version: str) -> dict[str, Any]:
    """How a logging vLLM version sized KV where it differs from 0.32 (research/planner.md §1.2, §1.7)."""
    chosen = _OLD_ACCOUNTING if version_tuple(version) < (0, 21) else _NEW_ACCOUNTING
    return {**chosen, "text": str(chosen["text"]).format(v=version)}


# GPU names in the logs -> the planner's catalog (its totals as CUDA reports them)
_GPU_NAMES = (("A100", "40GB", "A100-40GB"), ("A100", "80GB", "A100-80GB"), ("H100", "", "H100"),
              ("H200", "", "H200"), ("4090", "", "RTX4090"), ("3090", "", "RTX3090"), ("L40S", "", "L40S"))
# The runs whose non-KV figures set the activation and non-torch defaults (capacity/activation.py);
# every other run is held out.
FIT_MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct")
_ROUNDING_GIB = 0.005  # the logs print GiB with two decimals


@dataclass(frozen=True)
class LoggedRun:
    """One start-up log: the server's arguments and the three figures it printed."""

    model: str
    url: str
    tp: int
    pp: int
    gpu_memory_utilization: float | None
    max_model_len: int
    kv_cache_dtype: str
    block_size: int | None
    vllm_version: str
    weights_gib: float
    available_kv_gib: float
    kv_cache_tokens: int
    args: dict[str, Any]
    gpu: str = "NVIDIA H100 80GB"
    gpu_total_gib: float | None = None  # as the log printed it, where it did
    source: str = LOGS.name

    def catalog_gpu(self) -> str | None:
        for part, size, name in _GPU_NAMES:
            if part in self.gpu and size.replace("GB", "") in self.gpu:
                return name
        return None


def _args(notes: str) -> dict[str, Any]:
    found = re.search(r"non-default args: (\{.*?\})\. ", notes)
    return json.loads(found.group(1)) if found else {}


def read_runs(path: Path = LOGS) -> list[LoggedRun]:
    runs = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        runs.append(LoggedRun(
            model=row["model"], url=row["url"], tp=row["tp"], pp=row["pp"],
            gpu_memory_utilization=row["gpu_memory_utilization"], max_model_len=row["max_model_len"],
            kv_cache_dtype=row["kv_cache_dtype"] or "auto", block_size=row["block_size"],
            vllm_version=row["vllm_version"], weights_gib=row["model_loading_gib"],
            available_kv_gib=row["available_kv_gib"], kv_cache_tokens=row["kv_cache_tokens"], args=_args(row["notes"]),
            gpu=row["gpu"], gpu_total_gib=row.get("gpu_total_gib"), source=path.name))
    return runs


def find_config(model: str, dirs: tuple[Path, ...] = CONFIG_DIRS) -> Path | None:
    for name in (model, SAME_SIZES.get(model)):
        if name is None:
            continue
        for folder in dirs:
            for file in folder.glob("*.json"):
                if file.stem.lower() == name.replace("/", "--").lower():
                    return file
    return None


def _request(run: LoggedRun, config: Path) -> PlanRequest:
    acct = accounting(run.vllm_version)
    gpu = run.catalog_gpu()
    if gpu is None and run.gpu_total_gib is None:
        raise BadInputError(f"GPU {run.gpu!r}: not in the planner's catalog and the log prints no total")
    eager = run.args.get("enforce_eager") is True
    return PlanRequest(
        config=config, max_model_len=run.max_model_len, kv_cache_dtype=run.kv_cache_dtype, gpu=gpu,
        gpu_memory_gib=run.gpu_total_gib,
        tensor_parallel_size=run.tp, pipeline_parallel_size=run.pp,
        gpu_memory_utilization=run.gpu_memory_utilization or acct.get("default_utilization"),
        cudagraph_gib=0.0 if eager else acct.get("cudagraph_gib"), quantization=run.args.get("quantization"),
        dtype=run.args.get("dtype"))


def _token_counter(run: LoggedRun, req: PlanRequest, plan: Plan) -> Callable[[int], int]:
    """The logged token figure for a number of KV bytes, in the logging version's meaning (the
    model read once for the three figures a run needs)."""
    model = read_model(load_config(req.config), tp=run.tp, kv_cache_dtype=run.kv_cache_dtype, dtype=req.dtype)
    flags = SizingFlags(max_model_len=run.max_model_len, block_size=run.block_size,
                        max_num_batched_tokens=plan.max_num_batched_tokens, pipeline_parallel_size=run.pp)
    legacy = accounting(run.vllm_version).get("legacy_tokens")

    def tokens(available_bytes: int) -> int:
        cap = kv_capacity(model, available_bytes, flags)
        return cap.num_blocks // len(cap.groups) * cap.block_size if legacy else cap.kv_cache_size_tokens

    return tokens


def _pct(predicted: float, logged: float) -> float:
    return round((predicted / logged - 1) * 100, 3)


def compare(run: LoggedRun, config: Path) -> dict[str, Any]:
    """One run: the plan's weights, available KV and tokens against the log's."""
    req = _request(run, config)
    plan = run_plan(req)
    weights, available, layout = _logged_worker(run, req, plan)
    lo, hi = (round((run.available_kv_gib + d) * GIB) for d in (-_ROUNDING_GIB, _ROUNDING_GIB))
    tokens = _token_counter(run, req, plan)
    tokens_lo, tokens_hi = tokens(lo), tokens(hi)
    return {
        "model": run.model, "config": config.name, "url": run.url, "tp": run.tp, "pp": run.pp,
        "fit": run.model in FIT_MODELS and run.source == LOGS.name, "source": run.source, "gpu": run.gpu,
        "vllm_version": run.vllm_version,
        "max_model_len": run.max_model_len, "kv_cache_dtype": run.kv_cache_dtype,
        "args": {k: v for k, v in run.args.items() if k in ("dtype", "quantization", "kv_cache_dtype")},
        "logged": {"weights_gib": run.weights_gib, "available_kv_gib": run.available_kv_gib,
                   "kv_cache_tokens": run.kv_cache_tokens},
        "predicted": {"weights_gib": round(weights, 3), "available_kv_gib": round(available, 3),
                      "kv_cache_tokens": tokens(plan.capacity.available_kv_bytes),
                      "non_kv": plan.non_kv.model_dump(), "weights_source": plan.non_kv_sources.weights_gib,
                      "weights_layout": layout},
        "weights_error_pct": _pct(weights, run.weights_gib),
        "available_kv_error_pct": _pct(available, run.available_kv_gib),
        "kv_tokens_from_logged_available": [tokens_lo, tokens_hi],
        # with pipeline stages the log's available KV is stage 0's and its tokens the smallest stage's
        "kv_tokens_exact": tokens_lo <= run.kv_cache_tokens <= tokens_hi if run.pp == 1 else None,
        "accounting": accounting(run.vllm_version)["text"]
        + (f"; weights: {layout}" if layout else "")
        + ("; the log's figures are pipeline stage 0's, which holds the embedding and runs no sampler: the plan "
           "sizes the last stage, so stage 0 is predicted from the same terms" if run.pp > 1 else ""),
    }


def _logged_worker(run: LoggedRun, req: PlanRequest, plan: Plan) -> tuple[float, float, str | None]:
    """(weights, available KV) GiB of the first stage's TP0 worker, the one whose lines the log holds,
    with its weights laid out as the logging vLLM did (mxfp4 experts on Hopper: 0.19 kept the
    checkpoint's scales beside the swizzled ones, capacity/mxfp4.py), and that layout (None: the
    checkpoint's own)."""
    raw = load_config(req.config)
    cfg = text_config(raw)
    dtype = model_dtype(cfg, req.dtype)
    fmt = weight_format(cfg.get("quantization_config"), req.quantization, req.gpu, version_tuple(run.vllm_version))
    first = stage_weights(raw, dtype, fmt, run.tp, run.pp, cuda=True).per_stage_bytes[0] / GIB
    available = plan.available_kv_gib + (plan.non_kv.weights_gib - first)
    if run.pp > 1:  # stage 0 runs no sampler
        shape = activation_shape(raw, dtype, run.tp, run.pp, req.gpu)
        seqs, mnbt = plan.max_num_seqs_why.caps["vllm_default"], plan.max_num_batched_tokens
        available += shape.peak_gib(seqs, mnbt) - shape.peak_gib(seqs, mnbt, last_stage=False)
    return first, available, fmt.source if fmt is not None and fmt.expert_layout is not None else None


def run(paths: tuple[Path, ...] = (LOGS, PUBLIC_LOGS)) -> dict[str, Any]:
    """Every logged run whose config is here, the summary keys, and the runs left out and why."""
    cases, skipped = [], []
    for logged in (r for path in paths for r in read_runs(path)):
        config = find_config(logged.model)
        if config is None:
            skipped.append({"model": logged.model, "tp": logged.tp, "pp": logged.pp, "why": "no config.json here",
                            "source": logged.source})
            continue
        try:
            cases.append(compare(logged, config))
        except BadInputError as exc:
            skipped.append({"model": logged.model, "tp": logged.tp, "pp": logged.pp, "why": str(exc),
                            "source": logged.source})
    main = [c for c in cases if c["source"] == paths[0].name]
    others = [c for c in cases if c["source"] != paths[0].name]
    summary = summarize(main, [s for s in skipped if s["source"] == paths[0].name], paths[:1])
    # Other GPUs and vLLM versions, whose logs do not show every term 0.32 deducts (CUDA graphs):
    # reported beside the goal's figures, not in them.
    other = summarize(others, [s for s in skipped if s["source"] != paths[0].name], paths[1:])
    return {**summary, "other_logs": other}


def summarize(cases: list[dict[str, Any]], skipped: list[dict[str, Any]], paths: tuple[Path, ...]) -> dict[str, Any]:
    weights = [abs(c["weights_error_pct"]) for c in cases]
    kv = [c["available_kv_error_pct"] for c in cases]
    held_out = [c["available_kv_error_pct"] for c in cases if not c["fit"]]
    return {
        "gpu_logs_source": [p.name for p in paths], "gpu_logs_cases": len(cases),
        "gpu_logs_cases_by_source": {p.name: sum(c["source"] == p.name for c in cases) for p in paths},
        "weights_error_pct_max": max(weights, default=None),
        "weights_error_pct_mean": round(statistics.fmean(weights), 3) if weights else None,
        "available_kv_error_pct_mean": round(statistics.fmean(abs(x) for x in kv), 3) if kv else None,
        "available_kv_error_pct_max": max((abs(x) for x in kv), default=None),
        "available_kv_over_pct_max": max(kv, default=None),
        "held_out_cases": len(held_out),
        "available_kv_error_pct_mean_held_out": round(statistics.fmean(abs(x) for x in held_out), 3) if held_out
        else None,
        "available_kv_over_pct_max_held_out": max(held_out, default=None),
        "kv_tokens_exact": sum(c["kv_tokens_exact"] is True for c in cases),
        "kv_tokens_cases": sum(c["kv_tokens_exact"] is not None for c in cases),
        "gpu_logs": cases, "gpu_logs_skipped": skipped,
    }
