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
    """Doubling steps that end at 2 × the predicted knee (the top itself, e.g. 1, 2, 4, 8, 16, 22
    for a knee of 11), fit into ``max_duration_s``: steps shrink to the budget down to
    ``min_step_s``; a ramp still too long keeps its first step (the unloaded reference) and its
    top ones, never a top below the one it targets."""
    knee = capacity.knee
    top = min(max(2 * knee if knee else MIN_TOP, MIN_TOP), config.max_users)
    wanted = doubling_steps(top)
    step_s = max(config.min_step_s, min(config.step_s, config.max_duration_s / len(wanted)))
    # the tolerance inside the floor: 40 / (40 / 6) is 5.999..., and flooring it left the top out
    fit = max(1, math.floor(config.max_duration_s / step_s + 1e-9))
    return Ramp(_thinned(wanted, fit), step_s, capacity, top)


def _thinned(steps: list[int], fit: int) -> list[int]:
    """At most ``fit`` of ``steps``: the first and the last ``fit - 1`` (the knee and its top)."""
    if len(steps) <= fit:
        return steps
    return steps[-1:] if fit == 1 else steps[:1] + steps[-(fit - 1):]


@dataclass(frozen=True)
class Tested:
    """What a run that bound no limit did and saw: the ground its next run must go beyond."""

    top_users: int
    steps: int
    step_s: float
    kv_usage_max: float
    """The highest KV usage any step read."""
    request_s: float | None
    """How long the top step's requests lasted, sent to done (p50; one the run's end cut off
    counts with its time so far): a step shorter than this never sees them release their KV."""
    sized: bool
    """The steps were sized from the server (not --users or the scenario's steps)."""


REQUESTS_PER_STEP = 2.0
"""A step long enough to see this many requests through, one after another, per user: the
queue a full cache makes forms when running requests grow or end, not when they arrive."""


def next_run(ramp: dict[str, Any] | None, config: KvExhaustionConfig, tested: Tested,
             predicted: int | None = None) -> str:
    """What to run when no limit bound, read off what the run did (``tested``) so that it never
    advises the same run again: the same users with longer steps where the cache filled and no
    request waited, more users where it did not fill, past the knee where the run stopped short
    of it. ``predicted``: the KV cache's concurrency where the operator gave the steps."""
    knee = int(ramp["predicted_knee_users"]) if ramp and ramp.get("predicted_knee_users") else predicted
    why, users = _what_was_missing(tested, knee, config)
    # the same users again only where the steps were too short: then they grow
    step_s = _step_s(tested, config, longer=users == tested.top_users)
    duration = math.ceil(len(doubling_steps(users)) * step_s)
    return f"{why}; rerun with --users {users} --duration {duration} (`kvops runbook kv-exhaustion`)"


def _what_was_missing(tested: Tested, knee: int | None, config: KvExhaustionConfig) -> tuple[str, int]:
    """Why the run bound nothing, and the top users of the next run."""
    top, usage = tested.top_users, tested.kv_usage_max
    if usage >= config.kv_usage_bound:
        took = f" while a request took {tested.request_s:.1f} s" if tested.request_s else ""
        return (f"the KV cache filled ({usage:.0%}) at {top} users but within steps of "
                f"{tested.step_s:g} s{took} no step saw requests queue or get preempted: the steps "
                "were too short for the queue to form, so run the same users with longer steps"), top
    if knee is None:
        return ("the server publishes no KV capacity (vllm:cache_config_info), so the ramp "
                f"could not be sized and {top} users bound nothing: give more load explicitly "
                "and check the knee by hand"), max(64, 4 * top)
    if top < 2 * knee:
        cap = (f" (the scenario's max_users {config.max_users} stopped the ramp)"
               if tested.sized and top >= config.max_users else "")
        sized = "" if tested.sized else " (or rerun without --users: a ramp sized to the server)"
        return (f"{top} users fit{cap}: the knee is predicted at ~{knee} users and this run did "
                f"not reach twice that{sized}"), 2 * knee
    # twice the knee ran and nothing bound: requests took less KV than their lengths say
    return (f"no limit bound up to {top} users, at least twice the ~{knee} the KV cache is "
            f"predicted to hold, and KV usage peaked at {usage:.0%}: requests used less KV than "
            "their lengths say (shared prefix blocks, outputs ending before max_tokens: set "
            "ignore_eos in the workload) or the server has more blocks than it publishes"), max(4 * knee, 2 * top)


def _step_s(tested: Tested, config: KvExhaustionConfig, longer: bool) -> float:
    """The next run's step: as long as this run's (at least the scenario's min_step_s), and with
    the same users at least twice as long and long enough for REQUESTS_PER_STEP requests."""
    step = max(tested.step_s, config.min_step_s)
    if not longer:
        return step
    return max(2 * step, REQUESTS_PER_STEP * (tested.request_s or 0.0) / (1 - config.settle_fraction))
