"""The staging fleet end to end: diagnosis per replica from Prometheus, the load-balancer guard,
the runbooks' PromQL on live data, alerts that fire under real load and reach the webhook with
job/instance/model_name/runbook_url, resolve when it stops, a distributed `kvops loadtest`
through the proxy (metrics from Prometheus) that agrees with one process, a replica that misses
its scrapes (held stopped) kept whole in the load test's fleet reading and diagnosed as too busy
to answer rather than dead, and a down alert for a job whose targets all vanished (absent(), on a
second Prometheus) and for a killed replica (with its model_name).

Tests run in file order on one fleet; the last one kills a replica. The alert rules are
runbooks/alerts.yaml with staging durations (`for: 3s`, 15 s windows, kvops.ops.staging.configs).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from kvops.core.prom import samples_by_name
from kvops.core.promql import DEFAULT_SELECTOR
from kvops.loadtest.hooks.scraper import CATCH_UP_S, PrometheusSampler
from kvops.ops.staging.fleet import Fleet, start_prometheus, wait_targets_up

from .staging import REPO, WAIT_S, promql, proxy_load, wait_for
from .starved import RERUNS, client_bound, note_rerun

pytestmark = pytest.mark.e2e

KVOPS = str(Path(sys.executable).with_name("kvops"))
KV_ALERTS = {"KvopsKVCacheExhausted", "KvopsPreemptionStorm"}
# pages whose queries have data while KV-exhaustion load runs (requests finish, queue, are
# admitted or shed, look up prefixes)
PAGES_UNDER_KV_LOAD = {"kv-exhaustion.md", "admission-rejections.md", "prefix-miss.md",
                       "ttft-regression.md"}


@pytest.fixture(scope="module", autouse=True)
def _fleet_ends_with_this_module(staging_fleet: Fleet) -> Iterator[None]:
    """Give the two cores back to the rest of the session as soon as these tests are done (the
    fleet is four servers; stopping twice is harmless)."""
    yield
    staging_fleet.stop()


def kvops(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVOPS, *args], capture_output=True, text=True, timeout=120, check=False)


def fleet_json(fleet: Fleet, window: str = "15") -> tuple[int, dict[str, Any]]:
    proc = kvops("diagnose", "--prometheus", fleet.prometheus_url, "--window", window, "--json")
    return proc.returncode, json.loads(proc.stdout)


def webhook_alert(fleet: Fleet, names: set[str], status: str, instance: str | None = None,
                  since: float = 0.0) -> dict[str, Any] | None:
    """The first alert at the webhook with that name, status (and instance) that started at or
    after ``since`` (epoch seconds)."""
    assert fleet.webhook is not None
    for alert in fleet.webhook.alerts():
        labels = alert["labels"]
        if (labels["alertname"] in names and alert["status"] == status
                and (instance is None or labels.get("instance") == instance)
                and _started(alert) >= since):
            return alert
    return None


def _started(alert: dict[str, Any]) -> float:
    """Alertmanager's startsAt (RFC 3339, nanoseconds) as epoch seconds."""
    stamp = re.sub(r"(\.\d{1,6})\d*", r"\1", alert["startsAt"]).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


def test_idle_fleet_is_healthy_replica_by_replica(staging_fleet: Fleet) -> None:
    code, doc = fleet_json(staging_fleet)
    assert code == 0, doc
    assert set(doc["replicas"]) == set(staging_fleet.instances())
    assert all(v[0]["problem"] == "healthy" for v in doc["replicas"].values()), doc
    assert [v["problem"] for v in doc["verdicts"]] == ["healthy"]


def test_verify_prometheus_checks_every_replica_against_the_plan(staging_fleet: Fleet, tmp_path: Path) -> None:
    """The oracle is vLLM's own start-up line ('KV cache size: N tokens') in replica 0's log."""
    log = staging_fleet.replicas[0].log_path.read_text(errors="replace")
    [tokens] = {m.replace(",", "") for m in re.findall(r"KV cache size: ([\d,]+) tokens", log)}
    for name, size, code in (("right", int(tokens), 0), ("wrong", int(tokens) + 128, 3)):
        plan = tmp_path / f"{name}.json"
        plan.write_text(json.dumps({"kv_cache_size_tokens": size}))
        proc = kvops("verify", "--prometheus", staging_fleet.prometheus_url, "--expect", str(plan), "--json")
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert set(json.loads(proc.stdout)["replicas"]) == set(staging_fleet.instances())


