"""What the plugin does when vLLM builds its configuration (front-end process).

Each feature adds its validation/config step here; the vLLM-facing wrapper is in _compat.
"""

from __future__ import annotations

from typing import Any

from kvops.plugin.settings import KvopsSettings, load_settings


def settings_of(vllm_config: Any) -> KvopsSettings | None:
    """The validated kvops settings of a VllmConfig, or None when kvops is not configured."""
    return load_settings(getattr(vllm_config, "additional_config", None))


def before_platform_config(vllm_config: Any) -> None:
    """Validate the kvops settings themselves before vLLM's platform hook runs."""
    settings_of(vllm_config)


def after_platform_config(vllm_config: Any) -> None:
    """Feature checks that need the platform's final say (block size, dtype...)."""
    settings = settings_of(vllm_config)
    if settings is None:
        return
