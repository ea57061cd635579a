"""kv-exhaustion: classify each load step from the server's gauges and the client's tails,
find the knee, and set it beside the capacity the KV cache predicts.

A step is KV-bound when vLLM preempts or holds requests waiting while the cache is (nearly)
full: at kv_usage_bound, or with fewer free blocks than the step's smallest prompt needs (a
small pool is full at 80%: 3 free blocks of 15 admit no 4-block prompt); sequence-limit-bound
when requests wait while ``running`` sits flat at the same ceiling with KV to spare;
compute-bound when they wait with neither limit reached (token budget or plain compute);
failing when requests error.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.plan import PLAN_COMMANDS, Expectation, KvGroup, read_expectation
from kvops.core.prom import MetricsSample, cache_int, delta, window
from kvops.core.promql import free_blocks
from kvops.core.stats import mean, percentile
from kvops.core.verdict import Verdict
from kvops.loadtest.analysis.load import more_workers
from kvops.loadtest.analysis.ramp import Tested, next_run
from kvops.loadtest.config import KvExhaustionConfig
from kvops.loadtest.records import RequestRecord

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
    kv_free_blocks_min: float | None = None
    """The fewest free KV blocks in the step's readings (a fleet's: in its fullest replica)."""
    prompt_blocks_min: int | None = None
    """Blocks the step's smallest prompt needs: a waiting request cannot be admitted in fewer."""
    request_s_p50: float | None = None
    """How long the step's requests lasted, sent to done (those the run's end cut off: so far)."""
    counters_late_s: float = 0.0
    """How far past the step's end its counters were read: a replica whose scrape failed over
    the end reports what it counted in the step only at its next reading (_counter_edge)."""


def step_bounds(config: KvExhaustionConfig, started_at: float) -> list[tuple[int, float, float]]:
    return [(users, started_at + i * config.step_s, started_at + (i + 1) * config.step_s)
            for i, users in enumerate(config.steps or [])]


def measure_step(index: int, users: int, start: float, end: float, config: KvExhaustionConfig,
                 records: list[RequestRecord], samples: list[MetricsSample]) -> StepResult:
    settled = start + (end - start) * config.settle_fraction
    sent = [r for r in records if start <= r.sent_at < end]
    done = [r for r in records if settled <= r.done_at < end and r.ok]
    in_step = window(samples, settled, end) or window(samples, start, end)
    edge = _counter_edge(samples, start, end)
    ttfts = [r.ttft_s for r in sent if r.ttft_s is not None]
    frees = [f for f in map(free_blocks, in_step) if f is not None]
    size = next((b for b in (cache_int(s, "block_size") for s in reversed(samples)) if b), None)
    prompts = [r.prompt_tokens for r in sent if r.prompt_tokens]
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
        kv_free_blocks_min=min(frees) if frees else None,
        prompt_blocks_min=math.ceil(min(prompts) / size) if prompts and size else None,
        request_s_p50=percentile([r.e2e_s for r in sent if r.e2e_s and (r.ok or r.stopped)], 50),
        counters_late_s=round(max(0.0, edge[-1].t - end), 3) if edge else 0.0,
    )


def _counter_edge(samples: list[MetricsSample], start: float, end: float) -> list[MetricsSample]:
    """The readings a step's counter deltas run over: from just before the step to its end, not
    past it (the next step's users start at ``end``; a preemption they cause must not make this
    step look KV-bound), unless a replica of a fleet was unread at the end. A replica too busy to
    answer its scrape (the KV-bound one, as a rule) is held at its last counts, and its preemptions
    in the step reach only its next reading: CI once saw a step with 0 where the replica had 1.
    Then the deltas run to the first reading, within one more step, that has them all again."""
    edge = window(samples, start - 1.5, end)
    if not edge or not edge[-1].unread:
        return edge
    missing = set(edge[-1].unread)
    late = next((s for s in samples if end < s.t <= end + (end - start) and not missing & set(s.unread)), None)
    return edge + [late] if late is not None else edge


def classify(step: StepResult, previous: StepResult | None, config: KvExhaustionConfig) -> str:
    if step.requests and step.errors >= 2 and step.errors / step.requests > config.error_rate_failing:
        return FAILING
    queued = step.waiting_fraction >= QUEUED_FRACTION
    if step.preemptions > 0 or (queued and kv_full(step, config)):
        return KV_BOUND
    if queued:
        if step.max_num_seqs:
            # exact: the plugin publishes the limit (a token budget also pins `running`, at a
            # count below it, e.g. one long prompt prefilling in 32-token chunks)
            return SEQ_BOUND if step.running_max >= step.max_num_seqs else COMPUTE_BOUND
        plateau = previous is not None and previous.running_max >= step.running_max
        return SEQ_BOUND if plateau else COMPUTE_BOUND
    return OK


