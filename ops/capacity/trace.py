"""``kvops plan --trace``: the workload and the offload tiers from a production trace.

Lengths (prompt + output, clipped to max_model_len) give the workload max_num_seqs is sized
for; the arrival rate is reported beside it. The trace's LRU curve (kvops.core.trace.reuse)
says what the planned KV cache alone would find, and how large a cache reaches
``target_hit_fraction`` of what an unbounded one finds: that size, beyond the GPU's, is the
LMCache L1 (up to --host-memory-gib) and the rest its disk tier, in GiB for the planned model
and KV dtype. The curve is exact for an LRU cache; vLLM's and LMCache's are LRU per block and
per chunk, so it is their model, not a measurement (`kvops loadtest trace-replay` measures).
"""

from __future__ import annotations

import math
from collections import Counter

from kvops.core.errors import BadInputError
from kvops.core.plan import OffloadAdvice, Plan, TraceAdvice, TraceCurvePoint
from kvops.core.stats import nearest_rank
from kvops.core.trace.read import Trace
from kvops.core.trace.reuse import HitRule, ReuseProfile, reuse_profile
from kvops.core.trace.sizing import cache_target
from kvops.core.trace.summary import default_cache_blocks
from kvops.ops.capacity.constants import GIB
from kvops.ops.capacity.offload import GIB_STEP
from kvops.ops.capacity.outputs import kvops_settings, offload_chunk_tokens
from kvops.ops.capacity.workload import Workload


def trace_workload(trace: Trace, max_model_len: int) -> tuple[Workload, int]:
    """The trace's request lengths as a workload, and how many exceed max_model_len."""
    lengths = [r.input_tokens + r.output_tokens for r in trace.requests]
    over = sum(1 for n in lengths if n > max_model_len)
    counts = Counter(max(1, min(n, max_model_len)) for n in lengths)
    histogram = tuple(sorted(counts.items()))
    p50, p95, p99 = (nearest_rank(histogram, q) for q in (0.50, 0.95, 0.99))
    return Workload(max_model_len, p50, p95, p99, histogram,
                    f"trace {trace.path.name} ({len(lengths)} requests)"), over


def trace_profile(trace: Trace) -> ReuseProfile:
    """The trace's LRU curve as ``kvops trace stats`` defines it (issue 17)."""
    return reuse_profile(trace.requests, HitRule(trace.block_tokens))


def with_trace(plan: Plan, trace: Trace, over: int, kv_bytes_per_token: int, target_hit_fraction: float,
               host_memory_gib: float | None, profile: ReuseProfile | None = None) -> Plan:
    """The plan with its offload sized from the trace's LRU curve and the curve beside it."""
    if not 0 < target_hit_fraction <= 1:
        raise BadInputError(f"--target-hit-fraction must be in (0, 1], got {target_hit_fraction}")
    profile = profile or trace_profile(trace)
    advice = _advice(plan, trace, profile, over, kv_bytes_per_token, target_hit_fraction)
    offload = _offload(plan, advice, kv_bytes_per_token, host_memory_gib)
    return plan.model_copy(update={"trace": advice, "offload": offload,
                                   "kvops_yaml": kvops_settings(plan, offload)})


def _gib(tokens: int, kv_bytes_per_token: int) -> float:
    return tokens * kv_bytes_per_token / GIB


def _advice(plan: Plan, trace: Trace, profile: ReuseProfile, over: int, kv_bytes_per_token: int,
            fraction: float) -> TraceAdvice:
    block = trace.block_tokens
    gpu_tokens = plan.capacity.kv_cache_size_tokens
    target = cache_target(profile, fraction)
    sizes = sorted({*default_cache_blocks(profile), gpu_tokens // block, target.blocks_for_target})
    curve = tuple(TraceCurvePoint(cache_tokens=n * block, cache_gib=round(_gib(n * block, kv_bytes_per_token), 3),
                                  hit_ratio=round(profile.hit_ratio(n), 4)) for n in sizes)
    first, last = trace.requests[0].timestamp_s, trace.requests[-1].timestamp_s
    duration = last - first
    return TraceAdvice(
        source=str(trace.path), requests=len(trace.requests), duration_s=duration,
        arrival_rate_rps=len(trace.requests) / duration if duration > 0 else None,
        requests_over_max_model_len=over, block_tokens=block,
        prefix_reuse_ratio=round(profile.unbounded_ratio, 4), target_hit_fraction=fraction,
        target_hit_ratio=round(target.target_hit_ratio, 4), gpu_cache_tokens=gpu_tokens,
        gpu_hit_ratio=round(profile.hit_ratio(gpu_tokens // block), 4),
        tokens_for_target=target.blocks_for_target * block, tokens_for_all_reuse=target.blocks_for_all * block,
        curve=curve)


def _offload(plan: Plan, advice: TraceAdvice, kv_bytes_per_token: int, host_memory_gib: float | None) -> OffloadAdvice:
    chunk = offload_chunk_tokens(plan.capacity.block_size)
    working_set = _gib(advice.tokens_for_target, kv_bytes_per_token)
    if advice.prefix_reuse_ratio == 0:
        return OffloadAdvice(lmcache_cpu_gib=None, lmcache_disk_gib=None, working_set_gib=0.0,
                             warning="the trace shows no prefix reuse (or carries no block ids): "
                                     "offload cannot help; leave it off")
    if advice.tokens_for_target <= advice.gpu_cache_tokens:
        return OffloadAdvice(lmcache_cpu_gib=None, lmcache_disk_gib=None, working_set_gib=working_set,
                             warning=f"the GPU KV cache ({advice.gpu_cache_tokens:,} tokens) already reaches "
                                     f"{advice.target_hit_fraction:.0%} of the trace's reuse; offload adds "
                                     "restart persistence, not hits")
    wanted = math.ceil(working_set / GIB_STEP) * GIB_STEP
    l1 = wanted if host_memory_gib is None else min(wanted, math.floor(host_memory_gib / GIB_STEP) * GIB_STEP)
    disk = wanted if wanted > l1 else None  # inclusive: the whole target (ops/capacity/tiers.py)
    return OffloadAdvice(
        lmcache_cpu_gib=l1, lmcache_disk_gib=disk, working_set_gib=working_set, chunk_tokens=chunk,
        why=(f"an LRU cache of {advice.tokens_for_target:,} tokens finds {advice.target_hit_fraction:.0%} of the "
             f"trace's reuse ({advice.target_hit_ratio:.1%} of prompt tokens; the GPU's "
             f"{advice.gpu_cache_tokens:,} find {advice.gpu_hit_ratio:.1%}) × {kv_bytes_per_token:,} B/token"
             + ("; all of it in L1: --host-memory-gib caps L1 at what the host can spare and puts the "
                "target on disk" if host_memory_gib is None else "")),
        warning=None if l1 > 0 else "--host-memory-gib leaves no L1; LMCache needs an L1 tier in front of disk")
