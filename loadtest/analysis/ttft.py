"""ttft-regression: TTFT split into queue / prefill / rest, and a baseline comparison with
bootstrap confidence intervals per metric and per component.

Client samples are per request. Server components come from vLLM's histograms
(``request_queue_time``, ``request_prefill_time``, ``time_to_first_token``): each scrape
interval gives one (Δsum, Δcount) pair, and the bootstrap resamples intervals.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvops.core.prom import MetricsSample, delta
from kvops.core.stats import (
    Rows,
    RowStatistic,
    bootstrap_relative_change,
    mean,
    percentile,
    point,
    row_mean,
    row_percentile,
)
from kvops.core.verdict import Verdict, healthy
from kvops.loadtest.analysis import load
from kvops.loadtest.config import TtftRegressionConfig
from kvops.loadtest.records import RequestRecord

COMPONENTS = ("queue", "prefill", "ttft", "decode", "itl")
Interval = tuple[float, float]  # (Δsum, Δcount)


def intervals(samples: Sequence[MetricsSample], name: str) -> list[Interval]:
    out = []
    for a, b in zip(samples, samples[1:], strict=False):
        count = delta(a, b, name + "_count")
        if count > 0:
            out.append((delta(a, b, name + "_sum"), count))
    return out


def pooled_mean(rows: Sequence[Interval]) -> float | None:
    count = sum(c for _, c in rows)
    return sum(s for s, _ in rows) / count if count else None


def answer_s(record: RequestRecord) -> float | None:
    """When the server first answered the request (its response headers, first token or end,
    whichever came first and was recorded)."""
    times = [t for t in (record.headers_s, record.ttft_s, record.e2e_s) if t is not None]
    return min(times, default=None)


def client_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.ok]
    # a request the run's end cut off after its first token measured its TTFT and its ITLs as
    # well as a finished one: under 16x load every request of a 12 s run was still decoding at
    # the end, and without them the comparison had no sample and said "healthy"
    seen = [r for r in records if r.ok or r.stopped]
    # a request still waiting for its first token when the run ended is the worst case of an
    # overload, not a missing value: its time in flight is a lower bound of its TTFT. Not when it
    # was cut off sooner than the server answered any request of the run: that bound says
    # nothing (CI: in a run whose every prompt was refused in 22 ms, one request sent at the
    # end was stopped 2 ms later, and its 2 ms made the run a healthy baseline)
    answers = [t for t in (answer_s(r) for r in records if not r.stopped) if t is not None]
    floor = min(answers, default=0.0)
    censored = [r.e2e_s for r in records
                if r.stopped and r.ttft_s is None and r.e2e_s and r.e2e_s >= floor]
    return {
        "ttft_s": [r.ttft_s for r in seen if r.ttft_s is not None] + censored,
        "itl_mean_s": [sum(r.itl_s) / len(r.itl_s) for r in seen if r.itl_s],
        "e2e_s": [r.e2e_s for r in ok if r.e2e_s is not None],
        "lateness_s": [r.lateness_s for r in records if r.lateness_s is not None],
    }


def summarise(config: TtftRegressionConfig, records: Sequence[RequestRecord],
              samples: Sequence[MetricsSample], duration_s: float,
              overdue: tuple[Sequence[float], int] = ((), 0), processes: int = 1) -> dict[str, Any]:
    """Everything a later run needs to compare against: raw samples plus the headline numbers.
    ``overdue``: the lateness at the stop of the arrivals that came due and were never sent, and
    their count; they are late sends too (lower bounds), so a pool whose every user waited on a
    slow server is named behind its schedule even when each request it did send went out on time."""
    client = client_samples(records)
    client["lateness_s"] = client["lateness_s"] + [round(x, 4) for x in overdue[0]]
    comps = {name: intervals(samples, name) for name in COMPONENTS}
    done = [r for r in records if r.ok]
    # rates over the span the requests actually covered, not the run (which includes spawning)
    first_sent = min((r.sent_at for r in records), default=0.0)
    sent_span = max((r.sent_at for r in records), default=0.0) - first_sent
    done_span = max((r.done_at for r in done), default=0.0) - first_sent
    arrival = round((len(records) - 1) / sent_span, 3) if sent_span > 0 else None
    failed = [r for r in records if not r.ok and not r.stopped]
    return {
        "rate_rps": config.rate_rps, "users": config.users, "duration_s": round(duration_s, 3),
        "processes": processes, "sent": len(records),
        "failed": dict(sorted(Counter(r.status for r in failed).items())),
        "first_error": (failed[0].error or "")[:200] if failed else None,
        "load": load.offered(records, samples, arrival),
        "arrival_rate_rps": arrival,
        "completion_rate_rps": round(len(done) / done_span, 3) if done and done_span > 0 else None,
        "ttft_p50_s": percentile(client["ttft_s"], 50), "ttft_p90_s": percentile(client["ttft_s"], 90),
        "ttft_p99_s": percentile(client["ttft_s"], 99), "itl_mean_s": mean(client["itl_mean_s"]),
        "lateness_p50_s": percentile(client["lateness_s"], 50),
        "lateness_p99_s": percentile(client["lateness_s"], 99),
        "unsent_overdue": overdue[1],
        "server_means_s": {name: pooled_mean(rows) for name, rows in comps.items()},
        "samples": client, "intervals": comps,
    }


def row_pooled_mean(rows: Rows) -> Rows:
    """``pooled_mean`` of each row of (Δsum, Δcount) intervals."""
    with np.errstate(divide="ignore", invalid="ignore"):
        result: Rows = rows[..., 0].sum(axis=1) / rows[..., 1].sum(axis=1)
    return result


CLIENT_METRICS = {"ttft_p50": ("ttft_s", row_percentile(50)), "ttft_p90": ("ttft_s", row_percentile(90)),
                  "itl_mean": ("itl_mean_s", row_mean), "e2e_p50": ("e2e_s", row_percentile(50))}


def compare(config: TtftRegressionConfig, base: dict[str, Any], cand: dict[str, Any]
            ) -> tuple[dict[str, Any], list[Verdict]]:
    """Relative change with CIs; a regression is a CI entirely above the threshold."""
    table: dict[str, Any] = {}
    for name, (key, stat) in CLIENT_METRICS.items():
        table[name] = _row(config, base["samples"].get(key, []), cand["samples"].get(key, []), stat)
    for name in COMPONENTS:
        b = [tuple(x) for x in base["intervals"].get(name, [])]
        c = [tuple(x) for x in cand["intervals"].get(name, [])]
        table["server_" + name] = _row(config, b, c, row_pooled_mean)
    empty = [side for side, summary in (("baseline", base), ("candidate", cand))
             if not summary["samples"].get("ttft_s")]
    if empty:
        return table, [_no_samples(_headline(table), empty, [base if side == "baseline" else cand
                                                            for side in empty])]
    regressed = [n for n in ("ttft_p50", "ttft_p90", "itl_mean") if table[n].get("regressed")]
    late = load.behind(base, cand, config.late_s)
    cpu_bound = [x for x in late if not x.pool_exhausted]
    if cpu_bound and not server_outgrew_lateness(table, cpu_bound):
        return table, [_client_bound(table, base, cand, config, cpu_bound)]
    if cpu_bound:
        regressed = [*regressed, "server_ttft"]
    if not regressed:
        return table, [healthy(compared_with="baseline", **_headline(table),
                               **_load_evidence(base, cand, config, late))]
    return table, [_cause_verdict(table, base, cand, regressed, config, late)]


def server_outgrew_lateness(table: dict[str, Any], late: Sequence[load.Lateness]) -> bool:
    """The server's own TTFT (vLLM's histograms, blind to the client's clock) regressed, and its
    mean grew by more than the worst late send was late: a client behind its schedule sends
    late requests together, and such a burst adds at most about its own lateness to their wait,
    so what is left over is the server's. The client's percentiles stay unreliable (a starved
    client also reads its clock late), the verdict then rests on the server's numbers."""
    row = table.get("server_ttft", {})
    b, c = row.get("baseline"), row.get("candidate")
    if not row.get("regressed") or b is None or c is None:
        return False
    return bool(c - b > max(x.lateness_p99_s for x in late))


