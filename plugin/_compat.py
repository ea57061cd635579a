"""Every place the plugin reaches into vLLM 0.32 internals lives here.

Hook points:
- ``Platform.check_and_update_config`` (vllm/config/vllm.py:1991, inside
  ``VllmConfig.__post_init__``) runs in the front-end process before any engine process
  starts: we validate kvops settings there so that bad settings fail fast.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

_WRAPPED_MARK = "_kvops_wrapped"


def plugin_logger() -> logging.Logger:
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.kvops")


def install_config_hook() -> None:
    """Wrap the current platform's config hook once per process."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, _WRAPPED_MARK, False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        from kvops.plugin.hooks import after_platform_config, before_platform_config

        _fail_fast(before_platform_config, vllm_config)
        original(vllm_config)
        _fail_fast(after_platform_config, vllm_config)

    setattr(check_and_update_config, _WRAPPED_MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def _fail_fast(hook: Any, vllm_config: Any) -> None:
    """Run a hook; a KvopsPluginError stops the process with one line and exit code 2."""
    from kvops.plugin.errors import KvopsPluginError

    try:
        hook(vllm_config)
    except KvopsPluginError as exc:
        message = " ".join(str(exc).split())
        print(f"kvops: refusing to start: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
