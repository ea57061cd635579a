"""kv-exhaustion: classify each load step from the server's gauges and the client's tails,
find the knee, and set it beside the capacity the KV cache predicts.

A step is KV-bound when vLLM preempts or holds requests waiting while the cache is (nearly)
full; sequence-limit-bound when requests wait while ``running`` sits flat at the same ceiling
with KV to spare; compute-bound when they wait with neither limit reached (token budget or
plain compute); failing when requests error.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvops.loadtest.analysis.stats import mean, percentile
from kvops.loadtest.metrics import MetricsSample, cache_int, delta, window
from kvops.loadtest.records import RequestRecord
from kvops.loadtest.scenarios.config import KvExhaustionConfig
from kvops.ops.diagnose import Verdict, healthy
from kvops.ops.errors import BadInputError

OK, KV_BOUND, SEQ_BOUND, COMPUTE_BOUND, FAILING = (
    "ok", "kv-capacity", "max-num-seqs", "compute-bound", "failing")
QUEUED_FRACTION = 0.3
SCHED_MAX_SEQS = "kvops_scheduler_max_num_seqs"


@dataclass
class StepResult:
    index: int
    users: int
    start: float
    end: float
    requests: int
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens_per_s: float
    waiting_max: float
    waiting_fraction: float
    """Share of the step's samples with a request waiting: one sample is a transient."""
    running_max: float
    kv_usage_max: float
    preemptions: float
    classification: str = OK
    max_num_seqs: float | None = None
    """The server's --max-num-seqs from the kvops plugin's gauge; None on a server without it."""


def step_bounds(config: KvExhaustionConfig, started_at: float) -> list[tuple[int, float, float]]:
    return [(users, started_at + i * config.step_s, started_at + (i + 1) * config.step_s)
            for i, users in enumerate(config.steps)]


def measure_step(index: int, users: int, start: float, end: float, config: KvExhaustionConfig,
                 records: list[RequestRecord], samples: list[MetricsSample]) -> StepResult:
    settled = start + (end - start) * config.settle_fraction
    sent = [r for r in records if start <= r.sent_at < end]
    done = [r for r in records if settled <= r.done_at < end and r.ok]
    in_step = window(samples, settled, end) or window(samples, start, end)
    # counter deltas from just before the step to its end, never past it: the next step's users
    # start at `end`, and a preemption they cause must not make this step look KV-bound
    edge = window(samples, start - 1.5, end)
    ttfts = [r.ttft_s for r in sent if r.ttft_s is not None]
    return StepResult(
        index=index, users=users, start=start, end=end, requests=len(sent),
        errors=sum(1 for r in sent if not r.ok and not r.stopped),
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        tokens_per_s=sum(r.completion_tokens or 0 for r in done) / max(end - settled, 1e-9),
        waiting_max=max((s.get("waiting") for s in in_step), default=0.0),
        waiting_fraction=sum(1 for s in in_step if s.get("waiting") >= 1) / max(len(in_step), 1),
        running_max=max((s.get("running") for s in in_step), default=0.0),
        kv_usage_max=max((s.get("kv_usage") for s in in_step), default=0.0),
        preemptions=delta(edge[0], edge[-1], "preemptions") if len(edge) >= 2 else 0.0,
        max_num_seqs=next((s.values[SCHED_MAX_SEQS] for s in reversed(edge or samples)
                           if SCHED_MAX_SEQS in s.values), None),
    )


def classify(step: StepResult, previous: StepResult | None, config: KvExhaustionConfig) -> str:
    if step.requests and step.errors >= 2 and step.errors / step.requests > config.error_rate_failing:
        return FAILING
    queued = step.waiting_fraction >= QUEUED_FRACTION
    if step.preemptions > 0 or (queued and step.kv_usage_max >= config.kv_usage_bound):
        return KV_BOUND
    if queued:
        if step.max_num_seqs:
            # exact: the plugin publishes the limit (a token budget also pins `running`, at a
            # count below it, e.g. one long prompt prefilling in 32-token chunks)
            return SEQ_BOUND if step.running_max >= step.max_num_seqs else COMPUTE_BOUND
        plateau = previous is not None and previous.running_max >= step.running_max
        return SEQ_BOUND if plateau else COMPUTE_BOUND
    return OK