def _load_evidence(base: dict[str, Any], cand: dict[str, Any], config: TtftRegressionConfig,
                   late: list[load.Lateness]) -> dict[str, Any]:
    cmp = load.compare(base, cand, config.load_tolerance_rel)
    out: dict[str, Any] = {"load_ratio": cmp.ratios, "work_ratio": cmp.work_ratio,
                           "comparable_load": cmp.comparable and (cmp.work_ratio or 1.0) >= 1 / (
                               1 + config.load_tolerance_rel),
                           "comparison_reliable": not late}
    if late:
        out["client_behind"] = [x.to_dict() for x in late]
    return out


def _behind(late: Sequence[load.Lateness], late_s: float) -> str:
    """How far behind its schedule each late side was, in a verdict's words."""
    return " and ".join(
        f"the {x.side} (send lateness p99 {x.lateness_p99_s} s"
        + (f", {x.late_share:.0%} of sends over {late_s:g} s late)" if x.late_share is not None else ")")
        for x in late)


def _rerun(summary: dict[str, Any]) -> str:
    """More Locust processes than the run had (its summary's ``processes``)."""
    return (f"--workers {load.more_workers(int(summary.get('processes') or 1))} (or on a machine "
            "with more CPU for the client)")


def _client_bound(table: dict[str, Any], base: dict[str, Any], cand: dict[str, Any],
                  config: TtftRegressionConfig, late: list[load.Lateness]) -> Verdict:
    return Verdict("inconclusive", "client-bound", {**_headline(table),
                                                     **_load_evidence(base, cand, config, late)},
                   f"the load generator fell behind its arrival schedule in {_behind(late, config.late_s)} "
                   f"with users to spare: the load compared is not the load asked for. Rerun with "
                   f"{_rerun(cand)} and compare again (`kvops runbook ttft-regression`)")


