"""Diagnosis of a fleet from Prometheus: one verdict list per replica, from PromQL over a window.

A load balancer in front of several replicas makes two scrapes of its /metrics come from
different processes, so rates computed from them are meaningless; Prometheus scrapes each
replica by its own address and keeps the ``instance`` label, so the same rules as
``kvops diagnose --url`` (kvops.ops.diagnose.diagnose_samples) run per instance on numbers
PromQL computes over the window (``increase`` for counters, resets handled by Prometheus).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvops.core.errors import BadInputError
from kvops.core.prom import MetricsSample
from kvops.core.promql import DEFAULT_SELECTOR, Prometheus, check_selector
from kvops.core.verdict import Verdict

# counters (and histogram sums/counts) as increase() over the window: key -> metric
INCREASES: dict[str, str] = {
    "preemptions": "vllm:num_preemptions_total",
    "external_prefix_queries": "vllm:external_prefix_cache_queries_total",
    "external_prefix_hits": "vllm:external_prefix_cache_hits_total",
    "queue_sum": "vllm:request_queue_time_seconds_sum",
    "queue_count": "vllm:request_queue_time_seconds_count",
    "ttft_sum": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
}
# the plugin's offload gauges, as the last value
KVOPS_GAUGES = ("kvops_offload_server_up", "kvops_offload_degraded", "kvops_offload_disk_degraded",
                "kvops_offload_load_path_ok")


@dataclass(frozen=True)
class FleetDiagnosis:
    """Verdicts per replica (by Prometheus' ``instance``) and the fleet's own list: every
    problem of any replica, each naming its instance, or one 'healthy'."""

    replicas: dict[str, list[Verdict]]
    down: tuple[str, ...] = ()
    verdicts: list[Verdict] = field(default_factory=list)

    def unhealthy(self) -> list[str]:
        return [i for i, vs in self.replicas.items() if any(v.problem != "healthy" for v in vs)]

    def fleet_line(self) -> str:
        bad = self.unhealthy()
        if not bad:
            return f"fleet: {len(self.replicas)} replicas, all healthy"
        named = ", ".join(
            f"{i} ({'; '.join(f'{v.problem}/{v.cause}' for v in self.replicas[i] if v.problem != 'healthy')})"
            for i in bad)
        return f"fleet: {len(self.replicas)} replicas, unhealthy: {named}"

    def to_dict(self) -> dict[str, Any]:
        return {"verdicts": [v.to_dict() for v in self.verdicts],
                "replicas": {i: [v.to_dict() for v in vs] for i, vs in self.replicas.items()}}


def diagnose_fleet(prometheus: str, selector: str = DEFAULT_SELECTOR,
                   window_s: float = 30.0) -> FleetDiagnosis:
    """Verdicts for every replica Prometheus scrapes under ``selector``."""
    from kvops.ops.diagnose import diagnose_samples

    sel = check_selector(selector)
    prom = Prometheus(prometheus)
    up = prom.by_instance(f"up{sel}")
    if not up:
        raise BadInputError(f"Prometheus at {prometheus} scrapes no target matching {sel}: "
                            "check --selector (the job name of your vLLM scrape config)")
    samples = _samples(prom, sel, window_s)
    errors = prom.scrape_errors() if any(v < 1 for v in up.values()) else {}
    replicas: dict[str, list[Verdict]] = {}
    for instance in sorted(up):
        if up[instance] < 1:
            replicas[instance] = [_unscraped(instance, errors.get(instance, {}))]
            continue
        first, last = samples.get(instance, (MetricsSample(0.0), MetricsSample(window_s)))
        replicas[instance] = diagnose_samples(first, last)
    return FleetDiagnosis(replicas, tuple(i for i, v in up.items() if v < 1), _fleet_verdicts(replicas))


_TIMED_OUT = ("deadline exceeded", "timeout", "timed out")


def _timed_out(error: dict[str, Any]) -> bool:
    """Prometheus' last scrape error says the target took the connection and did not answer
    within scrape_timeout (alive and overloaded, most often), not that it refused it."""
    return any(word in error.get("last_error", "").lower() for word in _TIMED_OUT)


def _unscraped(instance: str, error: dict[str, Any]) -> Verdict:
    """A replica whose last scrape failed. Prometheus' error tells a server that took the
    connection and did not answer within scrape_timeout (alive and overloaded, most often: under
    KV load a CPU server here missed its 1 s scrapes) from one that refused it (down)."""
    evidence: dict[str, Any] = {"instance": instance, "up": 0, **error}
    if _timed_out(error):
        return Verdict(
            "inconclusive", "scrape-timeout", evidence,
            f"the replica took Prometheus' scrape and did not answer /metrics within "
            f"{error.get('scrape_timeout') or 'scrape_timeout'}: an overloaded server does this; read "
            f"it directly with `kvops diagnose --url http://{instance}` and see `kvops runbook kv-exhaustion` "
            "(`kvops runbook startup-kv-oom` if it does not answer at all)")
    return Verdict("inconclusive", "target-down", evidence,
                   "Prometheus cannot scrape this replica: is it running? (`kvops runbook startup-kv-oom`)")


def _samples(prom: Prometheus, sel: str, window_s: float) -> dict[str, tuple[MetricsSample, MetricsSample]]:
    """Per instance, two MetricsSamples whose differences are PromQL's increases over the window
    and whose gauges are the window's: waiting is its mean (1 or more: a queue that lasted, not a
    request passing through between two steps), KV usage its maximum."""
    w = f"{int(window_s)}s"
    now = time.time()
    values: dict[str, dict[str, float]] = {}

    def put(key: str, promql: str) -> None:
        for instance, value in prom.by_instance(promql).items():
            values.setdefault(instance, {})[key] = value

    put("waiting", f"sum by (instance) (avg_over_time(vllm:num_requests_waiting{sel}[{w}]))")
    put("running", f"sum by (instance) (vllm:num_requests_running{sel})")
    put("kv_usage", f"max by (instance) (max_over_time(vllm:kv_cache_usage_perc{sel}[{w}]))")
    for key, metric in INCREASES.items():
        put(key, f"sum by (instance) (increase({metric}{sel}[{w}]))")
    for name in KVOPS_GAUGES:
        put(name, f"max by (instance) ({name}{sel})")
    cache = {labels.get("instance", ""): labels for labels, _ in prom.query(f"vllm:cache_config_info{sel}")}
    out = {}
    for instance, vals in values.items():
        first = MetricsSample(t=now - window_s, values={k: v for k, v in vals.items()
                                                        if k in ("waiting", "kv_usage")})
        last = MetricsSample(t=now, values=vals, cache_config=cache.get(instance, {}))
        out[instance] = (first, last)
    return out


def _fleet_verdicts(replicas: dict[str, list[Verdict]]) -> list[Verdict]:
    """Every replica's problems, each with its instance in the evidence; healthy when none."""
    found = [Verdict(v.problem, v.cause, {"instance": i, **v.evidence}, v.next)
             for i, vs in replicas.items() for v in vs if v.problem != "healthy"]
    if found:
        return found
    return [Verdict("healthy", "none", {"replicas": len(replicas)}, "nothing to do")]


