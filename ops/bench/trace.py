"""``kvops bench trace``: ``kvops trace stats`` on the 12k-request Mooncake conversation trace.

Times reading the trace and the whole LRU curve from one stack-distance pass (the target: under
2 s), beside a plain OrderedDict LRU simulation of the same sizes, one pass per size, which is
also the agreement check: both must give the same hit ratio at every size.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.trace.read import TraceRequest, read_trace
from kvops.core.trace.summary import trace_stats

TRACE_ENV = "KVOPS_TRACE"
DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared/fixtures/traces/mooncake_conversation_trace.jsonl"
TARGET_S = 2.0


def _simulated(requests: tuple[TraceRequest, ...], capacity: int, block: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for req in requests:
        k = 0
        for block_id in req.hash_ids:
            if block_id not in cache:
                break
            k += 1
        hit += min(block * k, req.input_tokens)
        total += req.input_tokens
        for block_id in req.hash_ids:
            cache[block_id] = None
            cache.move_to_end(block_id)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total if total else 0.0


def run() -> dict[str, Any]:
    path = Path(os.environ.get(TRACE_ENV, DEFAULT_TRACE))
    if not path.exists():
        raise BadInputError(f"no trace at {path}: set {TRACE_ENV} to a Mooncake JSONL file")
    start = time.perf_counter()
    trace = read_trace(path)
    read_s = time.perf_counter() - start
    stats = trace_stats(trace)
    stats_s = time.perf_counter() - start
    start = time.perf_counter()
    simulated = [_simulated(trace.requests, p.cache_blocks, trace.block_tokens) for p in stats.lru]
    simulated_s = time.perf_counter() - start
    worst = max((abs(a - p.hit_ratio) for a, p in zip(simulated, stats.lru, strict=True)), default=0.0)
    return {
        "trace": str(path), "requests": stats.requests, "curve_points": len(stats.lru),
        "read_s": round(read_s, 3), "read_and_stats_s": round(stats_s, 3), "target_s": TARGET_S,
        "under_target": stats_s < TARGET_S,
        "ordereddict_simulation_s": round(simulated_s, 3),
        "max_hit_ratio_difference": worst, "agree": worst < 1e-12,
    }
