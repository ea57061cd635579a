"""``kvops plan --offload-mode``: L1 and disk sizes from the reuse, and whether offload pays.

The sizes are the plan's offload advice (the working set of ``--distinct-prefixes``, or the
LRU cache that reaches ``--target-hit-fraction`` of a trace's reuse). The disk tier there is
inclusive. LMCache's default L2 store policy writes every chunk to every adapter and
keeps L1 (lmcache/v1/distributed/config.py ``--l2-store-policy default``), so a disk tier finds
only what a cache of its own size finds: it must hold the whole target, not the part beyond L1.

Each cache is an LRU of its size over the same request stream, so the GPU finds h(G), L1 adds
h(L1) − h(G) and disk h(disk) − h(L1) (vLLM asks the connector only past its own hit). Two reuse
models give h: a trace's exact LRU curve (kvops.core.trace.reuse), or ``--distinct-prefixes``
read as D prefixes of P tokens, equally popular, at the start of requests of the workload's mean
length: an LRU holding k whole prefixes finds k/D of them (by symmetry, in steady state), so
h(C) = min(1, ⌊C / P⌋ / D) × min(P, mean) / mean, P rounded up to the cache's block or chunk.
That model counts only the prefixes in the cache (the unique suffixes that also pass through
it are left out, an optimistic reading for both sides); a trace gives the real mix.

The time model, in shares of the prefill time of all prompt tokens recomputed without a
connector (kvops.core.offload.costs for the measured ratios; GPU hits cost nothing either way):
offload saves h_l1 × (1 − c_l1 × (1 + m)) + h_disk × (1 − c_disk × (1 + m)) and costs
m × (1 − h) on the tokens still computed; it pays when the saving is larger.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvops.core.errors import BadInputError
from kvops.core.offload.costs import MEASURED, OffloadCosts, read_bench_costs, scaled_costs
from kvops.core.plan import OffloadAdvice, OffloadDecision, Plan
from kvops.core.trace.reuse import ReuseProfile
from kvops.ops.capacity.constants import GIB
from kvops.ops.capacity.outputs import kvops_settings

HitCurve = Callable[[int], float]
"""Share of prompt tokens an LRU cache of this many tokens finds."""


@dataclass(frozen=True)
class ReuseCurves:
    description: str
    gpu: HitCurve  # at vLLM's block granularity
    tier: HitCurve  # at LMCache's chunk granularity


def trace_curves(profile: ReuseProfile, block_tokens: int, source: str) -> ReuseCurves:
    """The trace's exact LRU curve (issue 17's definition), for every cache alike."""
    def hit(tokens: int) -> float:
        return profile.hit_ratio(tokens // block_tokens)

    return ReuseCurves(f"LRU over the trace {source} ({block_tokens}-token blocks)", hit, hit)


def prefix_curves(distinct: int, prefix_tokens: int, mean_length: float, block_size: int,
                  chunk_tokens: int) -> ReuseCurves:
    """D equally popular prefixes of P tokens leading requests of ``mean_length`` tokens."""
    share = min(prefix_tokens, mean_length) / mean_length if distinct and prefix_tokens and mean_length else 0.0

    def curve(unit: int) -> HitCurve:
        size = math.ceil(prefix_tokens / unit) * unit if prefix_tokens else 1
        return lambda tokens: share * min(1.0, (tokens // size) / distinct) if distinct else 0.0

    return ReuseCurves(
        f"{distinct} equally popular prefixes of {prefix_tokens:,} tokens leading requests of "
        f"{mean_length:,.0f} tokens (the workload's mean): {share:.1%} of prompt tokens reusable",
        curve(block_size), curve(chunk_tokens))


def resolve_costs(mode: str | None, costs_file: Path | None, device: str) -> tuple[OffloadCosts, str]:
    """The costs to judge with and why that transfer mode: the file's, else the built-in ones."""
    if costs_file is not None:
        costs = read_bench_costs(costs_file)
        if mode not in (None, "auto", costs.transfer_mode):
            raise BadInputError(f"--offload-mode {mode} but --offload-costs {costs_file} measured "
                                f"{costs.transfer_mode}: give the mode the file measured, or drop --offload-mode")
        return costs, f"{costs.transfer_mode}, as --offload-costs measured"
    if mode in (None, "auto"):
        why = ("auto on --device cpu: L1 shared through /dev/shm, the worker copying loads itself (`kvops "
               "offload serve` shares it where /dev/shm has room for l1_gib; else zero-copy, "
               "--offload-mode lmcache_driven)" if device == "cpu" else "auto with the KV cache on the GPU")
        return MEASURED["engine_driven"], f"engine_driven ({why})"
    if mode not in MEASURED:
        raise BadInputError(f"--offload-mode {mode!r}: use auto, engine_driven or lmcache_driven")
    return MEASURED[mode], f"{mode}, as --offload-mode asked"