def test_diagnose_url_refuses_the_load_balancer_and_takes_a_replica(staging_fleet: Fleet) -> None:
    proc = kvops("diagnose", "--url", staging_fleet.proxy_url, "--window", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "load balancer" in line
    assert "--prometheus" in line
    replica = kvops("diagnose", "--url", staging_fleet.replicas[0].url, "--window", "1")
    assert replica.returncode == 0, replica.stdout + replica.stderr
    # the load test's server-side evidence is the same two scrapes' worth: refused the same way
    load = kvops("loadtest", "kv-exhaustion", "--url", staging_fleet.proxy_url, "--api-key",
                 staging_fleet.spec.api_key, "--model", staging_fleet.spec.served_model_name)
    assert load.returncode == 2, load.stdout + load.stderr
    [line] = load.stderr.strip().splitlines()
    assert "load balancer" in line, line
    assert "--prometheus" in line, line


def _page_promql() -> list[tuple[str, str]]:
    """Inline PromQL of every runbook page (the spans tests/runbooks/test_pages.py parses)."""
    metric = re.compile(r"\b(vllm:[a-z_:]+|kvops_[a-z0-9_]+|lmcache:[a-z_:]+)")
    found = []
    for page in sorted((REPO / "runbooks").glob("*.md")):
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            if "(" in span and metric.search(span) and not span.startswith(("kvops ", "curl ")):
                found.append((page.name, span))
    return found


def test_every_runbook_query_runs_on_live_prometheus(staging_fleet: Fleet) -> None:
    queries = _page_promql()
    assert len(queries) >= 5
    for page, query in queries:
        body = promql(staging_fleet, query)
        assert body.get("status") == "success", f"{page}: {query}: {body.get('error')}"


def test_every_dashboard_query_runs_on_live_prometheus(staging_fleet: Fleet) -> None:
    """Each panel query with Grafana's variables as the 'All' choice would set them."""
    dashboard = json.loads((REPO / "runbooks" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        query = re.sub(r"\$(job|instance|model_name)\b", ".*", expr.replace("$__rate_interval", "15s"))
        body = promql(staging_fleet, query)
        assert body.get("status") == "success", f"{query}: {body.get('error')}"
    up = promql(staging_fleet, 'vllm:num_requests_running{job=~".*", model_name=~".*"}')["data"]["result"]
    assert {r["metric"]["model_name"] for r in up} == {staging_fleet.spec.served_model_name}


def _names(result: tuple[int, dict[str, Any]], instance: str) -> tuple[int, dict[str, Any]] | None:
    """The diagnosis when its fleet verdicts name ``instance`` under kv-exhaustion, else None."""
    named = {v["evidence"].get("instance") for v in result[1]["verdicts"] if v["problem"] == "kv-exhaustion"}
    return result if instance in named else None


def test_kv_load_through_the_proxy_fires_pages_and_resolves(staging_fleet: Fleet) -> None:
    load = proxy_load(staging_fleet)
    try:
        firing = wait_for("a KV alert at the webhook",
                          lambda: webhook_alert(staging_fleet, KV_ALERTS, "firing"))
        labels = firing["labels"]
        assert labels["job"] == "vllm"
        assert labels["instance"] in staging_fleet.instances()
        assert labels["model_name"] == staging_fleet.spec.served_model_name
        assert firing["annotations"]["runbook_url"].endswith("runbooks/kv-exhaustion.md")
        for page, query in _page_promql():  # the pages' queries show the incident
            if page in PAGES_UNDER_KV_LOAD:  # (within a few 1 s scrapes: under this load a
                # replica's scrape times out now and then, and its series are stale until the next)
                wait_for(f"{page}: {query} non-empty",
                         lambda q=query: promql(staging_fleet, q)["data"]["result"], timeout_s=10)
        # the alert fires 3 s into the incident; the diagnosis reads a 15 s window of it
        code, doc = wait_for(f"the fleet diagnosis naming {labels['instance']}",
                             lambda: _names(fleet_json(staging_fleet), labels["instance"]), timeout_s=120)
        assert code == 3, doc
    finally:
        load.stop()
    wait_for(f"{labels['alertname']} resolved at the webhook",
             lambda: webhook_alert(staging_fleet, {labels["alertname"]}, "resolved", labels["instance"]))


def test_promtool_finds_nothing_wrong_with_kvops_series(staging_fleet: Fleet) -> None:
    """`promtool check metrics` on each replica's live /metrics (admission and offload on
    replica 0): every problem it reports is about vLLM's own names (colons), none about a kvops_ one;
    and every kvops_ sample carries vLLM's model_name (the served name, not the model's path)."""
    body = {"model": staging_fleet.spec.served_model_name, "prompt": "hello", "max_tokens": 2}
    for r in staging_fleet.replicas:  # the front door publishes its settings once it has served
        requests.post(r.url + "/v1/completions", json=body, headers=staging_fleet.headers(), timeout=120)
    pages = [requests.get(r.url + "/metrics", timeout=10).text for r in staging_fleet.replicas]
    assert any("kvops_admission_settings_info" in text for text in pages)  # issue 13's `quantile`
    assert any("kvops_offload_server_up" in text for text in pages)
    for text in pages:
        # vLLM's own: all but vllm:cache_config_info (labelled from CacheConfig only) carry it
        assert _model_names(text, "vllm:") - {None} == {staging_fleet.spec.served_model_name}
        assert _model_names(text, "kvops_") == {staging_fleet.spec.served_model_name}
        proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode in (0, 3), proc.stdout + proc.stderr  # 3: lint findings only
        ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("kvops_")]
        assert ours == [], ours


def test_a_replica_that_misses_scrapes_keeps_its_counts_in_the_load_tests_fleet_reading(
        staging_fleet: Fleet) -> None:
    """A replica too busy to answer a 1 s scrape drops out of Prometheus' instant queries (a
    failed scrape marks its series stale); here it is held stopped (SIGSTOP) for 3 s, the same
    fault on demand. The load test's fleet reading keeps its counters and KV pool instead of
    falling: summed as queried, one CI run read 17 -> 0 -> 20 preemptions and called a
    preempting step compute-bound."""
    replica, instance = staging_fleet.replicas[0], staging_fleet.instances()[0]
    body = {"model": staging_fleet.spec.served_model_name, "prompt": "hello", "max_tokens": 2}
    requests.post(replica.url + "/v1/completions", json=body, headers=staging_fleet.headers(), timeout=120)
    wait_for(f"{instance}'s prompt tokens in Prometheus", lambda: promql(
        staging_fleet, f'vllm:prompt_tokens_total{{instance="{instance}"}} > 0')["data"]["result"])
    sampler = PrometheusSampler(staging_fleet.prometheus_url, DEFAULT_SELECTOR)

    def read_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sampler.sample_now()
            time.sleep(0.25)

    read_for(2.0)
    replica.pause()
    try:
        read_for(3.0)
    finally:
        replica.resume()
    read_for(3.0)
    assert sampler.failures == []
    assert sampler.fleet.missed[instance] >= 1, "Prometheus kept answering for the stopped replica"
    assert len(sampler.replicas[instance]) < len(sampler.samples)
    counts = [s.get("prompt_tokens") for s in sampler.samples]
    assert counts == sorted(counts), counts
    pools = {s.cache_config["num_gpu_blocks"] for s in sampler.samples}
    assert len(pools) == 1, pools  # both replicas' blocks in every reading
    # stopped over the run's end, the replica has counted things only its next reading brings:
    # the sampler's stop reads on until it is back (CI once lost a step's one preemption so)
    replica.pause()
    resume = threading.Timer(6.0, replica.resume)
    resume.start()
    try:
        wait_for(f"{instance} missing from the fleet reading",
                 lambda: sampler.sample_now() or sampler.samples[-1].unread, timeout_s=5.0)
        stopping = time.monotonic()
        sampler.stop(settle_s=0.0)
    finally:
        resume.join()
    assert sampler.samples[-1].unread == [], "stop did not read on until the replica was back"
    assert time.monotonic() - stopping < CATCH_UP_S


def _down_in_prometheus(fleet: Fleet, instance: str) -> dict[str, Any] | None:
    targets = requests.get(fleet.prometheus_url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return next((t for t in targets if t["labels"]["instance"] == instance and t["health"] == "down"), None)


def test_a_replica_too_busy_to_answer_its_scrape_is_told_from_a_dead_one(
        staging_fleet: Fleet, tmp_path: Path) -> None:
    """Held stopped, a replica still takes the scrape's connection (the kernel accepts it) and
    answers nothing until scrape_timeout: what an overloaded server does. `kvops diagnose
    --prometheus` says scrape-timeout with Prometheus' error, not "is it running?" (a killed
    replica refuses the connection: target-down, in the last test). `kvops verify --prometheus`
    names it as not compared (its sizing series are stale), where it once left it out unsaid."""
    replica, instance = staging_fleet.replicas[0], staging_fleet.instances()[0]
    log = replica.log_path.read_text(errors="replace")
    [tokens] = {m.replace(",", "") for m in re.findall(r"KV cache size: ([\d,]+) tokens", log)}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kv_cache_size_tokens": int(tokens)}))  # vLLM's own: a match
    replica.pause()
    try:
        wait_for(f"Prometheus marking {instance} down", lambda: _down_in_prometheus(staging_fleet, instance))
        code, doc = fleet_json(staging_fleet)
        verify = kvops("verify", "--prometheus", staging_fleet.prometheus_url, "--expect", str(plan), "--json")
    finally:
        replica.resume()
    assert verify.returncode == 3, verify.stdout + verify.stderr
    rows = json.loads(verify.stdout)["replicas"]
    assert set(rows) == set(staging_fleet.instances()), rows
    assert rows[instance]["compared"] is False, rows
    assert "timed out" in rows[instance]["explanation"], rows
    assert f"kvops verify --url http://{instance}" in rows[instance]["explanation"]
    assert [row["match"] for i, row in rows.items() if i != instance] == [True], rows
    assert f"not compared (no current sizing in Prometheus): {instance}" in verify.stderr
    [verdict] = doc["replicas"][instance]
    assert code == 3, doc
    assert (verdict["problem"], verdict["cause"]) == ("inconclusive", "scrape-timeout"), verdict
    assert "deadline exceeded" in verdict["evidence"]["last_error"], verdict
    assert f"kvops diagnose --url http://{instance}" in verdict["next"]
    wait_for(f"{instance} scraped again", lambda: not _down_in_prometheus(staging_fleet, instance))


def _model_names(page: str, prefix: str) -> set[str | None]:
    """The model_name values of every sample whose name starts with ``prefix`` (None: no label)."""
    return {labels.get("model_name") for name, rows in samples_by_name(page).items()
            if name.startswith(prefix) for labels, _ in rows}


# kv-exhaustion through the proxy: 8 users of EOS-ignoring completions for one step, short enough
# that the two runs add about a minute. A replica has 16 KV blocks of 128 tokens; a ~460-token
# prompt takes 4, so the 4 users a replica serves fill its cache from the start and the verdict
# does not hang on how far decoding got by the step's end (with 60-word prompts and 800 tokens out,
# KV use crossed the 0.9 bound near the end of a 20 s step: one run kv-capacity, the next not)
LOAD_S = 20
USERS = 8
KV_LOAD = f"""scenario: kv-exhaustion
workload: {{api: completions, prompt_words: 400, max_tokens: 400, ignore_eos: true}}
steps: [{USERS}]
step_s: {LOAD_S}
error_rate_failing: 0.5
"""
# (replica 0's strict admission answers an occasional 429 instead of queueing: that is the fleet's
# policy, in either mode; at the default 5% two of them would call a step of ~15 requests failing)
Z = 3.0
"""Standard deviations of the count difference allowed (a normal tail of ~0.3%)."""


def proxy_loadtest(fleet: Fleet, out: Path, workers: int) -> dict[str, Any]:
    """`kvops loadtest kv-exhaustion` through the proxy, each replica's metrics from Prometheus;
    its result JSON, with each verdict checked to name replicas Prometheus scrapes."""
    result = _proxy_loadtest_once(fleet, out, workers)
    for again in range(1, RERUNS + 1):
        if not client_bound(result):
            break
        note_rerun(result)
        result = _proxy_loadtest_once(fleet, out.with_name(f"{out.name}-again{again}"), workers)
    return result


def _proxy_loadtest_once(fleet: Fleet, out: Path, workers: int) -> dict[str, Any]:
    scenario = out.with_suffix(".yaml")
    scenario.write_text(KV_LOAD)
    proc = subprocess.run(
        [KVOPS, "loadtest", "kv-exhaustion", "--url", fleet.proxy_url, "--prometheus", fleet.prometheus_url,
         "--api-key", fleet.spec.api_key, "--model", fleet.spec.served_model_name, "--workers", str(workers),
         "--scenario-file", str(scenario), "--out", str(out), "--progress", "0", "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    assert result["processes"] == max(1, workers)
    for v in result["verdicts"]:
        if v["problem"] != "healthy":
            assert v["evidence"]["instance"] in fleet.instances(), v
    return result


def _records(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(result["files"]["records"]).read_text().splitlines()]


def closed_loop_tolerance(records: list[dict[str, Any]]) -> float:
    """How far two runs' request counts may differ by chance. Each user sends back to back, so
    its requests are a renewal process: over LOAD_S, with request times of mean m and deviation s,
    its count varies by LOAD_S·s²/m³ (the renewal central limit theorem), plus a Bernoulli term
    of at most 1/4 for where the step's end falls in the request it cuts off. USERS such users per
    run, two independent runs: Z standard deviations of the difference. m and s from both runs'
    requests that ended before the stop, answered or refused (none or one: s = 0)."""
    times = [r["e2e_s"] for r in records if not r["stopped"]]
    renewal = LOAD_S * statistics.stdev(times) ** 2 / statistics.fmean(times) ** 3 if len(times) > 1 else 0.0
    return Z * math.sqrt(2 * USERS * (renewal + 0.25))


def test_distributed_loadtest_through_the_proxy_matches_one_process(staging_fleet: Fleet, tmp_path: Path) -> None:
    """A master + 2 workers reach the verdict one Locust process reaches on the same fleet, and
    send as many requests. A worker's requests stopped in flight reach the master only in its
    final report, so each worker must have some: a headless master once exited before its
    workers' final reports and lost one worker's 4 here. (Not exactly one per user: a user whose
    request ends in the instant the stop arrives has none in flight, which a starved machine
    makes likely: 7 of 8 once, at a load average of 16.)"""
    distributed = proxy_loadtest(staging_fleet, tmp_path / "distributed", workers=2)
    single = proxy_loadtest(staging_fleet, tmp_path / "single", workers=0)
    shown = json.dumps({name: {"client": r["client"], "steps": r.get("steps"), "verdicts": r["verdicts"]}
                        for name, r in (("distributed", distributed), ("single", single))})
    verdicts = [[(v["problem"], v["cause"]) for v in r["verdicts"]] for r in (distributed, single)]
    assert verdicts[0] == verdicts[1], shown
    assert verdicts[0][0][0] == "kv-exhaustion", shown
    records = [_records(distributed), _records(single)]
    stopped = Counter(r["worker"] for r in records[0] if r["stopped"])
    assert len(stopped) == 2, shown  # both workers' final reports
    assert sum(stopped.values()) <= USERS, shown
    assert 0 < sum(r["stopped"] for r in records[1]) <= USERS, shown
    tolerance = closed_loop_tolerance(records[0] + records[1])
    assert abs(len(records[0]) - len(records[1])) <= tolerance, f"tolerance {tolerance:.1f}: {shown}"


def _down_alerts(prometheus: str) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = requests.get(prometheus + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "KvopsVllmDown"]


def test_a_job_whose_every_target_vanished_fires_the_down_alert_through_absent(
        staging_fleet: Fleet, tmp_path: Path) -> None:
    """Service discovery losing every target leaves no `up` series at all, so `up == 0` never
    fires; `absent(up{job="vllm"})` does. A second, real Prometheus with the staging rules finds
    one live replica through a file_sd list, which is then emptied."""
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([{"targets": [staging_fleet.instances()[0]]}]))
    prometheus = start_prometheus(tmp_path / "prometheus", targets, staging_fleet.spec.alerts, None)
    try:
        wait_targets_up(prometheus.url, 1, timeout_s=WAIT_S)
        time.sleep(5)  # longer than the staging `for: 3s`: a down alert would be firing by now
        assert [a for a in _down_alerts(prometheus.url) if a["state"] == "firing"] == []
        targets.write_text("[]")
        alert = wait_for("KvopsVllmDown firing through absent()", lambda: next(
            (a for a in _down_alerts(prometheus.url) if a["state"] == "firing"), None), timeout_s=120)
        assert alert["labels"] == {"alertname": "KvopsVllmDown", "job": "vllm", "severity": "critical"}
        assert "no target" in alert["annotations"]["summary"]
    finally:
        prometheus.stop()


def test_a_killed_replica_fires_the_down_alert(staging_fleet: Fleet) -> None:
    """Only a down alert that started after the kill counts: under the KV load test a replica too
    busy to answer a 1 s scrape fired one of its own (staging's `for: 3s`), and CI once took that
    earlier alert for this one and diagnosed before Prometheus had seen the kill."""
    victim = staging_fleet.instances()[1]
    killed_at = time.time()
    staging_fleet.kill_replica(1)
    alert = wait_for("KvopsVllmDown at the webhook",
                     lambda: webhook_alert(staging_fleet, {"KvopsVllmDown"}, "firing", victim,
                                           since=killed_at - 1.0))
    assert alert["labels"]["job"] == "vllm"
    assert alert["labels"]["severity"] == "critical"
    # up has no model_name; the rule joins it from the series the replica exported before
    assert alert["labels"]["model_name"] == staging_fleet.spec.served_model_name
    code, doc = fleet_json(staging_fleet)
    assert code == 3
    assert doc["replicas"][victim][0]["cause"] == "target-down"
    assert "refused" in doc["replicas"][victim][0]["evidence"]["last_error"]  # not a timeout
