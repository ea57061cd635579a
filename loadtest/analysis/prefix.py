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

A fourth, could-be, needs no declared intent (an operator's --dataset has none): the shared
structure is inferred from the prompts (kvops.loadtest.analysis.drift), and could-be is what
they would hit with the per-request part moved after the shared text. could-be ≫ ideal is
drift in prompts we did not write.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvops.core.prom import MetricsSample, cache_int, delta, hist_mean, prefix_caching_enabled
from kvops.core.verdict import Verdict, healthy
from kvops.loadtest.analysis import drift
from kvops.loadtest.analysis.drift import block_chain
from kvops.loadtest.analysis.tokens import ServerTokenizer, common_prefix_len
from kvops.loadtest.records import RequestRecord

DEFAULT_BLOCK = 128
MIN_GAIN = 0.05
"""Could-be minus ideal hit rate (token-weighted) that makes inferred drift worth a verdict."""


@dataclass
class PrefixTokens:
    record: RequestRecord
    tokens: list[int]
    intended: int  # tokens meant to be shared (LCP of the prompt with its shared part)


def ideal_hits(items: list[PrefixTokens], block: int) -> list[int]:
    """Cacheable tokens per request with an infinite cache, respecting what had been prefilled:
    another request's blocks count once its first token came at or before this one was sent.
    Requests are walked in send order, prefills added as their time passes (a trace replay has
    thousands)."""
    chains = [block_chain(i.tokens, block) for i in items]
    prefilled = sorted((first, n) for n, i in enumerate(items)
                       if (first := i.record.first_token_at) is not None)
    seen: Counter[int] = Counter()
    added: set[int] = set()
    hits, j = [0] * len(items), 0
    for n in sorted(range(len(items)), key=lambda n: items[n].record.sent_at):
        item = items[n]
        while j < len(prefilled) and prefilled[j][0] <= item.record.sent_at:
            seen.update(chains[prefilled[j][1]])
            added.add(prefilled[j][1])
            j += 1
        mine = n in added  # its own prefill never counts for it
        if mine:
            seen.subtract(chains[n])
        # the last prompt token is always computed, so at most (len-1) tokens can hit
        usable = (len(item.tokens) - 1) // block
        k = 0
        while k < usable and seen[chains[n][k]] > 0:
            k += 1
        if mine:
            seen.update(chains[n])
        hits[n] = k * block
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
            min_ratio: float, duration_s: float | None = None) -> tuple[dict[str, Any], list[Verdict]]:
    """``duration_s``: the run's --duration, which a run that finished no request outgrows."""
    ok = [r for r in records if r.ok]
    last = samples[-1] if samples else None
    block = (cache_int(last, "block_size") if last else None) or DEFAULT_BLOCK
    items = [_tokens_of(r, tokenizer) for r in ok]
    prompt_total = sum(len(i.tokens) for i in items) or 1
    ideal, intended = ideal_hits(items, block), intended_hits(items, block)
    queries = delta(samples[0], samples[-1], "prefix_queries") if len(samples) >= 2 else 0.0
    hits = delta(samples[0], samples[-1], "prefix_hits") if len(samples) >= 2 else 0.0
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    inferred = infer_shared(items, ideal, block)
    summary: dict[str, Any] = {
        "requests": len(ok), "block_size": block, "prompt_tokens": prompt_total,
        "intended_hit_rate": round(sum(intended) / prompt_total, 4),
        "ideal_hit_rate": round(sum(ideal) / prompt_total, 4),
        "could_be_hit_rate": round(sum(inferred.could_be) / prompt_total, 4),
        "measured_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "per_request_cached_tokens": sum(cached) if cached else None,
        "enable_prefix_caching": last.cache_config.get("enable_prefix_caching") if last else None,
    }
    if not ok:
        return summary, [no_samples(summary, records, duration_s)]
    return summary, [_verdict(summary, items, samples, tokenizer, min_ratio, inferred)]


