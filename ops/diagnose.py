"""Verdicts: a named problem, its cause, the numbers behind it, and what to run next.

``diagnose_live`` reads a live server's /metrics twice, a few seconds apart (counters are
cumulative since start, so only differences mean anything); a load-test result file adds the
verdicts its scenario reached. No vLLM import: this runs on an SRE's laptop.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvops.ops.errors import BadInputError

PROBLEMS: dict[str, tuple[str, ...]] = {
    "kv-exhaustion": ("kv-capacity", "max-num-seqs", "compute-bound", "failing"),
    "prefix-miss": ("prefix-caching-disabled", "prefix-drift", "eviction", "offload-miss"),
    "ttft-regression": ("queueing", "prefill", "decode"),
    "offload": ("degraded", "unreachable"),
    "healthy": ("none",),
}
RUNBOOKS = "runbooks/"
KV_USAGE_BOUND = 0.9


@dataclass(frozen=True)
class Verdict:
    problem: str
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next: str = ""

    def __post_init__(self) -> None:
        if self.cause not in PROBLEMS.get(self.problem, ()):
            raise ValueError(f"bad verdict {self.problem}/{self.cause}")

    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem, "cause": self.cause, "evidence": self.evidence,
                "next": self.next}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(str(data["problem"]), str(data["cause"]), dict(data.get("evidence") or {}),
                   str(data.get("next", "")))


def healthy(**evidence: Any) -> Verdict:
    return Verdict("healthy", "none", evidence, "nothing to do")


def diagnose_live(url: str, window_s: float = 5.0) -> list[Verdict]:
    """Verdicts from two /metrics samples ``window_s`` apart."""
    from kvops.loadtest.metrics import scrape

    first = scrape(url)
    time.sleep(window_s)
    last = scrape(url)
    return diagnose_samples(first, last)


def diagnose_samples(first: Any, last: Any) -> list[Verdict]:
    """The live rules, on two MetricsSamples (kvops.loadtest.metrics)."""
    from kvops.loadtest.metrics import delta, hist_mean, prefix_caching_enabled

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
            f"or lower --max-num-seqs ({RUNBOOKS}kv-exhaustion.md)"))
    elif waiting >= 1:
        verdicts.append(Verdict(
            "kv-exhaustion", "compute-bound", base,
            "requests wait while KV is free: the token budget or compute limits admission; "
            "check --max-num-batched-tokens and --max-num-seqs, or add replicas "
            f"({RUNBOOKS}kv-exhaustion.md)"))
    if prefix_caching_enabled(last) is False:
        verdicts.append(Verdict(
            "prefix-miss", "prefix-caching-disabled",
            {"enable_prefix_caching": last.cache_config.get("enable_prefix_caching")},
            "restart vllm serve without --no-enable-prefix-caching "
            f"({RUNBOOKS}prefix-miss.md)"))
    ext_q = delta(first, last, "external_prefix_queries")
    if ext_q > 0 and delta(first, last, "external_prefix_hits") == 0:
        verdicts.append(Verdict(
            "prefix-miss", "offload-miss", {"external_prefix_queries": ext_q,
                                            "external_prefix_hits": 0},
            f"the offload tier answers no lookups: check the LMCache server ({RUNBOOKS}offload.md)"))
    verdicts.extend(_offload_verdicts(last))
    queue = hist_mean(first, last, "queue")
    ttft = hist_mean(first, last, "ttft")
    if queue is not None and ttft and queue > 0.5 * ttft and waiting >= 1:
        verdicts.append(Verdict(
            "ttft-regression", "queueing",
            {"queue_mean_s": round(queue, 4), "ttft_mean_s": round(ttft, 4), "waiting": waiting},
            "most of TTFT is queueing: arrival rate exceeds the drain rate; compare with a baseline "
            f"via `kvops loadtest ttft-regression --baseline FILE` ({RUNBOOKS}ttft-regression.md)"))
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
            f"with `kvops offload serve --config kvops.yaml` ({RUNBOOKS}offload.md)")]
    if degraded is not None and degraded > 0:
        return [Verdict(
            "offload", "degraded", evidence,
            "the connector runs degraded (recomputing instead of loading): check the vLLM log for "
            f"kvops offload errors and `kvops offload status` ({RUNBOOKS}offload.md)")]
    disk = last.values.get("kvops_offload_disk_degraded")
    if disk is not None and disk > 0:
        return [Verdict(
            "offload", "degraded", {**evidence, "kvops_offload_disk_degraded": disk},
            "the disk tier refuses writes (full or read-only; the vLLM log's `kvops offload DISK "
            f"DEGRADED` line says which): free space or remount it read-write ({RUNBOOKS}offload.md)")]
    return []


def verdicts_from_result(path: Path) -> list[Verdict]:
    """The verdicts a `kvops loadtest` result JSON reached."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BadInputError(f"cannot read result file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise BadInputError(f"result file {path} is not JSON: {exc.msg}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("verdicts"), list):
        raise BadInputError(f"result file {path} has no 'verdicts' list: pass a kvops loadtest result JSON")
    try:
        return [Verdict.from_dict(v) for v in data["verdicts"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInputError(f"result file {path}: malformed verdict ({exc})") from exc


def merge(live: list[Verdict], from_result: list[Verdict]) -> list[Verdict]:
    """Problems found anywhere win over 'healthy'."""
    found = [v for v in live + from_result if v.problem != "healthy"]
    return found or (live or from_result)[:1]
