"""What the plugin does when vLLM builds its configuration (front-end process).

Each feature adds its validation/config step here; ``register()`` hands these functions to the
vLLM-facing wrappers in _compat, which know no feature (so no import runs back up).
"""

from __future__ import annotations

from typing import Any

from kvops.core.settings import KvopsSettings, load_settings


def settings_of(vllm_config: Any) -> KvopsSettings | None:
    """The validated kvops settings of a VllmConfig, or None when kvops is not configured."""
    return load_settings(getattr(vllm_config, "additional_config", None))


def before_platform_config(vllm_config: Any) -> None:
    """Validate the kvops settings themselves before vLLM's platform hook runs."""
    from kvops.plugin.metrics import bind_model_name

    bind_model_name(vllm_config)  # before any kvops metric (the in-process warning's gauge)
    settings = settings_of(vllm_config)
    from kvops.plugin.offload.wiring import ensure_connector

    ensure_connector(vllm_config, settings.offload if settings else None)


def after_platform_config(vllm_config: Any) -> None:
    """Feature checks that need the platform's final say (block size, dtype...)."""
    settings = settings_of(vllm_config)
    from kvops.plugin.fp8.validate import check_fp8

    check_fp8(vllm_config, settings.kv_scales if settings else None)
    if settings is None:
        return
    from kvops.plugin._compat import install_shutdown_answer

    install_shutdown_answer()
    if settings.offload is not None:
        from kvops.plugin.offload.wiring import configure

        configure(vllm_config, settings.offload)
    if settings.admission is not None:
        from kvops.plugin.admission.wiring import configure as configure_admission

        configure_admission(vllm_config, settings.admission)


def after_attention_weights(layer: Any, vllm_config: Any) -> None:
    """A worker finished loading an attention layer's weights: apply calibrated fp8 scales (and,
    on an AMX CPU, ask the kernel for AMX tiles first: kvops.plugin.amx)."""
    from kvops.plugin.amx import request_amx

    request_amx()
    settings = settings_of(vllm_config)
    if settings is not None and settings.kv_scales is not None:
        from kvops.plugin.fp8.worker import after_attention_weights as apply_scales

        apply_scales(layer, vllm_config, settings.kv_scales)