def predicted_concurrency(sample: MetricsSample | None, tokens_per_request: float) -> dict[str, Any]:
    """Requests the KV cache holds at once: whole blocks per request, one null block reserved.

    From vllm:cache_config_info (num_gpu_blocks, block_size); vLLM keeps block 0 as the null
    block (vllm/v1/core/block_pool.py), so usage is computed over num_blocks − 1.
    """
    if sample is None:
        return {}
    blocks, block_size = cache_int(sample, "num_gpu_blocks"), cache_int(sample, "block_size")
    if not blocks or not block_size or tokens_per_request <= 0:
        return {}
    per_request = math.ceil(tokens_per_request / block_size)
    return {"num_gpu_blocks": blocks, "block_size": block_size,
            "tokens_per_request": round(tokens_per_request, 1), "blocks_per_request": per_request,
            "predicted_max_concurrency": (blocks - 1) // per_request}


def load_expectation(path: Path) -> dict[str, Any]:
    """The capacity part of ``kvops plan --json`` or ``kvops kv-capacity --json`` output."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"--expect {path}: cannot read it as JSON ({exc})") from None
    capacity = doc.get("capacity") if isinstance(doc, dict) else None
    expected = capacity if isinstance(capacity, dict) else doc
    if not isinstance(expected, dict) or not all(
            isinstance(expected.get(k), int) and expected[k] > 0 for k in ("num_blocks", "block_size")):
        raise BadInputError(f"--expect {path}: not a plan; pass the JSON of `kvops plan --json` or "
                            "`kvops kv-capacity --json` for this server")
    out = dict(expected)
    if isinstance(doc.get("max_num_seqs"), int):
        out["max_num_seqs"] = doc["max_num_seqs"]
    return out


def _group_blocks(group: dict[str, Any], tokens: int, size: int) -> int:
    """Blocks one request of ``tokens`` holds in a KV group, by the rules of
    kvops.ops.capacity.allocator.Spec.blocks_per_request (whose value at max_model_len the
    document carries as the group's ceiling): a sliding window keeps one block more than it
    covers, a mamba group a fixed number."""
    need = math.ceil(tokens / int(group.get("block_size") or size))
    kind, ceiling = group.get("kind", "full"), group.get("blocks_per_request")
    if not isinstance(ceiling, int) or ceiling <= 0:
        return need
    if kind == "mamba":
        return ceiling
    return min(need + 1 if kind == "sliding" else need, ceiling)


def planned_concurrency(expected: dict[str, Any], tokens_per_request: float) -> dict[str, Any]:
    """What the planner predicts for requests of this length: their blocks summed over the KV
    groups, out of num_blocks − 1 usable ones (block 0 is vLLM's null block), as
    kvops.ops.capacity.plan.derive_max_num_seqs counts them."""
    if tokens_per_request <= 0:
        return {}
    size = int(expected["block_size"])
    groups = expected.get("groups") or [{"kind": "full", "block_size": size}]
    per_request = sum(_group_blocks(g, math.ceil(tokens_per_request), size) for g in groups)
    out = {"plan_num_blocks": expected["num_blocks"], "plan_block_size": size,
           "plan_blocks_per_request": per_request,
           "plan_predicted_max_concurrency": (int(expected["num_blocks"]) - 1) // max(per_request, 1)}
    if "max_num_seqs" in expected:
        out["plan_max_num_seqs"] = expected["max_num_seqs"]
    return out


def analyse(config: KvExhaustionConfig, records: list[RequestRecord], samples: list[MetricsSample],
            started_at: float, expected: dict[str, Any] | None = None,
            ) -> tuple[list[StepResult], list[Verdict]]:
    steps: list[StepResult] = []
    for i, (users, start, end) in enumerate(step_bounds(config, started_at)):
        step = measure_step(i, users, start, end, config, records, samples)
        step.classification = classify(step, steps[-1] if steps else None, config)
        steps.append(step)
    prompt = mean([float(r.prompt_tokens) for r in records if r.prompt_tokens]) or 0.0
    plan = predicted_concurrency(samples[-1] if samples else None, prompt + config.workload.max_tokens)
    if expected is not None:
        plan.update(planned_concurrency(expected, prompt + config.workload.max_tokens))
        if "num_gpu_blocks" in plan:
            plan["plan_matches_server_blocks"] = plan["plan_num_blocks"] == plan["num_gpu_blocks"]
    knee = next((s for s in steps if s.classification != OK), None)
    ok_steps = [s for s in steps if s.classification == OK and (knee is None or s.index < knee.index)]
    evidence: dict[str, Any] = {
        "steps": [{"users": s.users, "class": s.classification} for s in steps], **plan,
        "last_ok_users": ok_steps[-1].users if ok_steps else 0,
    }
    if knee is None:
        return steps, [healthy(**evidence, max_users_tested=steps[-1].users)]
    evidence.update({
        "knee_users": knee.users, "waiting_max": knee.waiting_max, "running_max": knee.running_max,
        "kv_usage_max": round(knee.kv_usage_max, 4), "preemptions": knee.preemptions,
        "ttft_p99_s": knee.ttft_p99_s, "errors": knee.errors,
        "ttft_p99_ratio_to_first_step": _ratio(knee.ttft_p99_s, steps[0].ttft_p99_s),
    })
    if knee.max_num_seqs is not None:
        evidence["server_max_num_seqs"] = int(knee.max_num_seqs)
    if "predicted_max_concurrency" in plan:
        evidence["knee_vs_prediction"] = (
            f"knee at {knee.users} users; the KV cache holds {plan['predicted_max_concurrency']} "
            f"requests of {plan['tokens_per_request']} tokens")
    if "plan_predicted_max_concurrency" in plan:
        seqs = plan.get("plan_max_num_seqs")
        evidence["knee_vs_plan"] = (
            f"knee at {knee.users} users; the plan predicts {plan['plan_predicted_max_concurrency']} "
            f"requests of this length fit in its {plan['plan_num_blocks']} blocks"
            + (f" and sets max_num_seqs {seqs}" if seqs is not None else ""))
    return steps, [Verdict("kv-exhaustion", knee.classification, evidence, _next(knee.classification))]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _next(cause: str) -> str:
    return {
        KV_BOUND: "KV-bound: `kvops plan` for this model, then raise --gpu-memory-utilization / "
                  "--kv-cache-memory-bytes, use --kv-cache-dtype fp8, or cap --max-num-seqs at the "
                  "predicted concurrency (runbooks/kv-exhaustion.md)",
        SEQ_BOUND: "running is pinned at --max-num-seqs with KV to spare: raise --max-num-seqs "
                   "(runbooks/kv-exhaustion.md)",
        COMPUTE_BOUND: "requests queue with KV and sequences to spare: raise "
                       "--max-num-batched-tokens or add replicas (runbooks/kv-exhaustion.md)",
        FAILING: "requests fail under load: read the server log around the knee "
                 "(runbooks/kv-exhaustion.md)",
    }[cause]


def steps_table(steps: list[StepResult]) -> list[dict[str, Any]]:
    return [asdict(s) for s in steps]