def kv_full(step: StepResult, config: KvExhaustionConfig) -> bool:
    """The cache admits no waiting request: usage at kv_usage_bound, or fewer free blocks than the
    step's smallest prompt needs (vLLM's scheduler allocates a new request's prompt blocks before
    running it; a shared prefix would need fewer, so this reads the pool as fuller than it is
    only for prompts that share one)."""
    if step.kv_usage_max >= config.kv_usage_bound:
        return True
    free, need = step.kv_free_blocks_min, step.prompt_blocks_min
    return free is not None and need is not None and free < need


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


def load_expectation(path: Path) -> Expectation:
    """``kvops plan --json`` or ``kvops kv-capacity --json`` output; it must give the KV pool."""
    expected = read_expectation(path)
    if expected.capacity.pool() is None:
        raise BadInputError(f"--expect {path}: not a plan; pass the JSON of {PLAN_COMMANDS} for this server")
    return expected


def _group_blocks(group: KvGroup, tokens: int, size: int) -> int:
    """Blocks one request of ``tokens`` holds in a KV group, by the rules of
    kvops.ops.capacity.allocator.Spec.blocks_per_request (whose value at max_model_len the
    document carries as the group's ceiling): a sliding window keeps one block more than it
    covers, a mamba group a fixed number."""
    need = math.ceil(tokens / (group.block_size or size))
    kind, ceiling = group.kind, group.blocks_per_request
    if ceiling <= 0:
        return need
    if kind == "mamba":
        return ceiling
    return min(need + 1 if kind == "sliding" else need, ceiling)


