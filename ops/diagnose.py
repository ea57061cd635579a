"""Verdicts: a named problem, its cause, the numbers behind it, and what to run next.

``diagnose_live`` reads a live server's /metrics twice, a few seconds apart (counters are
cumulative since start, so only differences mean anything); a load-test result file adds the
verdicts its scenario reached. No vLLM import: this runs on an SRE's laptop.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from kvops.core import kinds
from kvops.core.errors import BadInputError, KvopsError
from kvops.core.kinds import read_json_of_kind
from kvops.core.promql import IDENTITY_READS, answers_from_many
from kvops.core.verdict import KV_USAGE_BOUND, Verdict, healthy


def diagnose_live(url: str, window_s: float = 5.0) -> list[Verdict]:
    """Verdicts from two /metrics samples ``window_s`` apart (refused behind a load balancer)."""
    from kvops.core.prom import scrape

    refuse_load_balancer(url)
    first = vllm_sample(scrape(url), url)
    time.sleep(window_s)
    last = vllm_sample(scrape(url), url)
    return diagnose_samples(first, last)


def vllm_sample(sample: Any, url: str) -> Any:
    """A sample with vLLM's scheduler gauges, all finite: a page without them (another program, an
    empty answer) or with NaN/inf in them would give verdicts built on nothing."""
    missing = [key for key in ("running", "waiting", "kv_usage") if key not in sample.values]
    if missing:
        raise KvopsError(f"{url}/metrics has no vLLM scheduler gauges ({', '.join(missing)} missing): "
                         "is --url a vLLM server's own base URL?")
    bad = sorted(k for k, v in sample.values.items()  # vLLM's own: counts, seconds, fractions
                 if not k.startswith(("kvops_", "lmcache:")) and not (math.isfinite(v) and v >= 0))
    if bad:
        raise KvopsError(f"{url}/metrics has values that are not finite numbers >= 0 ({', '.join(bad[:3])}): "
                         "a broken exporter; not diagnosing from it")
    return sample


def refuse_load_balancer(url: str, reads: int = IDENTITY_READS) -> None:
    """Two scrapes through a load balancer come from different replicas and their differences
    mean nothing (kvops.core.promql.answers_from_many tells one process from several)."""
    if answers_from_many(url, reads=reads):
        raise BadInputError(
            f"--url {url} answers from more than one server process in {reads} reads (a load "
            "balancer): pass --prometheus URL for the fleet, or one replica's own URL")


def diagnose_samples(first: Any, last: Any) -> list[Verdict]:
    """The live rules, on two MetricsSamples (kvops.core.prom)."""
    from kvops.core.prom import delta, hist_mean, prefix_caching_enabled

    verdicts: list[Verdict] = []
    # a request passing through the queue between two steps is not a queue: only waiting seen
    # in both samples counts
    waiting = min(first.get("waiting"), last.get("waiting"))
    usage = max(first.get("kv_usage"), last.get("kv_usage"))
    preempted = delta(first, last, "preemptions")
    running = last.get("running")
    base = {"window_s": round(last.t - first.t, 2), "waiting": waiting, "running": running,
            "kv_usage": round(usage, 4), "preemptions_in_window": preempted}
    if preempted > 0 or (waiting >= 1 and usage >= KV_USAGE_BOUND):
        verdicts.append(Verdict(
            "kv-exhaustion", "kv-capacity", base,
            "the KV cache is full: run `kvops loadtest kv-exhaustion --url URL` to find the knee; "
            "raise --gpu-memory-utilization / --kv-cache-memory-bytes, use --kv-cache-dtype fp8, "
            "or lower --max-num-seqs (`kvops runbook kv-exhaustion`)"))
    elif waiting >= 1:
        verdicts.append(Verdict(
            "kv-exhaustion", "compute-bound", base,
            "requests wait while KV is free: the token budget or compute limits admission; "
            "check --max-num-batched-tokens and --max-num-seqs, or add replicas "
            "(`kvops runbook kv-exhaustion`)"))
    if prefix_caching_enabled(last) is False:
        verdicts.append(Verdict(
            "prefix-miss", "prefix-caching-disabled",
            {"enable_prefix_caching": last.cache_config.get("enable_prefix_caching")},
            "restart vllm serve without --no-enable-prefix-caching "
            "(`kvops runbook prefix-miss`)"))
    ext_q = delta(first, last, "external_prefix_queries")
    if ext_q > 0 and delta(first, last, "external_prefix_hits") == 0:
        verdicts.append(Verdict(
            "prefix-miss", "offload-miss", {"external_prefix_queries": ext_q,
                                            "external_prefix_hits": 0},
            "the offload tier answers no lookups: check the LMCache server (`kvops runbook offload`)"))
    verdicts.extend(_offload_verdicts(last))
    queue = hist_mean(first, last, "queue")
    ttft = hist_mean(first, last, "ttft")
    if queue is not None and ttft and queue > 0.5 * ttft and waiting >= 1:
        verdicts.append(Verdict(
            "ttft-regression", "queueing",
            {"queue_mean_s": round(queue, 4), "ttft_mean_s": round(ttft, 4), "waiting": waiting},
            "most of TTFT is queueing: arrival rate exceeds the drain rate; compare with a baseline "
            "via `kvops loadtest ttft-regression --baseline FILE` (`kvops runbook ttft-regression`)"))
    elif waiting >= 1 and (queue is None or not ttft):
        # vLLM observes a request's queue time when it finishes and its TTFT at its first token:
        # a window in which none did cannot say whether queueing is most of TTFT, and the
        # kv-exhaustion verdict that waiting requests always give (first in the list) says so
        window_s = last.t - first.t
        verdicts[0].evidence["finished_in_window"] = delta(first, last, "queue_count")
        verdicts[0].evidence["ttft_split"] = (
            f"no request finished in the {window_s:.0f} s window: rerun with "
            f"--window {max(60, math.ceil(4 * window_s))} to see whether queueing is most of TTFT")
    return verdicts or [healthy(**base)]


def _offload_verdicts(last: Any) -> list[Verdict]:
    """From the plugin's offload gauges; absent gauges mean offload is not configured."""
    up = last.values.get("kvops_offload_server_up")
    degraded = last.values.get("kvops_offload_degraded")
    evidence = {"kvops_offload_server_up": up, "kvops_offload_degraded": degraded}
    if up is not None and up < 1:
        return [Verdict(
            "offload", "unreachable", evidence,
            "the LMCache server does not answer: `kvops offload status --url LMCACHE_URL`, restart it "
            "with `kvops offload serve --config kvops.yaml` (`kvops runbook offload`)")]
    if degraded is not None and degraded > 0:
        return [Verdict(
            "offload", "degraded", evidence,
            "the connector runs degraded (recomputing instead of loading): check the vLLM log for "
            "kvops offload errors and `kvops offload status` (`kvops runbook offload`)")]
    disk = last.values.get("kvops_offload_disk_degraded")
    if disk is not None and disk > 0:
        return [Verdict(
            "offload", "degraded", {**evidence, "kvops_offload_disk_degraded": disk},
            "the disk tier refuses writes (full or read-only; the vLLM log's `kvops offload DISK "
            "DEGRADED` line says which): free space or remount it read-write (`kvops runbook offload`)")]
    # the canary stored a prefix and could not load it back: every other gauge can read healthy
    # while offloaded prefixes are never restored (plugin/offload/canary.py)
    load_path = last.values.get("kvops_offload_load_path_ok")
    if load_path is not None and load_path < 1:
        return [Verdict(
            "offload", "load-path", {**evidence, "kvops_offload_load_path_ok": load_path},
            "the connector stores KV but its load-path canary could not load it back: run "
            "`kvops offload check --url URL` for the reason (L1 smaller than a chunk, a tier that "
            "returns nothing, wrong KV) (`kvops runbook offload`)")]
    return []