def no_samples(summary: dict[str, Any], records: list[RequestRecord], duration_s: float | None) -> Verdict:
    """No request finished: there is no hit rate to judge, which is not healthy. The next step
    comes from the run's own records: the statuses the server refused them with (the same
    requests would be refused again), or, where they were all still running when the run ended
    (a real model on a slow CPU), a run long enough for each to finish twice."""
    failed = Counter(r.status for r in records if not r.ok and not r.stopped)
    cut = [r.e2e_s or 0.0 for r in records if r.stopped]
    evidence = {**summary, "sent": len(records), "stopped_in_flight": len(cut),
                "failed": dict(sorted(failed.items()))}
    if failed:
        first = next(r.error for r in records if not r.ok and not r.stopped)
        statuses = ", ".join(f"HTTP {k} x{n}" for k, n in sorted(failed.items()))
        why = (f"every request failed ({statuses}; first: {(first or '')[:200]}): change what the "
               "server refuses before running it again (a prompt over --max-model-len: fewer "
               "prefix_words or question_words, or a larger --max-model-len)")
    elif cut:
        longer = math.ceil(2 * max(duration_s or 0.0, max(cut)) + 1)
        why = (f"none of the {len(cut)} requests sent finished before the run ended (the longest "
               f"had run {max(cut):.1f} s): rerun with --duration {longer}")
    else:
        why = "no request was sent: check that the server answers (`kvops diagnose --url URL`)"
    return Verdict("inconclusive", "no-samples", evidence, f"{why} (`kvops runbook prefix-miss`)")


@dataclass(frozen=True)
class Inferred:
    """The structure the prompts themselves share (drift.py), over the run's requests."""

    unique: list[list[int]]
    structures: list[drift.Structure]
    rates: drift.Rates
    """Over the distinct prompts, each sent once: repeats of one prompt hide drift."""
    could_be: list[int]
    """Per request: its ideal hits, or its group's shared tokens in whole blocks once another
    request of the group had its first token before it was sent."""


