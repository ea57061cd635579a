"""Turn a finished run (records + /metrics samples) into verdicts and reports.

Called in the Locust process that owns the run (local or master) when it quits, and usable on
its own from saved files. Knows no Locust.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvops.core.errors import EXIT_CHECK_FAILED, EXIT_OK, KvopsError
from kvops.core.prom import MetricsSample, delta, hist_mean
from kvops.core.stats import mean, percentile
from kvops.core.trace.replay import Replay
from kvops.core.verdict import Verdict
from kvops.loadtest.analysis import kv, prefix, replay, ttft
from kvops.loadtest.analysis.fleet import name_replicas
from kvops.loadtest.analysis.tokens import ServerTokenizer
from kvops.loadtest.baseline import load_baseline
from kvops.loadtest.config import (
    KvExhaustionConfig,
    PrefixMissConfig,
    ScenarioConfig,
    TraceReplayConfig,
    TtftRegressionConfig,
)
from kvops.loadtest.records import RequestRecord, write_jsonl

SCHEMA = "kvops.loadtest.result/1"


@dataclass
class Run:
    config: ScenarioConfig
    host: str
    model: str
    started_at: float
    ended_at: float
    records: list[RequestRecord]
    samples: list[MetricsSample]
    out_dir: Path
    baseline: Path | None = None
    processes: int = 1
    expect: Path | None = None
    ramp: dict[str, Any] | None = None
    """kv-exhaustion: how its steps were sized from the server (None: given by the operator)."""
    replay: Replay | None = None
    """trace-replay: the requests replayed (arrival times, lengths, block ids)."""
    headers: dict[str, str] = field(default_factory=dict)
    """What the server wants with /tokenize (an API key, a proxy's headers); never written out."""
    replicas: dict[str, list[MetricsSample]] | None = None
    """The samples per replica when they were read from Prometheus (``samples`` is the fleet's)."""
    missed: dict[str, int] | None = None
    """With ``replicas``: the fleet readings each replica was missing from (a failed scrape)."""
    overdue_s: list[float] = field(default_factory=list)
    """ttft-regression: lateness at the stop of the arrivals never sent (every user waiting)."""
    overdue_count: int = 0


def client_summary(records: list[RequestRecord], samples: list[MetricsSample]) -> dict[str, Any]:
    """Client totals, with our TTFT set beside the server's histogram mean over the run.

    Two client clocks: ``ttft`` stops at the first event with text (what a user sees);
    ``first_event`` at the first event with choices, even if its text is empty, which is the
    server's and ``vllm bench serve``'s definition (vllm/benchmarks/lib/endpoint_request_func.py
    "text could be empty here"). They differ when the detokenizer holds the first tokens' text
    back (a partial UTF-8 byte of a byte-level BPE, common for random tiny models), by about
    that many ITLs; ``ttft_after_first_event_ms_mean`` reports it.
    """
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    # the server times every request that got a first token, also those the run's end cut off
    firsts = [r.first_event_s for r in records if r.first_event_s is not None]
    server = hist_mean(samples[0], samples[-1], "ttft") if len(samples) >= 2 else None
    server_count = delta(samples[0], samples[-1], "ttft_count") if len(samples) >= 2 else None
    client_mean, first_mean = mean(ttfts), mean(firsts)
    held = [r.ttft_s - r.first_event_s for r in ok if r.ttft_s is not None and r.first_event_s is not None]
    return {
        "requests": len(records), "ok": len(ok),
        "errors": sum(1 for r in records if not r.ok and not r.stopped),
        "stopped_in_flight": sum(1 for r in records if r.stopped),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": client_mean, "server_ttft_mean_s": server,
        "ttft_client_minus_server_ms": _diff_ms(client_mean, server),
        "server_ttft_count": server_count, "first_event_count": len(firsts),
        "first_event_mean_s": first_mean, "first_event_p50_s": percentile(firsts, 50),
        "first_event_client_minus_server_ms": _diff_ms(first_mean, server),
        "ttft_after_first_event_ms_mean": _diff_ms(mean(held), 0.0),
        "first_event_without_text": sum(1 for h in held if h > 0),
        "e2e_p50_s": percentile([r.e2e_s for r in ok if r.e2e_s is not None], 50),
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "token_count_mismatches": sum(1 for r in ok if r.token_count_mismatch),
        "workers": sorted({r.worker for r in records}),
    }


def _diff_ms(a: float | None, b: float | None) -> float | None:
    return round((a - b) * 1000, 2) if a is not None and b is not None else None


def analyse(run: Run) -> tuple[dict[str, Any], list[Verdict], int]:
    """Scenario-specific section of the result, its verdicts and the exit code."""
    cfg, duration = run.config, run.ended_at - run.started_at
    if isinstance(cfg, KvExhaustionConfig):
        expected = kv.load_expectation(run.expect) if run.expect else None
        steps, verdicts = kv.analyse(cfg, run.records, run.samples, run.started_at, expected,
                                     run.ramp, processes=run.processes)
        return {"steps": kv.steps_table(steps)}, verdicts, EXIT_OK
    if isinstance(cfg, PrefixMissConfig):
        tokenizer = ServerTokenizer(run.host, run.model, headers=run.headers)
        summary, verdicts = prefix.analyse(run.records, run.samples, tokenizer, cfg.min_ratio,
                                           duration_s=cfg.duration_s)
        return {"prefix": summary}, verdicts, EXIT_OK
    if isinstance(cfg, TraceReplayConfig):
        if run.replay is None:
            raise KvopsError("trace-replay: the run has no replay plan")
        tokenizer = ServerTokenizer(run.host, run.model, headers=run.headers)
        summary, verdicts = replay.analyse(cfg, run.replay, run.records, run.samples, tokenizer)
        missed = any(v.problem != "healthy" for v in verdicts)
        return {"replay": summary}, verdicts, EXIT_CHECK_FAILED if missed else EXIT_OK
    assert isinstance(cfg, TtftRegressionConfig)
    summary = ttft.summarise(cfg, run.records, run.samples, duration,
                             overdue=(run.overdue_s, run.overdue_count), processes=run.processes)
    section: dict[str, Any] = {"ttft": {"summary": summary}}
    if run.baseline is None:
        return section, [ttft.no_baseline(summary, cfg.late_s)], EXIT_OK
    table, verdicts = ttft.compare(cfg, load_baseline(run.baseline), summary)
    section["ttft"]["comparison"] = table
    section["ttft"]["baseline"] = str(run.baseline)
    failed = any(v.problem == "ttft-regression" for v in verdicts)
    return section, verdicts, EXIT_CHECK_FAILED if failed else EXIT_OK


def finalize(run: Run) -> tuple[dict[str, Any], int]:
    """Analyse, write records/metrics/result JSON/HTML/PNG under out_dir; (result, exit code)."""
    from kvops.loadtest import report

    run.out_dir.mkdir(parents=True, exist_ok=True)
    files = {name: str(run.out_dir / f) for name, f in (
        ("json", "result.json"), ("html", "report.html"), ("png", "main.png"),
        ("records", "records.jsonl"), ("metrics", "metrics.jsonl"))}
    write_jsonl(Path(files["records"]), (r.to_dict() for r in run.records))
    write_jsonl(Path(files["metrics"]), (s.to_dict() for s in run.samples))
    section, verdicts, code = analyse(run)
    if run.replicas:
        verdicts = name_replicas(verdicts, run.replicas, run.missed)
    if any(v.problem != "healthy" for v in verdicts):
        code = EXIT_CHECK_FAILED  # README: 3 whenever a verdict names a problem
    result: dict[str, Any] = {
        "schema": SCHEMA, "scenario": run.config.scenario, "host": run.host, "model": run.model,
        "started_at": run.started_at, "ended_at": run.ended_at,
        "duration_s": round(run.ended_at - run.started_at, 3), "processes": run.processes,
        "config": run.config.model_dump(), "client": client_summary(run.records, run.samples),
        **section, "verdicts": [v.to_dict() for v in verdicts], "exit_code": code, "files": files,
    }
    Path(files["json"]).write_text(json.dumps(result, indent=2, default=str) + "\n")
    report.write_html(result, run.records, run.samples, Path(files["html"]), Path(files["png"]))
    return result, code