class _ResultVerdict(BaseModel):
    """One verdict as ``Verdict.to_dict`` wrote it into result.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    problem: StrictStr
    cause: StrictStr
    evidence: dict[str, Any] = {}
    next: StrictStr = ""


class _ResultVerdicts(BaseModel):
    """The part of a `kvops loadtest` result.json diagnose reads (the rest is the report's)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    verdicts: list[_ResultVerdict]


def verdicts_from_result(path: Path) -> list[Verdict]:
    """The verdicts a `kvops loadtest` result JSON reached; a field of the wrong type exits 2 naming it."""
    label = f"--result {path}"
    data = read_json_of_kind(Path(path), label, kinds.LOADTEST_RESULT)
    if not isinstance(data, dict) or not isinstance(data.get("verdicts"), list):
        raise BadInputError(f"{label}: no 'verdicts' list: pass the result.json of a kvops loadtest run")
    try:
        result = _ResultVerdicts.model_validate(data)
        return [Verdict(v.problem, v.cause, v.evidence, v.next) for v in result.verdicts]
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        raise BadInputError(f"{label}: {where}: {err['msg']}; pass the result.json of a kvops loadtest run") from None
    except ValueError as exc:  # Verdict: a problem/cause pair this kvops does not know
        raise BadInputError(f"{label}: {exc}; pass the result.json of a kvops loadtest run") from None


def merge(live: list[Verdict], from_result: list[Verdict]) -> list[Verdict]:
    """Problems found anywhere win over 'healthy'."""
    found = [v for v in live + from_result if v.problem != "healthy"]
    return found or (live or from_result)[:1]