def _no_samples(evidence: dict[str, Any], sides: Sequence[str], summaries: Sequence[dict[str, Any]]
                ) -> Verdict:
    """Nothing to compare: no request of that run got a first token or was left waiting for
    one (every request failed, or none was sent). Never "healthy" for want of a number."""
    return Verdict("inconclusive", "no-samples", {**evidence, "without_ttft": list(sides)},
                   f"no request of the {' and the '.join(sides)} run measured a TTFT: "
                   f"{_why_no_ttft(summaries)} (`kvops runbook ttft-regression`)")


def _why_no_ttft(summaries: Sequence[dict[str, Any]]) -> str:
    """What the run lacked, from its own records: the server refused the requests (their HTTP
    statuses and the first error say why; the same requests would be refused again), or none
    was sent (the run ended before its first arrival: a longer one). Older result files lack
    the counts: then only the check."""
    failed: Counter[str] = Counter()
    for summary in summaries:
        failed.update({str(k): int(v) for k, v in (summary.get("failed") or {}).items()})
    first = next((s["first_error"] for s in summaries if s.get("first_error")), None)
    if failed:
        statuses = ", ".join(f"HTTP {status} x{n}" for status, n in sorted(failed.items()))
        return (f"every request failed ({statuses}{f'; first: {first}' if first else ''}): the "
                "same requests would fail again, so change what the server refuses first (a prompt "
                "over --max-model-len: shorter prompts in the scenario file, or a larger "
                "--max-model-len), checking with `kvops diagnose --url URL`")
    unsent = [s for s in summaries if s.get("sent") == 0 and s.get("duration_s") and s.get("rate_rps")]
    if unsent:
        s = unsent[0]
        longer = math.ceil(max(2 * float(s["duration_s"]), 3 / float(s["rate_rps"])))
        return (f"none was sent in {s['duration_s']} s at --rate {s['rate_rps']}: rerun with "
                f"--duration {longer}")
    return "check that the server answers (`kvops diagnose --url URL`) before comparing"


def no_baseline(summary: dict[str, Any], late_s: float) -> Verdict:
    """A run without a baseline is one: healthy, unless its own sends fell behind the schedule
    with users to spare (the client's CPU), the one-sided twin of _client_bound. Kept as a
    baseline, such a run would make every later comparison inconclusive (CI, stop 20: a baseline
    5.8 s late, then three candidates compared with it, all client-bound), so it says so now,
    while re-recording is one command away."""
    means = summary["server_means_s"]
    if not summary["samples"].get("ttft_s"):
        return _no_samples({"ttft_p50_s": None, "server_means_s": means}, ["recorded"], [summary])
    late = load.fell_behind("run", summary, late_s)
    if late is None:
        return healthy(note="no baseline given: this result can serve as one (--baseline FILE)",
                       ttft_p50_s=summary["ttft_p50_s"], server_means_s=means)
    if late.pool_exhausted:
        return healthy(note=f"no baseline given: this result can serve as one (--baseline FILE), "
                            f"at the load the server carried: all {late.users} users waited on "
                            f"responses and {summary.get('unsent_overdue') or 0} arrivals were never "
                            f"sent, so it served less than --rate {summary.get('rate_rps')}",
                       ttft_p50_s=summary["ttft_p50_s"], server_means_s=means,
                       client_behind=[late.to_dict()])
    return Verdict("inconclusive", "client-bound",
                   {"ttft_p50_s": summary["ttft_p50_s"], "server_means_s": means,
                    "comparison_reliable": False, "client_behind": [late.to_dict()]},
                   f"the load generator fell behind its arrival schedule in {_behind([late], late_s)} "
                   f"with users to spare: this run offered less than the load asked for and is no "
                   f"baseline. Record it again with {_rerun(summary)} (`kvops runbook ttft-regression`)")


