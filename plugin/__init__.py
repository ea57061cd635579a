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
    from kvops.plugin import _compat, hooks
    from kvops.plugin.offload import CONNECTOR_MODULE, CONNECTOR_NAME

    _compat.install_config_hook(hooks.before_platform_config, hooks.after_platform_config)
    _compat.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE)
    _compat.install_attention_hook(hooks.after_attention_weights)
    _REGISTERED_PID = os.getpid()
    _compat.plugin_logger().info("kvops plugin registered (pid=%d)", os.getpid())


def reset_for_tests() -> None:
    """Forget this process's registration so a test can register again."""
    global _REGISTERED_PID
    _REGISTERED_PID = None
