"""The vLLM general plugin: ``vllm.general_plugins: kvops = kvops.plugin:register``.

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers,
the model-inspection subprocess), unguarded. It must stay cheap and idempotent, import vLLM
lazily, change nothing when no kvops settings are given, and never raise: in a vLLM it does not
support it stays out (kvops.plugin.guest).
"""

from __future__ import annotations

import logging
import os

_STATE: tuple[int, bool] | None = None
"""(pid, whether kvops' hooks are installed) of the process that ran ``register()``."""


def register() -> None:
    """Hook kvops into this vLLM process (idempotent per process), or stay out of it."""
    global _STATE
    if _STATE is not None and _STATE[0] == os.getpid():
        return
    _STATE = (os.getpid(), False)
    try:
        from kvops.plugin import guest

        _STATE = (os.getpid(), guest.enter())
    except Exception as exc:  # last resort: vLLM would die of it, in every server of this environment
        logging.getLogger("vllm.plugins.kvops").warning(
            "kvops: plugin not loaded, this vLLM runs as without it: %s: %s",
            type(exc).__name__, " ".join(str(exc).split()))
        return
    if _STATE[1]:
        logging.getLogger("vllm.plugins.kvops").info("kvops plugin registered (pid=%d)", os.getpid())


def stays_out() -> bool:
    """Whether ``register()`` left kvops out of this process (an unsupported vLLM): the stat
    logger, which vLLM builds from its own entry point, then publishes nothing either."""
    return _STATE is not None and _STATE[0] == os.getpid() and not _STATE[1]


def reset_for_tests() -> None:
    """Forget this process's registration so a test can register again."""
    global _STATE
    _STATE = None
