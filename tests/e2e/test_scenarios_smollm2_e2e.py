"""The three load-test scenarios against the real model (issue 41): SmolLM2-135M-Instruct (conftest
``smollm2_model``) on one vLLM server with a KV cache of 48 blocks, shared by the three tests.
Each verdict is held against what vLLM itself counted, read by the test from the server's
/metrics with prometheus_client (around the run, and once a second during kv-exhaustion's),
and against the model's own tokenizer (transformers); never against timings. How far a run
gets depends on the CPU it is given (a busy shared box finished no request in a 1-user step
of 8 s, a calmer one reached 96% KV with 15 waiting at 30 users), so each verdict the scenario
can give is checked for what it claims: one run each, no reruns, within the suite's budget.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvops.loadtest.config import KvExhaustionConfig, apply_overrides, doubling_steps, load_config
from kvops.loadtest.scenarios.workloads import generated_body
from kvops.ops.bench.admission_leak import wait_idle
from kvops.ops.launch import ManagedServer

from .test_loadtest_e2e import _loadtest_once as loadtest

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128  # vLLM's CPU backend's default block size (checked against the log below)
BLOCK_BYTES = BLOCK_TOKENS * 30 * 3 * 64 * 2 * 4  # 30 layers × 3 KV heads × 64 × K,V × fp32
BLOCKS = 48
"""The issue's cache: 47 usable blocks (vLLM keeps block 0 as its null block)."""
ARGS = ("--max-model-len", "2048", "--dtype", "float32")
"""float32, not the checkpoint's bf16: this CPU has AVX2 and no AVX-512 BF16, and a 240-word
prompt with 32 tokens out took 4.5-11.6 s in bf16 against 2.3-2.6 s in float32 (side by side,
one thread each); in bf16 a 36-s ramp finished no request at all. KV follows the dtype."""
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""The model's forward on one OpenMP thread: with two (SERVING_ENV: the cores' count) on this
shared 2-core box, 30 layers' thread barriers made a 32-token completion take 31-49 s, against
1.8-1.9 s with one (side by side, load average 10-14); the tiny model's 4 layers hide it."""
KV_WORKLOAD = "workload: {prompt_words: 240, max_tokens: 96}\n"
"""~270 prompt tokens (3 blocks of 128) + 96 out = 3 blocks a request: 15 fit whole, and 16
users' prompts alone (48 blocks) do not, so a queue forms at admission, not only as decodes grow."""


@pytest.fixture  # per test: the pool restarts it if another server evicted it
def real(vllm, smollm2_model: Path) -> ManagedServer:
    return vllm(smollm2_model, *ARGS, kv_cache_bytes=BLOCKS * BLOCK_BYTES, env=ONE_THREAD)


def scrape(url: str) -> dict[str, float]:
    """vLLM's own samples, summed over their labels (one engine here)."""
    text = requests.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def settled(url: str) -> dict[str, float]:
    """vLLM's samples once it runs and holds no request: a request the run before cut off on the
    client (Locust stops its users at once) may still be finishing in vLLM, and counts there."""
    wait_idle(url, timeout_s=120)
    return scrape(url)


@contextmanager
def watched(url: str) -> Iterator[list[dict[str, float]]]:
    """The server's /metrics once a second while the block runs, and once before and after."""
    readings = [scrape(url)]
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(1.0):
            try:
                readings.append(scrape(url))
            except requests.RequestException:
                pass  # a reading the busy server did not answer in time: the next one counts

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield readings
    finally:
        stop.set()
        thread.join()
        readings.append(scrape(url))


def grew(readings: list[dict[str, float]], name: str) -> float:
    return readings[-1].get(name, 0.0) - readings[0].get(name, 0.0)


def records(result: dict) -> list[dict]:
    return [json.loads(line) for line in open(result["files"]["records"])]


def test_kv_exhaustion_on_the_real_model(vllm, real, smollm2_model, tmp_path):
    from transformers import AutoTokenizer

    log = vllm.log_of(real)
    match = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert match, log[-2000:]
    assert int(match.group(1).replace(",", "")) == BLOCKS * BLOCK_TOKENS
    scenario = tmp_path / "kv.yaml"
    scenario.write_text(KV_WORKLOAD)
    with watched(real.url) as readings:
        _, result = loadtest(tmp_path, "kv-exhaustion", real.url, "--duration", "48",
                             "--scenario-file", str(scenario))
    (verdict,) = result["verdicts"]
    ev = verdict["evidence"]
    # the knee the ramp aims past, from vLLM's log and the model's own tokenizer: the body the
    # ramp sized itself with (the scenario's first generated one) plus the output it asks for
    config = load_config("kv-exhaustion", scenario)
    assert isinstance(config, KvExhaustionConfig)
    body = generated_body(config.workload, str(smollm2_model), random.Random(0))
    tokens = len(AutoTokenizer.from_pretrained(str(smollm2_model))(body["prompt"])["input_ids"])
    knee = (BLOCKS - 1) // math.ceil((tokens + config.workload.max_tokens) / BLOCK_TOKENS)
    assert ev["ramp"]["predicted_knee_users"] == knee
    # issue 41: the sized ramp ends at twice the knee itself, not the doubling below it
    assert [s["users"] for s in result["steps"]] == doubling_steps(2 * knee)
    preempted = grew(readings, "vllm:num_preemptions_total")
    queued_full = any(r.get("vllm:num_requests_waiting", 0) >= 1
                      and r.get("vllm:kv_cache_usage_perc", 0) >= 0.9 for r in readings)
    seen = max(r.get("vllm:num_requests_running", 0) + r.get("vllm:num_requests_waiting", 0)
               for r in readings)
    named = (verdict["problem"], verdict["cause"])
    print(f"kv-exhaustion on SmolLM2: {'/'.join(named)}, steps {ev['ramp']['steps']}: {verdict['next']}")
    if named == ("kv-exhaustion", "kv-capacity"):
        # vLLM preempted, or held requests waiting with its cache (nearly) full
        assert preempted > 0 or queued_full, (preempted, readings)
        assert knee < ev["knee_users"] <= 2 * knee  # as many as fit whole never exhaust it
        assert ev["preemptions"] <= preempted
        return
    # a run that names no limit saw vLLM preempt nothing
    assert preempted == 0, verdict
    if named == ("inconclusive", "client-bound"):
        # vLLM never held all the top step's users' requests (running + waiting), and the next
        # run is not this one: more Locust processes than its one
        assert seen < 2 * knee, (seen, verdict)
        assert "--workers 2 " in verdict["next"]
        return
    assert named == ("inconclusive", "limit-not-reached"), verdict
    users = int(re.findall(r"--users (\d+)", verdict["next"])[-1])
    duration = float(re.findall(r"--duration (\d+)", verdict["next"])[-1])
    advised = apply_overrides(config, users=users, duration_s=duration)
    assert advised.steps is not None
    assert (advised.steps[-1], advised.step_s) != (2 * knee, ev["ramp"]["step_s"]), verdict["next"]