def _row(config: TtftRegressionConfig, base: Sequence[Any], cand: Sequence[Any],
         stat: RowStatistic) -> dict[str, Any]:
    result = bootstrap_relative_change(base, cand, stat, resamples=config.resamples,
                                       confidence=config.confidence)
    b, c = point(base, stat), point(cand, stat)
    if result is None or b is None or c is None:
        return {"baseline": b, "candidate": c}
    change, low, high = result
    return {"baseline": b, "candidate": c, "change": round(change, 4), "ci_low": round(low, 4),
            "ci_high": round(high, 4),
            "regressed": low > config.threshold_rel and (c - b) > config.min_abs_s}


def _headline(table: dict[str, Any]) -> dict[str, Any]:
    return {k: {x: v.get(x) for x in ("change", "ci_low", "ci_high")} for k, v in table.items()
            if k in ("ttft_p50", "ttft_p90", "itl_mean")}


def _cause_verdict(table: dict[str, Any], base: dict[str, Any], cand: dict[str, Any],
                   regressed: list[str], config: TtftRegressionConfig,
                   late: list[load.Lateness]) -> Verdict:
    def grew(name: str) -> float:
        row = table.get("server_" + name, {})
        b, c = row.get("baseline"), row.get("candidate")
        return (c - b) if b is not None and c is not None else 0.0

    d_queue, d_prefill, d_ttft = grew("queue"), grew("prefill"), grew("ttft")
    ttft_regressed = any(n.startswith("ttft") or n == "server_ttft" for n in regressed)
    more = load.compare(base, cand, config.load_tolerance_rel)
    # load first: with more work offered every phase slows, and only the queue says whether
    # admission (not batch contention) took the time
    if ttft_regressed and d_queue >= d_prefill and d_queue > config.min_abs_s:
        cause = "queueing"
    elif more.higher or (ttft_regressed and more.longer):
        cause = "load"
    elif not ttft_regressed:
        cause = "decode"
    elif d_prefill > 0:
        cause = "prefill"
    else:
        cause = "decode"
    arrival, drain = cand.get("arrival_rate_rps"), cand.get("completion_rate_rps")
    evidence = {
        "regressed": regressed, **_headline(table),
        "server_delta_s": {"queue": round(d_queue, 4), "prefill": round(d_prefill, 4),
                           "ttft": round(d_ttft, 4),
                           "rest": round(d_ttft - d_queue - d_prefill, 4)},
        "arrival_rate_rps": arrival, "completion_rate_rps": drain,
        "arrival_over_drain": round(arrival / drain, 2) if arrival and drain else None,
        "baseline_rate_rps": base.get("rate_rps"), "candidate_rate_rps": cand.get("rate_rps"),
        "lateness_p99_s": cand.get("lateness_p99_s"),
        **_load_evidence(base, cand, config, late),
    }
    if "server_ttft" in regressed:
        evidence["verdict_basis"] = "server"
    grown = ", ".join(more.grew(config.load_tolerance_rel)) or "work"
    offered = (f"the candidate offered {more.work_ratio}x the baseline's work ({grown} grew) and "
               "every phase slowed with it" if more.higher else
               f"the candidate's requests are longer ({', '.join(f'{k} x{more.ratios[k]}' for k in more.longer)}) "
               "and take longer to serve at any rate")
    nxt = {
        "load": f"{offered}: that is load, not a slower phase. Compare at the baseline's rate and "
                "lengths, or size for this load: find the knee with `kvops loadtest kv-exhaustion` "
                "and add replicas (`kvops runbook ttft-regression`)",
        "queueing": "TTFT grew in the queue: arrivals outpace the drain rate; add replicas, lower "
                    "the rate, or raise --max-num-seqs if KV allows (`kvops runbook ttft-regression`)",
        "prefill": "TTFT grew in prefill at comparable load and lengths: lost prefix hits or a "
                   "slower build or flags; run `kvops loadtest prefix-miss` and compare the "
                   "builds (`kvops runbook ttft-regression`)",
        "decode": "decode got slower (ITL): check batch size, KV dtype and the build "
                  "(`kvops runbook ttft-regression`)",
    }[cause]
    if "server_ttft" in regressed:
        nxt += (" — the client fell behind its schedule, so its own percentiles are unreliable, "
                "but the server's TTFT (its histograms) grew by more than the client was late: "
                "this verdict rests on the server's numbers")
    elif late:
        nxt += (" — the client fell behind its schedule ("
                + "; ".join(x.to_dict()["why"] for x in late) + "): the comparison is unreliable")
    return Verdict("ttft-regression", cause, evidence, nxt)
