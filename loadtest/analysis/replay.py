"""trace-replay: the server's measured prefix hit ratio beside the one the trace predicts.

Measured: (Δ``vllm:prefix_cache_hits`` + Δ``vllm:external_prefix_cache_hits``) /
Δ``vllm:prefix_cache_queries`` over the run; vLLM asks the connector only for the tokens past
its own hit, so the two hit counters add up (vllm/v1/core/sched/scheduler.py,
connector_prefix_cache_stats). Predicted: the requests that reached the server, through LRU
models of its cache (``num_gpu_blocks`` × ``block_size`` from ``vllm:cache_config_info``) and,
when the run shows external lookups, of its offload tier (kvops.core.trace.replay).

Below the prediction, the prompts sent are read first: their ideal hit rate (an infinite cache
at the server's block size, what was prefilled before each was sent) and the shared structure
inferred from their tokens (kvops.loadtest.analysis.drift, as prefix-miss does on a dataset).
If even an infinite cache could not reach the prediction and a per-request span sits inside
shared text, the verdict is prefix-drift; otherwise the cache lost what it should have held.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import requests

from kvops.core.errors import BadInputError, KvopsError
from kvops.core.prom import MetricsSample, cache_int, delta, prefix_caching_enabled
from kvops.core.trace.read import read_trace
from kvops.core.trace.replay import (
    Replay,
    ReplayOptions,
    ServerCache,
    Timing,
    conversation_of,
    plan_replay,
    predict,
)
from kvops.core.verdict import Verdict, healthy
from kvops.loadtest.analysis import prefix
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.config import TraceReplayConfig
from kvops.loadtest.records import RequestRecord


def server_max_model_len(url: str, headers: dict[str, str] | None = None) -> int:
    """The served model's max_model_len, as vLLM lists it in /v1/models."""
    try:
        resp = requests.get(url.rstrip("/") + "/v1/models", timeout=30, headers=headers)
        resp.raise_for_status()
        return int(resp.json()["data"][0]["max_model_len"])
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as exc:
        raise KvopsError(f"cannot read max_model_len from {url}/v1/models: {exc}") from exc


def load_replay(config: TraceReplayConfig, trace: Path | None, max_model_len: int) -> Replay:
    if trace is None:
        raise BadInputError("trace-replay needs --trace FILE (a Mooncake JSONL or BurstGPT CSV)")
    return plan_replay(read_trace(trace), ReplayOptions(
        speedup=config.speedup, length_scale=config.length_scale, max_model_len=max_model_len,
        max_output_tokens=config.max_output_tokens, start=config.start, limit=config.requests,
        sample_conversations=config.sample_conversations,
        duration_s=config.duration_s, seed=config.seed, drift_at=config.drift_at,
        drift_tokens=config.drift_tokens))


def analyse(config: TraceReplayConfig, replay: Replay, records: list[RequestRecord],
            samples: list[MetricsSample], tokenizer: ServerTokenizer
            ) -> tuple[dict[str, Any], list[Verdict]]:
    """``tokenizer`` only turns the tokens of a drift found back into text."""
    if len(samples) < 2:
        raise KvopsError("trace-replay: fewer than two /metrics samples, nothing to compare")
    first, last = samples[0], samples[-1]
    queries = delta(first, last, "prefix_queries")
    local, external = delta(first, last, "prefix_hits"), delta(first, last, "external_prefix_hits")
    offload_on = delta(first, last, "external_prefix_queries") > 0
    # a request reached the scheduler if it produced a token or finished
    served = [r for r in records if r.group is not None and (r.ok or r.first_event_s is not None)]
    timing = {int(r.group): Timing(r.sent_at, r.first_token_at) for r in served if r.group}
    tier_tokens, tier_source = offload_tier_tokens(config, last)
    cache = ServerCache(
        gpu_blocks=cache_int(last, "num_gpu_blocks") or 0, block_size=cache_int(last, "block_size") or 1,
        offload_tokens=(tier_tokens or float("inf")) if offload_on else None)
    prediction = predict(replay, cache, timing)
    measured = (local + external) / queries if queries else 0.0
    summary: dict[str, Any] = {
        "requests_planned": len(replay.requests), "requests_served": len(timing),
        "speedup": config.speedup, "length_scale": config.length_scale,
        "replay_block_tokens": replay.block_tokens, "block_size": cache.block_size,
        "num_gpu_blocks": cache.gpu_blocks, "offload": offload_on,
        "offload_tokens": round(tier_tokens) if offload_on and tier_tokens else (
            "unbounded (set offload_tokens in the scenario file)" if offload_on else None),
        "offload_tokens_from": tier_source if offload_on else None,
        "prompt_tokens_predicted": prediction.prompt_tokens, "prefix_cache_queries": queries,
        "measured_hit_ratio": round(measured, 4), "measured_local_hits": local,
        "measured_external_hits": external,
        "predicted_hit_ratio": round(prediction.hit_ratio, 4),
        "predicted_gpu_only_hit_ratio": round(prediction.gpu_hit_ratio, 4),
        "unbounded_hit_ratio": round(prediction.unbounded_hit_ratio, 4),
        "tolerance": config.tolerance,
        # a preempted request prefills again and its recomputed blocks count as hits once more
        # (vllm/v1/core/sched/scheduler.py: preemption frees its blocks, the retry looks them up)
        "preemptions": delta(first, last, "preemptions"),
    }
    if replay.drift_at is not None:
        summary.update(drift_at=replay.drift_at, drift_tokens=replay.drift_tokens)
    inferred = _sent_prompts(summary, replay, served, cache)
    shortfall = prediction.hit_ratio - measured
    return summary, [_verdict(summary, last, shortfall, config.tolerance, inferred, tokenizer)]


