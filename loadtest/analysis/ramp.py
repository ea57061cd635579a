"""kv-exhaustion's ramp, sized from the server it runs against.

Stepping 1, 2, 4, 8 users against a cache that holds 15 requests ends below the knee and can
only say "nothing happened". So the ramp reads the server's capacity first — its KV blocks and
block size (vllm:cache_config_info), its --max-num-seqs (the kvops plugin's
kvops_scheduler_max_num_seqs gauge, when present) — and the workload's tokens per request, and
doubles users until twice the predicted knee, within a time budget. A run that still never
reaches a limit says so (``inconclusive``) instead of ``healthy``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvops.core.prom import MetricsSample, cache_int
from kvops.loadtest.config import KvExhaustionConfig, doubling_steps

SCHED_MAX_SEQS = "kvops_scheduler_max_num_seqs"
MIN_TOP = 8
"""A sized ramp goes at least this far (the old fixed 1, 2, 4, 8), so a tiny cache's knee has
steps on both sides."""


@dataclass(frozen=True)
class Capacity:
    """What the server holds at once, for requests of ``tokens_per_request`` tokens."""

    num_gpu_blocks: int | None
    block_size: int | None
    max_num_seqs: int | None
    tokens_per_request: float

    @property
    def kv_concurrency(self) -> int | None:
        """Whole requests the KV cache holds (block 0 is vLLM's null block)."""
        if not self.num_gpu_blocks or not self.block_size or self.tokens_per_request <= 0:
            return None
        return (self.num_gpu_blocks - 1) // math.ceil(self.tokens_per_request / self.block_size)

    @property
    def knee(self) -> int | None:
        """Users at which the first limit binds: the KV cache or --max-num-seqs."""
        limits = [x for x in (self.kv_concurrency, self.max_num_seqs) if x]
        return min(limits) if limits else None


def capacity_of(sample: MetricsSample, tokens_per_request: float) -> Capacity:
    seqs = sample.values.get(SCHED_MAX_SEQS)
    return Capacity(cache_int(sample, "num_gpu_blocks"), cache_int(sample, "block_size"),
                    int(seqs) if seqs else None, tokens_per_request)


@dataclass(frozen=True)
class Ramp:
    steps: list[int]
    step_s: float
    capacity: Capacity
    wanted_top: int
    """Users the ramp should reach: 2 × the knee (at least MIN_TOP, at most max_users)."""

    @property
    def covers_knee(self) -> bool:
        knee = self.capacity.knee
        return knee is not None and self.steps[-1] >= 2 * knee

    def to_dict(self) -> dict[str, Any]:
        return {"sized_from": "server", "steps": self.steps, "step_s": round(self.step_s, 3),
                **asdict(self.capacity), "predicted_kv_concurrency": self.capacity.kv_concurrency,
                "predicted_knee_users": self.capacity.knee, "wanted_top_users": self.wanted_top,
                "covers_twice_the_knee": self.covers_knee}


def size(config: KvExhaustionConfig, capacity: Capacity) -> Ramp:
    """Doubling steps to 2 × the predicted knee, fit into ``max_duration_s``: steps shrink to
    the budget down to ``min_step_s``, then the top steps are left out."""
    knee = capacity.knee
    top = min(max(2 * knee if knee else MIN_TOP, MIN_TOP), config.max_users)
    wanted = doubling_steps(top)
    step_s = max(config.min_step_s, min(config.step_s, config.max_duration_s / len(wanted)))
    fit = max(1, int(config.max_duration_s // step_s + 1e-9))
    return Ramp(wanted[:fit], step_s, capacity, top)


def next_run(ramp: dict[str, Any] | None, config: KvExhaustionConfig) -> str:
    """What to run when the ramp ended below the knee."""
    if not ramp or not ramp.get("predicted_knee_users"):
        return ("the server publishes no KV capacity (vllm:cache_config_info): give the load "
                "explicitly, e.g. --users 64 --duration 120, and check the knee by hand "
                "(`kvops runbook kv-exhaustion`)")
    knee = int(ramp["predicted_knee_users"])
    top = int(ramp["wanted_top_users"])
    reached = int(ramp["steps"][-1]) if ramp.get("steps") else 0
    if reached >= 2 * knee:
        # the whole ramp ran and nothing bound: requests took less KV than predicted
        return (f"no limit bound up to {reached} users, twice the ~{knee} the KV cache is "
                "predicted to hold: requests used less KV than their lengths say (shared prefix "
                "blocks, outputs ending before max_tokens: set ignore_eos in the workload) or "
                f"the server has more blocks than it publishes; rerun with --users {4 * knee} "
                "(`kvops runbook kv-exhaustion`)")
    if reached >= top:  # stopped at the scenario's max_users, short of 2 x the knee
        return (f"the knee is predicted at ~{knee} users, beyond the scenario's max_users "
                f"{config.max_users}: rerun with --users {2 * knee} --duration "
                f"{math.ceil(len(doubling_steps(2 * knee)) * config.step_s)} "
                "(`kvops runbook kv-exhaustion`)")
    steps = len(doubling_steps(top))
    seconds = math.ceil(steps * max(config.min_step_s, min(config.step_s, 10.0)))
    return (f"the knee is predicted at ~{knee} users; rerun with "
            f"--duration {seconds} (or --users {top}) to step up to {top} users "
            "(`kvops runbook kv-exhaustion`)")
