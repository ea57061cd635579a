"""Fixtures shared by every test: the repo root, the shared fixtures folder, a tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvops.ops.launch import SERVER_NICE_ENV

# Every server the tests start (vLLM, LMCache, the proxy, Prometheus) runs at nice 5 and the
# load generators at 0, as if each had its own machine: on two cores a CPU vLLM's spinning
# OpenMP threads otherwise hold the client seconds behind its schedule and the scenarios answer
# inconclusive/client-bound (CI, stop 19). Each ready server's session (its scheduling
# autogroup) is niced too: with only the threads niced, the number counted for nothing against
# the test session (stop 20). 5, not 10: at 10 a server's OpenMP thread sharing a core with the
# test's own threads got a tenth of it, every step waited for it, and the e2e files took 81
# minutes instead of 63 in a clean-clone run (Locust's run-queue wait fell from 0.87 to 0.11 of
# its CPU time); 5 gives the client three quarters of a contended core. Set it to 0 to run them
# side by side unprioritised.
os.environ.setdefault(SERVER_NICE_ENV, "5")
REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = (REPO_ROOT.parent / "shared").resolve()
MODEL_CONFIGS_DIR = SHARED_DIR / "fixtures" / "model-configs"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def model_configs_dir() -> Path:
    assert MODEL_CONFIGS_DIR.is_dir(), f"missing {MODEL_CONFIGS_DIR}: ../shared must sit beside the repo"
    return MODEL_CONFIGS_DIR
