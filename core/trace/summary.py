"""``kvops trace stats``: a trace's lengths, arrival rate and prefix reuse as one typed value."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvops.core.stats import mean, percentile
from kvops.core.trace.read import Trace
from kvops.core.trace.reuse import HitRule, ReuseProfile, reuse_profile

SMALLEST_DEFAULT_BLOCKS = 64


@dataclass(frozen=True)
class Lengths:
    mean: float
    p50: float
    p90: float
    p99: float
    max: int


@dataclass(frozen=True)
class LruPoint:
    cache_blocks: int
    hit_ratio: float


@dataclass(frozen=True)
class TraceStats:
    path: str
    format: str
    requests: int
    duration_s: float
    arrival_rate_rps: float | None
    """None when every request arrives at the same instant."""
    input_tokens: Lengths
    output_tokens: Lengths
    block_tokens: int
    has_block_ids: bool
    prefix_reuse_ratio: float
    saturation_blocks: int
    """The smallest LRU cache (in blocks) that reaches the unbounded reuse."""
    lru: tuple[LruPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lengths(values: Sequence[int]) -> Lengths:
    """Mean, numpy's default (linear) percentiles and max of a non-empty list of token counts."""
    p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
    average = mean(values)
    if average is None or p50 is None or p90 is None or p99 is None:
        raise ValueError("no lengths")
    return Lengths(mean=average, p50=p50, p90=p90, p99=p99, max=max(values))


def default_cache_blocks(profile: ReuseProfile) -> list[int]:
    """Powers of two from 64 blocks to the first size that reaches the unbounded reuse."""
    sizes = [SMALLEST_DEFAULT_BLOCKS]
    while sizes[-1] < profile.saturation_blocks:
        sizes.append(sizes[-1] * 2)
    return sizes


def trace_stats(trace: Trace, cache_blocks: Sequence[int] | None = None) -> TraceStats:
    reqs = trace.requests
    profile = reuse_profile(reqs, HitRule(trace.block_tokens))
    duration = reqs[-1].timestamp_s - reqs[0].timestamp_s
    sizes = list(cache_blocks) if cache_blocks else default_cache_blocks(profile)
    return TraceStats(
        path=str(trace.path), format=trace.format, requests=len(reqs), duration_s=duration,
        arrival_rate_rps=len(reqs) / duration if duration > 0 else None,
        input_tokens=lengths([r.input_tokens for r in reqs]),
        output_tokens=lengths([r.output_tokens for r in reqs]),
        block_tokens=trace.block_tokens, has_block_ids=trace.has_hash_ids,
        prefix_reuse_ratio=profile.unbounded_ratio, saturation_blocks=profile.saturation_blocks,
        lru=tuple(LruPoint(n, profile.hit_ratio(n)) for n in sizes),
    )