def machine_costs(costs: OffloadCosts, from_file: bool, device: str, kv_bytes_per_token: int,
                  flops_per_token: float, hit_tokens: float, weight_bytes: float | None = None) -> OffloadCosts:
    """The hit ratios for this model: on --device cpu recomputed from the figures that carry over
    (kvops.core.offload.costs.scaled_costs) where the costs have them, else the measured ratios,
    saying why."""
    if device != "cpu":
        return costs.model_copy(update={"derivation": (
            "the measured ratios: on a GPU a load crosses the host link at a share of it kvops has not "
            "measured (kvops bench offload runs on CPU), so the CPU's ratios stand in")})
    if costs.figures is None:
        return costs if costs.derivation else costs.model_copy(update={"derivation": (
            f"the measured ratios: no load figures are measured for {costs.transfer_mode}")})
    scaled = scaled_costs(costs, kv_bytes_per_token, flops_per_token, hit_tokens, weight_bytes)
    if from_file:
        return scaled
    return scaled.model_copy(update={"derivation": (
        f"{scaled.derivation}; the figures are kvops' reference CPU's (kvops.core.offload.costs): for this "
        "machine's, run `kvops bench offload --json > bench.json` here and pass --offload-costs bench.json")})


def _tokens(gib: float | None, kv_bytes_per_token: int) -> int:
    return int(gib * GIB // kv_bytes_per_token) if gib else 0


def with_offload_decision(plan: Plan, curves: ReuseCurves, costs: OffloadCosts, mode_why: str,
                          kv_bytes_per_token: int, explicit_mode: bool, kvops_yaml_path: str) -> Plan:
    """The plan with its offload decided: sizes and kvops.yaml when it pays, neither when not."""
    advice = plan.offload
    l1 = advice.lmcache_cpu_gib or None
    disk = advice.lmcache_disk_gib if l1 else None  # already inclusive: the whole target
    gpu_tokens = plan.capacity.kv_cache_size_tokens
    l1_tokens, disk_tokens = _tokens(l1, kv_bytes_per_token), _tokens(disk, kv_bytes_per_token)
    gpu_hit = curves.gpu(gpu_tokens)
    upto_l1 = max(gpu_hit, curves.tier(l1_tokens))
    total = max(upto_l1, curves.tier(disk_tokens))
    m = costs.miss_overhead_ratio
    saved = ((upto_l1 - gpu_hit) * (1 - costs.l1_ttft_ratio * (1 + m))
             + (total - upto_l1) * (1 - costs.disk_ttft_ratio * (1 + m)))
    overhead = m * (1 - total)
    pays = l1 is not None and saved > overhead
    reason = _reason(pays, advice, l1, gpu_hit, total, saved, overhead, costs)
    mode = costs.transfer_mode
    section_mode = mode if explicit_mode else None
    offload = _decided_offload(advice, pays, l1, disk, reason)
    decision = OffloadDecision(
        recommendation="enable" if pays else "leave-off", reason=reason, transfer_mode=mode_why, costs=costs,
        reuse_model=curves.description, kv_bytes_per_token=kv_bytes_per_token, gpu_cache_tokens=gpu_tokens,
        l1_gib=l1 if pays else None, disk_gib=disk if pays else None, l1_tokens=l1_tokens, disk_tokens=disk_tokens,
        gpu_hit_ratio=round(gpu_hit, 4), hit_ratio=round(total, 4), l1_hit_ratio=round(upto_l1 - gpu_hit, 4),
        disk_hit_ratio=round(total - upto_l1, 4), prefill_saved_fraction=round(saved, 4),
        miss_overhead_fraction=round(overhead, 4), net_saved_fraction=round(saved - overhead, 4),
        commands=(f"kvops offload serve --config {shlex.quote(kvops_yaml_path)}", plan.serve) if pays else ())
    return plan.model_copy(update={"offload": offload, "offload_decision": decision,
                                   "kvops_yaml": kvops_settings(plan, offload, section_mode)})


def _decided_offload(advice: OffloadAdvice, pays: bool, l1: float | None, disk: float | None,
                     reason: str) -> OffloadAdvice:
    if pays:
        return advice.model_copy(update={"lmcache_disk_gib": disk})
    return advice.model_copy(update={"lmcache_cpu_gib": None, "lmcache_disk_gib": None, "warning": reason})


def _reason(pays: bool, advice: OffloadAdvice, l1: float | None, gpu_hit: float, total: float, saved: float,
            overhead: float, costs: OffloadCosts) -> str:
    mode, miss = costs.transfer_mode, f"{costs.miss_overhead_ratio:.0%}"
    if l1 is None:
        return f"leave it off: {advice.warning or 'nothing to size'}"
    if pays:
        return (f"enable: L1 and disk hits save {saved:.1%} of prefill time, more than the {overhead:.1%} "
                f"that {mode}'s +{miss} per miss costs (prompt tokens found {gpu_hit:.1%} -> {total:.1%})")
    if total <= gpu_hit:
        return (f"leave it off: the GPU KV cache alone finds {gpu_hit:.1%} of prompt tokens and the tiers add "
                f"none; offload would only add {mode}'s +{miss} per miss")
    return (f"leave it off: L1 and disk hits would save {saved:.1%} of prefill time, less than the "
            f"{overhead:.1%} that {mode}'s +{miss} per miss costs (prompt tokens found {gpu_hit:.1%} -> "
            f"{total:.1%})")
