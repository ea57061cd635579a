"""prefix-miss: expected vs measured prefix-cache hit rate, and why they differ.

Three rates, all token-weighted over the run:

* intended — what the workload means to share: after a group's first request finished its
  prefill, every later request of the group should hit the whole blocks of its system prompt;
* ideal — what the actual token sequences allow: the longest block-aligned prefix each request
  shares with any request whose first token arrived before it was sent (an infinite cache);
* measured — Δ``vllm:prefix_cache_hits`` / Δ``vllm:prefix_cache_queries`` over the run.

intended ≫ ideal means the prompts themselves drift (a timestamp, a template or tokenizer
difference) and we locate the first differing token; ideal ≫ measured means the cache lost
blocks (disabled, evicted, or the offload tier missed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvops.loadtest.analysis.tokens import ServerTokenizer, common_prefix_len
from kvops.loadtest.metrics import MetricsSample, cache_int, delta, prefix_caching_enabled
from kvops.loadtest.records import RequestRecord
from kvops.ops.diagnose import Verdict, healthy

DEFAULT_BLOCK = 128


@dataclass
class PrefixTokens:
    record: RequestRecord
    tokens: list[int]
    intended: int  # tokens meant to be shared (LCP of the prompt with its shared part)


def block_chain(tokens: list[int], block: int) -> list[int]:
    """Hash of each whole-block prefix, as vLLM's prefix cache chains block hashes."""
    out, h = [], 0
    for k in range(len(tokens) // block):
        h = hash((h, tuple(tokens[k * block:(k + 1) * block])))
        out.append(h)
    return out


def ideal_hits(items: list[PrefixTokens], block: int) -> list[int]:
    """Cacheable tokens per request with an infinite cache, respecting what had been prefilled."""
    hits = []
    for item in items:
        seen: set[int] = set()
        for other in items:
            first = other.record.first_token_at
            if other is not item and first is not None and first <= item.record.sent_at:
                seen.update(block_chain(other.tokens, block))
        # the last prompt token is always computed, so at most (len-1) tokens can hit
        chain = block_chain(item.tokens[: max(len(item.tokens) - 1, 0)], block)
        k = 0
        while k < len(chain) and chain[k] in seen:
            k += 1
        hits.append(k * block)
    return hits


def intended_hits(items: list[PrefixTokens], block: int) -> list[int]:
    hits = []
    for item in items:
        primed = any(o is not item and o.record.group == item.record.group
                     and o.record.first_token_at is not None
                     and o.record.first_token_at <= item.record.sent_at for o in items)
        usable = min(item.intended, max(len(item.tokens) - 1, 0))
        hits.append(usable // block * block if primed else 0)
    return hits


def drift_point(items: list[PrefixTokens]) -> tuple[int, str] | None:
    """The smallest per-group common prefix that ends before the intended shared part does."""
    by_group: dict[str | None, list[PrefixTokens]] = {}
    for item in items:
        by_group.setdefault(item.record.group, []).append(item)
    points: list[tuple[int, str]] = []
    for group, members in by_group.items():
        if len(members) < 2:
            continue
        lcp = len(members[0].tokens)
        for other in members[1:]:
            lcp = min(lcp, common_prefix_len(members[0].tokens, other.tokens))
        intended = min(m.intended for m in members)
        if lcp < intended:
            points.append((lcp, str(group)))
    return min(points) if points else None


def analyse(records: list[RequestRecord], samples: list[MetricsSample], tokenizer: ServerTokenizer,
            min_ratio: float) -> tuple[dict[str, Any], list[Verdict]]:
    ok = [r for r in records if r.ok]
    last = samples[-1] if samples else None
    block = (cache_int(last, "block_size") if last else None) or DEFAULT_BLOCK
    items = [_tokens_of(r, tokenizer) for r in ok]
    prompt_total = sum(len(i.tokens) for i in items) or 1
    ideal, intended = ideal_hits(items, block), intended_hits(items, block)
    queries = delta(samples[0], samples[-1], "prefix_queries") if len(samples) >= 2 else 0.0
    hits = delta(samples[0], samples[-1], "prefix_hits") if len(samples) >= 2 else 0.0
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    summary: dict[str, Any] = {
        "requests": len(ok), "block_size": block, "prompt_tokens": prompt_total,
        "intended_hit_rate": round(sum(intended) / prompt_total, 4),
        "ideal_hit_rate": round(sum(ideal) / prompt_total, 4),
        "measured_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "per_request_cached_tokens": sum(cached) if cached else None,
        "enable_prefix_caching": last.cache_config.get("enable_prefix_caching") if last else None,
    }
    return summary, [_verdict(summary, items, samples, tokenizer, min_ratio)]


def _verdict(s: dict[str, Any], items: list[PrefixTokens], samples: list[MetricsSample],
             tokenizer: ServerTokenizer, min_ratio: float) -> Verdict:
    intended, ideal, measured = s["intended_hit_rate"], s["ideal_hit_rate"], s["measured_hit_rate"]
    expected = max(intended, ideal)
    if expected < 0.02 or measured >= min_ratio * expected:
        return healthy(**s)
    if samples and prefix_caching_enabled(samples[-1]) is False:
        return Verdict("prefix-miss", "prefix-caching-disabled", s,
                       "restart vllm serve without --no-enable-prefix-caching (runbooks/prefix-miss.md)")
    drift = drift_point(items) if ideal < min_ratio * intended else None
    if drift is not None:
        index, group = drift
        member = next(i for i in items if i.record.group == group)
        return Verdict("prefix-miss", "prefix-drift", {
            **s, "first_differing_token": index, "group": group,
            "text_before": tokenizer.text(member.tokens[max(0, index - 12):index]),
            "text_from": tokenizer.text(member.tokens[index:index + 6]),
        }, f"prompts of group {group} differ from token {index} on, inside the part meant to be "
           "shared: move per-request fields (timestamps, ids) after the shared prefix or make the "
           "template deterministic (runbooks/prefix-miss.md)")
    ext_q = delta(samples[0], samples[-1], "external_prefix_queries") if len(samples) >= 2 else 0.0
    if ext_q > 0:
        ext_h = delta(samples[0], samples[-1], "external_prefix_hits")
        return Verdict("prefix-miss", "offload-miss", {**s, "external_queries": ext_q,
                                                       "external_hits": ext_h},
                       "the offload tier misses blocks the workload shares: check the LMCache "
                       "server's size and eviction (runbooks/offload.md)")
    usage = max((x.get("kv_usage") for x in samples), default=0.0)
    preempt = delta(samples[0], samples[-1], "preemptions") if len(samples) >= 2 else 0.0
    return Verdict("prefix-miss", "eviction", {**s, "kv_usage_max": round(usage, 4),
                                               "preemptions": preempt},
                   "shared blocks are evicted before reuse: give the KV cache more memory or "
                   "offload it (runbooks/prefix-miss.md)")


def _tokens_of(record: RequestRecord, tokenizer: ServerTokenizer) -> PrefixTokens:
    tokens = tokenizer.tokens(record.prompt)
    intended = 0
    if record.shared_text is not None:
        if isinstance(record.prompt, list):
            shared = tokenizer.tokens(record.prompt[:1], add_generation_prompt=False)
        else:
            shared = tokenizer.tokens(record.shared_text)
        intended = common_prefix_len(shared, tokens)
    elif isinstance(record.prompt, list) and len(record.prompt) > 1:
        shared = tokenizer.tokens(record.prompt[:-1], add_generation_prompt=False)
        intended = common_prefix_len(shared, tokens)
    return PrefixTokens(record, tokens, intended)


def mode(values: list[int]) -> int | None:
    return Counter(values).most_common(1)[0][0] if values else None
