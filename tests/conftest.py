"""Fixtures shared by every test: the repo root, the shared fixtures folder, a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

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