def infer_shared(items: list[PrefixTokens], ideal: list[int], block: int) -> Inferred:
    """The prompts' own shared structure, and each request's could-be hits."""
    unique, where = drift.distinct([i.tokens for i in items])
    structures = drift.infer(unique)
    group_of = {m: g for g, s in enumerate(structures) for m in s.members}
    # per group, its two earliest first tokens: enough to tell whether another member had one
    earliest: dict[int, list[tuple[float, int]]] = {}
    for n, item in enumerate(items):
        first, g = item.record.first_token_at, group_of.get(where[n])
        if first is not None and g is not None:
            earliest[g] = sorted([*earliest.get(g, []), (first, n)])[:2]
    could_be = list(ideal)
    for n, item in enumerate(items):
        g = group_of.get(where[n])
        if g is None or not any(k != n and first <= item.record.sent_at
                                for first, k in earliest.get(g, [])):
            continue
        usable = min(structures[g].shared_tokens, max(len(item.tokens) - 1, 0))
        could_be[n] = max(could_be[n], usable // block * block)
    return Inferred(unique, structures, drift.rates(unique, structures, block), could_be)


def _verdict(s: dict[str, Any], items: list[PrefixTokens], samples: list[MetricsSample],
             tokenizer: ServerTokenizer, min_ratio: float, inferred: Inferred) -> Verdict:
    intended, ideal, measured = s["intended_hit_rate"], s["ideal_hit_rate"], s["measured_hit_rate"]
    expected = max(intended, ideal)
    cache_fails = expected >= 0.02 and measured < min_ratio * expected
    if cache_fails and samples and prefix_caching_enabled(samples[-1]) is False:
        return Verdict("prefix-miss", "prefix-caching-disabled", s,
                       "restart vllm serve without --no-enable-prefix-caching (`kvops runbook prefix-miss`)")
    found = inferred_drift(s, inferred, tokenizer)
    declared = any(i.record.group is not None for i in items)
    if found is not None and (not declared or not ideal < min_ratio * intended):
        return found
    if not cache_fails:
        return healthy(**s)
    point = drift_point(items) if ideal < min_ratio * intended else None
    if point is not None:
        index, group = point
        member = next(i for i in items if str(i.record.group) == group)
        return Verdict("prefix-miss", "prefix-drift", {
            **s, "first_differing_token": index, "group": group,
            "text_before": tokenizer.text(member.tokens[max(0, index - 12):index]),
            "text_from": tokenizer.text(member.tokens[index:index + 6]),
        }, f"prompts of group {group} differ from token {index} on, inside the part meant to be "
           "shared: move per-request fields (timestamps, ids) after the shared prefix or make the "
           "template deterministic (`kvops runbook prefix-miss`)")
    ext_q = delta(samples[0], samples[-1], "external_prefix_queries") if len(samples) >= 2 else 0.0
    if ext_q > 0:
        ext_h = delta(samples[0], samples[-1], "external_prefix_hits")
        return Verdict("prefix-miss", "offload-miss", {**s, "external_queries": ext_q,
                                                       "external_hits": ext_h},
                       "the offload tier misses blocks the workload shares: check the LMCache "
                       "server's size and eviction (`kvops runbook offload`)")
    usage = max((x.get("kv_usage") for x in samples), default=0.0)
    preempt = delta(samples[0], samples[-1], "preemptions") if len(samples) >= 2 else 0.0
    return Verdict("prefix-miss", "eviction", {**s, "kv_usage_max": round(usage, 4),
                                               "preemptions": preempt, **evictions(samples)},
                   "shared blocks are evicted before reuse: give the KV cache more memory or "
                   "offload it (`kvops runbook prefix-miss`)")


def evictions(samples: list[MetricsSample]) -> dict[str, float | None]:
    """vLLM's own account of the evictions during the run, where the server runs with
    --kv-cache-metrics (vllm:kv_block_idle_before_evict_seconds): the cached blocks it evicted,
    of the share it samples (--kv-cache-metrics-sample, 1% by default, so a count, not a total),
    and how long they had been idle on average. None without the flag."""
    if len(samples) < 2 or "evict_idle_count" not in samples[-1].values:
        return {"evicted_blocks_sampled": None, "idle_before_evict_s_mean": None}
    mean = hist_mean(samples[0], samples[-1], "evict_idle")
    return {"evicted_blocks_sampled": delta(samples[0], samples[-1], "evict_idle_count"),
            "idle_before_evict_s_mean": round(mean, 3) if mean is not None else None}


def inferred_drift(s: dict[str, Any], inferred: Inferred, tokenizer: ServerTokenizer
                   ) -> Verdict | None:
    """prefix-drift read from the prompts' own structure, when moving their varying part would
    gain at least MIN_GAIN of the tokens."""
    drifting = [x for x in inferred.structures if x.drifts]
    if not drifting or inferred.rates.could_be - inferred.rates.ideal < MIN_GAIN:
        return None
    top = max(drifting, key=lambda x: (len(x.members), x.shared_after))
    rep = inferred.unique[top.representative]
    index, (start, end) = top.first_differing_token, top.varying
    other = inferred.unique[top.members[1]]
    evidence = {
        **s, "first_differing_token": index, "inferred_from": "prompts",
        "prompts_in_group": len(top.members), "distinct_prompts": len(inferred.unique),
        "shared_tokens": top.shared_tokens, "shared_after_drift_tokens": top.shared_after,
        "distinct_ideal_hit_rate": inferred.rates.ideal,
        "distinct_could_be_hit_rate": inferred.rates.could_be,
        "reordered": top.reordered,
        "text_before": tokenizer.text(rep[max(0, index - 12):index]),
        "varying_text": tokenizer.text(rep[start:min(end, start + 32)]) if end > start else "",
        "text_from": [tokenizer.text(rep[index:index + 12]), tokenizer.text(other[index:index + 12])],
    }
    what = ("shared text appears in a different order per request (a shuffled list?): sort it"
            if top.reordered else
            "a per-request part sits inside shared text: move it (timestamps, ids) after the "
            "shared part")
    return Verdict("prefix-miss", "prefix-drift", evidence,
                   f"{len(top.members)} near-identical prompts differ from token {index} on, "
                   f"with {top.shared_after} shared tokens after it: {what}; the hit rate could "
                   f"be {s['could_be_hit_rate']} instead of {s['ideal_hit_rate']} "
                   "(`kvops runbook prefix-miss`)")


def _tokens_of(record: RequestRecord, tokenizer: ServerTokenizer) -> PrefixTokens:
    """A record's prompt tokens and how many of them were meant to be shared: the shared text
    our templates wrote, or in a chat body every message before the last (a conversation's
    history). A completions prompt of token ids has no intended part."""
    chat = record.kind == "chat"
    template = record.template if chat else None
    tokens = tokenizer.tokens(record.prompt, template=template)
    intended = 0
    if record.shared_text is not None:
        if chat:
            shared = tokenizer.tokens(record.prompt[:1], add_generation_prompt=False, template=template)
        else:
            shared = tokenizer.tokens(record.shared_text)
        intended = common_prefix_len(shared, tokens)
    elif chat and len(record.prompt) > 1:
        shared = tokenizer.tokens(record.prompt[:-1], add_generation_prompt=False, template=template)
        intended = common_prefix_len(shared, tokens)
    return PrefixTokens(record, tokens, intended)


def mode(values: list[int]) -> int | None:
    return Counter(values).most_common(1)[0][0] if values else None