def verify_fleet(prometheus: str, selector: str, doc: Any) -> dict[str, Any]:
    """Each replica's KV sizing (its ``vllm:cache_config_info`` in Prometheus) against one plan
    (a kvops.core.plan.Expectation): ``{"match", "replicas": {instance: comparison}}``."""
    from kvops.ops.capacity.verify import compare, observed_from_labels

    sel = check_selector(selector)
    prom = Prometheus(prometheus)
    rows, up = prom.query(f"vllm:cache_config_info{sel}"), prom.by_instance(f"up{sel}")
    if not rows and not up:
        raise BadInputError(f"Prometheus at {prometheus} has no vllm:cache_config_info matching {sel}: "
                            "check --selector (the job name of your vLLM scrape config)")
    replicas = {labels.get("instance", ""): compare(doc.capacity, observed_from_labels(labels))
                for labels, _ in rows}
    errors = prom.scrape_errors() if any(v < 1 for v in up.values()) else {}
    for instance in up.keys() - replicas.keys():
        replicas[instance] = _not_compared(instance, up[instance], errors.get(instance, {}))
    return {"match": all(r["match"] for r in replicas.values()), "replicas": dict(sorted(replicas.items()))}


def _not_compared(instance: str, up: float, error: dict[str, Any]) -> dict[str, Any]:
    """A replica Prometheus scrapes (``up``) whose sizing it does not have: its last scrape
    failed (its series are stale), or it exports no vllm:cache_config_info. Never left out of the
    comparison unsaid: a fleet with one replica unread has not been shown to match the plan."""
    row: dict[str, Any] = {"match": False, "compared": False, "up": up, **error}
    direct = f"compare it directly: `kvops verify --url http://{instance} --expect PLAN`"
    if up >= 1:
        row["explanation"] = ("not compared: Prometheus scrapes it but it exports no vllm:cache_config_info "
                              f"(not a vLLM server, or one too old); {direct}")
    elif _timed_out(error):
        row["explanation"] = (f"not compared: its last scrape timed out ({error['last_error']}), so Prometheus "
                              f"holds no current sizing for it; an overloaded server does this; {direct}")
    else:
        row["explanation"] = ("not compared: Prometheus cannot scrape it"
                              + (f" ({error['last_error']})" if error.get("last_error") else "")
                              + f": is it running? (`kvops runbook startup-kv-oom`); once it is, {direct}")
    return row

