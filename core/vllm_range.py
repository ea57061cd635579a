"""The vLLM releases kvops supports: one constant for the plugin, ``kvops doctor`` and the extras.

The plugin reaches into vLLM internals (kvops.plugin._compat lists every hook point); they are
those of one minor release, so the range is that minor. The plugin stays out of any other vLLM
(kvops.plugin.guest), ``kvops doctor`` fails it, and pyproject's ``cpu``/``gpu`` extras pin it
(tests/core/test_vllm_range.py checks that they agree).
"""

from __future__ import annotations

import re
from typing import Final

SUPPORTED_VLLM_MINOR: Final = "0.32"
SUPPORTED_VLLM: Final = f"{SUPPORTED_VLLM_MINOR}.x"
"""The range as people read it, in messages."""

_MINOR = re.compile(r"(\d+)\.(\d+)(?!\d)")


def supports_vllm(version: str) -> bool:
    """Whether ``vllm.__version__`` (``0.32.0``, ``0.32.1rc1``, ``0.32.0+cpu``) is in the range.

    vLLM's own fallback when it cannot read its version is ``dev`` (vllm/version.py): a tree
    whose internals nobody has checked, so not supported.
    """
    match = _MINOR.match(version.strip())
    return match is not None and f"{int(match[1])}.{int(match[2])}" == SUPPORTED_VLLM_MINOR
