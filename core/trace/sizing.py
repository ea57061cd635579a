"""Cache sizes from a trace's LRU curve: how many blocks reach a fraction of the reuse an
unbounded cache would deliver. The planner turns blocks into GiB for a model and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvops.core.trace.reuse import ReuseProfile


@dataclass(frozen=True)
class CacheTarget:
    target_hit_fraction: float
    unbounded_hit_ratio: float
    target_hit_ratio: float
    """target_hit_fraction × unbounded_hit_ratio."""
    blocks_for_target: int
    """The smallest LRU cache (in trace blocks) whose hit ratio reaches target_hit_ratio."""
    blocks_for_all: int
    """The smallest LRU cache that delivers all of the unbounded reuse."""


def smallest_cache(profile: ReuseProfile, hit_tokens: float) -> int:
    """The fewest blocks an LRU cache needs to find at least ``hit_tokens`` over the trace
    (0 when nothing is asked); the curve is a step function of the blocks, so this is exact."""
    if hit_tokens <= 0:
        return 0
    sizes = np.sort(profile.needed)
    cumulative = np.cumsum(profile.added[np.argsort(profile.needed, kind="stable")])
    index = int(np.searchsorted(cumulative, hit_tokens - 1e-9, side="left"))
    if index >= sizes.size:
        raise ValueError(f"no cache finds {hit_tokens} tokens: the trace reuses {int(cumulative[-1])}")
    return int(sizes[index])


def cache_target(profile: ReuseProfile, target_hit_fraction: float) -> CacheTarget:
    if not 0 < target_hit_fraction <= 1:
        raise ValueError("target_hit_fraction must be in (0, 1]")
    total = profile.hit_tokens(float("inf"))
    return CacheTarget(
        target_hit_fraction=target_hit_fraction, unbounded_hit_ratio=profile.unbounded_ratio,
        target_hit_ratio=profile.unbounded_ratio * target_hit_fraction,
        blocks_for_target=smallest_cache(profile, total * target_hit_fraction),
        blocks_for_all=profile.saturation_blocks)
