"""The vLLM general plugin: ``vllm.general_plugins: kvops = kvops.plugin:register``.

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers,
the model-inspection subprocess). It must stay cheap and idempotent, import vLLM lazily and
change nothing when no kvops settings are given.
"""

from __future__ import annotations

import os

_REGISTERED_PID: int | None = None


def register() -> None:
    """Hook kvops into this vLLM process (idempotent per process)."""
    global _REGISTERED_PID
    if _REGISTERED_PID == os.getpid():
        return
    from kvops.plugin import _compat

    _compat.install_config_hook()
    _compat.register_offload_connector()
    _compat.install_attention_hook()
    _REGISTERED_PID = os.getpid()
    _compat.plugin_logger().info("kvops plugin registered (pid=%d)", os.getpid())


def reset_for_tests() -> None:
    """Forget this process's registration so a test can register again."""
    global _REGISTERED_PID
    _REGISTERED_PID = None