def test_prefix_miss_on_the_real_model(real, smollm2_model, tmp_path):
    from transformers import AutoTokenizer

    before = settled(real.url)
    _, result = loadtest(tmp_path, "prefix-miss", real.url, "--duration", "15")
    after = settled(real.url)
    (verdict,) = result["verdicts"]
    print(f"prefix-miss on SmolLM2: {verdict['problem']}/{verdict['cause']}: {verdict['next']}")
    if verdict["problem"] == "inconclusive":
        # no request finished within the run: vLLM finished at most those the run's end cut off
        assert verdict["cause"] == "no-samples", verdict
        succeeded = after["vllm:request_success_total"] - before["vllm:request_success_total"]
        assert succeeded <= verdict["evidence"]["stopped_in_flight"], verdict
        assert "--duration" in verdict["next"]
        return
    # four 300-word system prompts (3 blocks each) fit in 47 blocks beside two requests: healthy
    assert verdict["problem"] == "healthy", verdict
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hit = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queried > 0
    # the verdict's rate is vLLM's own count over the run (its scrapes bracket every request)
    assert verdict["evidence"]["measured_hit_rate"] == pytest.approx(hit / queried, abs=0.02)
    # what a cache could hit at most, by the model's tokenizer: each group's shared text in
    # whole blocks, once a request of the group went before
    tok = AutoTokenizer.from_pretrained(str(smollm2_model))
    done = [r for r in records(result) if r["ok"]]
    seen: set[str] = set()
    shareable = prompt_tokens = 0
    for r in sorted(done, key=lambda r: r["sent_at"]):
        ids, shared = tok(r["prompt"])["input_ids"], tok(r["shared_text"])["input_ids"]
        prompt_tokens += len(ids)
        if r["group"] in seen:
            common = next((i for i, (a, b) in enumerate(zip(ids, shared, strict=False)) if a != b),
                          min(len(ids), len(shared)))
            shareable += common // BLOCK_TOKENS * BLOCK_TOKENS
        seen.add(r["group"])
    if len(done) > len(seen):  # a group's second request: something to hit
        assert shareable > 0
    assert hit / queried >= 0.8 * shareable / prompt_tokens  # healthy by vLLM's count too


def test_ttft_regression_on_the_real_model(real, tmp_path):
    scenario = tmp_path / "ttft.yaml"
    scenario.write_text("workload: {prompt_words: 60, max_tokens: 16}\n")
    before = settled(real.url)
    _, result = loadtest(tmp_path, "ttft-regression", real.url, "--rate", "0.5", "--duration", "12",
                         "--scenario-file", str(scenario))
    after = settled(real.url)
    (verdict,) = result["verdicts"]
    print(f"ttft-regression on SmolLM2: {verdict['problem']}/{verdict['cause']}: {verdict['next']}")
    rows = records(result)
    ok = [r for r in rows if r["ok"]]
    cut = [r for r in rows if r.get("stopped")]
    # every request the client counts as answered vLLM counts as a success; beyond those, at most
    # the ones the run's end cut off on the client, which vLLM may still finish (CI once: 6 for 5)
    succeeded = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert len(ok) <= succeeded <= len(ok) + len(cut), (succeeded, len(ok), len(cut))
    counted = after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"]
    if verdict["problem"] == "inconclusive":
        assert verdict["cause"] in ("no-samples", "client-bound"), verdict
        if verdict["cause"] == "no-samples":
            # vLLM made no first token within the run either: at most for those it cut off
            assert counted <= len(cut), verdict
        return
    # no baseline: the run is one (healthy), its server figures vLLM's TTFT histogram over the
    # run: no more observations than vLLM made (a cut-off request's may fall after the last scrape)
    assert verdict["problem"] == "healthy", verdict
    assert "baseline" in verdict["evidence"]["note"]
    intervals = result["ttft"]["summary"]["intervals"]["ttft"]
    assert 0 < sum(c for _, c in intervals) <= counted