def planned_concurrency(expected: Expectation, tokens_per_request: float) -> dict[str, Any]:
    """What the planner predicts for requests of this length: their blocks summed over the KV
    groups, out of num_blocks − 1 usable ones (block 0 is vLLM's null block), as
    kvops.ops.capacity.plan.derive_max_num_seqs counts them."""
    pool = expected.capacity.pool()
    if tokens_per_request <= 0 or pool is None:
        return {}
    num_blocks, size = pool
    tokens = math.ceil(tokens_per_request)
    groups = expected.capacity.groups
    per_request = (sum(_group_blocks(g, tokens, size) for g in groups) if groups
                   else math.ceil(tokens / size))  # one full-attention group
    out = {"plan_num_blocks": num_blocks, "plan_block_size": size, "plan_blocks_per_request": per_request,
           "plan_predicted_max_concurrency": (num_blocks - 1) // max(per_request, 1)}
    if expected.max_num_seqs is not None:
        out["plan_max_num_seqs"] = expected.max_num_seqs
    return out


def analyse(config: KvExhaustionConfig, records: list[RequestRecord], samples: list[MetricsSample],
            started_at: float, expected: Expectation | None = None,
            ramp: dict[str, Any] | None = None, processes: int = 1
            ) -> tuple[list[StepResult], list[Verdict]]:
    """``ramp``: how the steps were sized from the server (None: the operator gave them);
    ``processes``: the Locust processes that sent the load (a rerun asks for more)."""
    steps: list[StepResult] = []
    for i, (users, start, end) in enumerate(step_bounds(config, started_at)):
        step = measure_step(i, users, start, end, config, records, samples)
        step.classification = classify(step, steps[-1] if steps else None, config)
        steps.append(step)
    prompt = mean([float(r.prompt_tokens) for r in records if r.prompt_tokens]) or 0.0
    tokens = prompt + config.workload.max_tokens
    if ramp is not None and ramp.get("tokens_per_request"):
        # the length the ramp was sized with: a dataset's bodies carry their own max_tokens,
        # and the knee the verdict names must be the one the ramp stepped past
        tokens = float(ramp["tokens_per_request"])
    plan = predicted_concurrency(samples[-1] if samples else None, tokens)
    if expected is not None:
        plan.update(planned_concurrency(expected, tokens))
        if "num_gpu_blocks" in plan:
            plan["plan_matches_server_blocks"] = plan["plan_num_blocks"] == plan["num_gpu_blocks"]
    knee = next((s for s in steps if s.classification != OK), None)
    ok_steps = [s for s in steps if s.classification == OK and (knee is None or s.index < knee.index)]
    evidence: dict[str, Any] = {
        "steps": [{"users": s.users, "class": s.classification} for s in steps], **plan,
        "last_ok_users": ok_steps[-1].users if ok_steps else 0,
    }
    if ramp is not None:
        evidence["ramp"] = ramp
    if knee is None:
        return steps, [_no_limit(config, steps, evidence, ramp, processes)]
    evidence.update({
        "knee_users": knee.users, "waiting_max": knee.waiting_max, "running_max": knee.running_max,
        "kv_usage_max": round(knee.kv_usage_max, 4), "preemptions": knee.preemptions,
        "ttft_p99_s": knee.ttft_p99_s, "errors": knee.errors,
        "ttft_p99_ratio_to_first_step": _ratio(knee.ttft_p99_s, steps[0].ttft_p99_s),
    })
    if knee.max_num_seqs is not None:
        evidence["server_max_num_seqs"] = int(knee.max_num_seqs)
    if knee.kv_free_blocks_min is not None and knee.prompt_blocks_min is not None:
        evidence.update(kv_free_blocks_min=knee.kv_free_blocks_min, prompt_blocks_min=knee.prompt_blocks_min)
    if knee.counters_late_s:
        evidence["counters_late_s"] = knee.counters_late_s  # a replica's scrapes failed over its end
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


CLIENT_KEPT = 0.5
"""Share of a step's users the server must see (running + waiting) for the step to count as
offered: closed-loop users each keep one request in flight, unless the client falls behind."""


def _no_limit(config: KvExhaustionConfig, steps: list[StepResult], evidence: dict[str, Any],
              ramp: dict[str, Any] | None, processes: int = 1) -> Verdict:
    """No step bound: the run never reached the KV limit, so it says that and what to run next
    (``inconclusive`` / ``limit-not-reached``), whoever chose the users: a sized ramp that ended
    below the knee, or the ``--users``/``steps`` the operator gave. Never healthy about a limit
    it did not test (issue 18); the load it did carry is in the evidence (``max_users_tested``,
    ``kv_usage_max_reached``). A client that did not keep its users in flight tested nothing."""
    top = steps[-1] if steps else None
    seen = (top.running_max + top.waiting_max) if top else 0.0
    evidence.update({
        "max_users_tested": top.users if top else 0, "limit_reached": False,
        "kv_usage_max_reached": round(max((s.kv_usage_max for s in steps), default=0.0), 4),
        "running_max_at_top": top.running_max if top else 0.0,
    })
    if top is not None and seen < CLIENT_KEPT * top.users:
        return Verdict("inconclusive", "client-bound", {**evidence, "in_flight_seen_at_top": seen},
                       f"the server saw at most {seen:.0f} of the {top.users} users' requests: the "
                       f"load generator fell behind; rerun with --workers {more_workers(processes)} "
                       "or on a machine with more CPU for the client (`kvops runbook kv-exhaustion`)")
    tested = Tested(top_users=top.users if top else 0, steps=len(steps), step_s=config.step_s,
                    kv_usage_max=evidence["kv_usage_max_reached"],
                    request_s=top.request_s_p50 if top else None, sized=ramp is not None)
    predicted = evidence.get("predicted_max_concurrency")
    if ramp is None:
        evidence["note"] = (f"no limit bound up to the {tested.top_users} users asked for"
                            + (f"; the KV cache holds ~{predicted} such requests" if predicted else ""))
    return Verdict("inconclusive", "limit-not-reached", evidence,
                   next_run(ramp, config, tested, int(predicted) if predicted else None))


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _next(cause: str) -> str:
    return {
        KV_BOUND: "KV-bound: `kvops plan` for this model, then raise --gpu-memory-utilization / "
                  "--kv-cache-memory-bytes, use --kv-cache-dtype fp8, or cap --max-num-seqs at the "
                  "predicted concurrency (`kvops runbook kv-exhaustion`)",
        SEQ_BOUND: "running is pinned at --max-num-seqs with KV to spare: raise --max-num-seqs "
                   "(`kvops runbook kv-exhaustion`)",
        COMPUTE_BOUND: "requests queue with KV and sequences to spare: raise "
                       "--max-num-batched-tokens or add replicas (`kvops runbook kv-exhaustion`)",
        FAILING: "requests fail under load: read the server log around the knee "
                 "(`kvops runbook kv-exhaustion`)",
    }[cause]


def steps_table(steps: list[StepResult]) -> list[dict[str, Any]]:
    return [asdict(s) for s in steps]
