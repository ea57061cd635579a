"""Front-end metrics of the plugin, fed by vLLM's stat-logger plugin hook.

vLLM builds stat loggers in the API-server process (vllm/v1/metrics/loggers.py,
``load_stat_logger_plugin_factories``) with the final VllmConfig, and calls ``record`` with
the scheduler's stats every step: the one place where the front end sees engine state.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from kvops.plugin import stays_out
from kvops.plugin.hooks import settings_of
from kvops.plugin.metrics import publish_info


class KvopsStatLogger(AggregateStatLoggerBase):
    """Publishes ``kvops_info`` once; later features read scheduler stats here."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int]) -> None:
        self.vllm_config = vllm_config
        self.engine_indexes = engine_indexes
        if stays_out():  # an unsupported vLLM (kvops.plugin.guest): no kvops series either
            return
        settings = settings_of(vllm_config)
        publish_info(vllm_config, settings)
        from kvops.plugin.fp8.metrics import publish_fp8

        publish_fp8(vllm_config, settings.kv_scales if settings else None)
        from kvops.plugin.admission.wiring import install_in_api_server

        install_in_api_server(vllm_config, settings.admission if settings else None)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        from kvops.plugin.admission import http as admission_http

        front_door = admission_http.door()
        if front_door is not None:
            front_door.on_step(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        return None