def offload_tier_tokens(config: TraceReplayConfig, last: MetricsSample) -> tuple[float | None, str]:
    """Tokens the offload tier holds, and where that came from: the scenario's ``offload_tokens``;
    else the kvops plugin's ``kvops_offload_capacity_bytes`` over the bytes per token it stored
    (its stored-bytes and stored-tokens counters); else None (a connector kvops does not run:
    the prediction takes the tier as unbounded, and the report says so)."""
    if config.offload_tokens is not None:
        return config.offload_tokens, "scenario"
    capacity = last.get("kvops_offload_capacity_bytes")
    stored_bytes, stored_tokens = (last.get("kvops_offload_stored_bytes_total"),
                                   last.get("kvops_offload_stored_tokens_total"))
    if capacity > 0 and stored_bytes > 0 and stored_tokens > 0:
        return capacity / (stored_bytes / stored_tokens), "server"
    return None, "unbounded"


DRIFT_TOKENS = 1_000_000
"""Prompt tokens read for drift: grouping costs seconds per million here. A longer replay is
read one conversation in N (the trace's own ids, as sample_conversations keeps them), which
keeps each request's reuse; the structure itself is inferred from the tokens alone."""


def _sent_prompts(s: dict[str, Any], replay: Replay, served: list[RequestRecord],
                  cache: ServerCache) -> prefix.Inferred:
    """The prompts read (served ones, sampled to DRIFT_TOKENS): their ideal and could-be hit
    rates, and the prediction for those same requests, into ``s``; their inferred structure."""
    by_index = {r.index: r for r in replay.requests}
    planned = [(r, by_index[int(r.group or 0)]) for r in sorted(served, key=lambda r: r.sent_at)]
    every = math.ceil(sum(p.prompt_tokens for _, p in planned) / DRIFT_TOKENS) or 1
    items = [prefix.PrefixTokens(record, replay.prompt(p), 0) for record, p in planned
             if conversation_of(p) % every == 0]
    ideal = prefix.ideal_hits(items, cache.block_size)
    inferred = prefix.infer_shared(items, ideal, cache.block_size)
    timing = {int(i.record.group or 0): Timing(i.record.sent_at, i.record.first_token_at) for i in items}
    total = sum(len(i.tokens) for i in items) or 1
    s.update(requests_read_for_drift=len(items), conversations_read_for_drift=f"1 in {every}",
             read_predicted_hit_ratio=round(predict(replay, cache, timing).hit_ratio, 4),
             ideal_hit_rate=round(sum(ideal) / total, 4),
             could_be_hit_rate=round(sum(inferred.could_be) / total, 4))
    return inferred


def _verdict(s: dict[str, Any], last: MetricsSample, shortfall: float, tolerance: float,
             inferred: prefix.Inferred, tokenizer: ServerTokenizer) -> Verdict:
    if shortfall <= tolerance and s["preemptions"] > 0:
        # at or above the prediction only thanks to hits that preemption counted twice
        return Verdict("inconclusive", "preempted", {**s, "comparison_reliable": False},
                       f"the server preempted {s['preemptions']:.0f} requests during the replay: their "
                       "recomputed blocks count as prefix hits again, so the measured ratio is "
                       "inflated; rerun with fewer users (users: in the scenario file) or a lower "
                       "--speedup (`kvops runbook prefix-miss`)")
    if shortfall <= tolerance:
        return healthy(**s)
    if prefix_caching_enabled(last) is False:
        return Verdict("prefix-miss", "prefix-caching-disabled", s,
                       "restart vllm serve without --no-enable-prefix-caching (`kvops runbook prefix-miss`)")
    # the prompts themselves fall short: not even an infinite cache reaches the prediction
    if s["ideal_hit_rate"] < s["read_predicted_hit_ratio"] - tolerance:
        found = prefix.inferred_drift(s, inferred, tokenizer)
        if found is not None:
            return found
    if s["offload"]:
        return Verdict("prefix-miss", "offload-miss", s,
                       "the offload tier misses blocks the trace reuses: check the LMCache server's "
                       "size and eviction, and offload_tokens (`kvops runbook offload`)")
    return Verdict("prefix-miss", "eviction", s,
                   "the server's cache loses blocks the trace reuses sooner than an LRU cache of its "
                   "size would: give the KV cache more memory or offload it (`kvops runbook prefix-miss`)")


def planned_seconds(config: TraceReplayConfig, trace: Path | None) -> float:
    """How long the replay should take (its last arrival, plus the drain), checking the trace
    before any process starts; max_model_len does not move arrivals, so any will do here."""
    return load_replay(config, trace, max_model_len=1 << 30).duration_s + config.drain_s
