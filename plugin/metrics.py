"""The plugin's Prometheus metrics, in the registry vLLM serves on /metrics.

Metric objects are created on first use (no import-time side effects) and kept in one
per-process table; ``reset_for_tests`` drops them.
"""

from __future__ import annotations

from typing import Any

from kvops import __version__
from kvops.plugin.settings import FEATURE_FIELDS, KvopsSettings

_METRICS: dict[str, Any] = {}


def _registry() -> Any:
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


def gauge(name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Any:
    """One Gauge per name per process, registered where vLLM's /metrics reads."""
    if name not in _METRICS:
        from prometheus_client import Gauge

        _METRICS[name] = Gauge(
            name, documentation, labelnames=labelnames, registry=_registry(),
            multiprocess_mode="mostrecent",
        )
    return _METRICS[name]


def counter(name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Any:
    """One Counter per name per process (exposed as ``<name>_total``), like ``gauge()``."""
    if name not in _METRICS:
        from prometheus_client import Counter

        _METRICS[name] = Counter(name, documentation, labelnames=labelnames, registry=_registry())
    return _METRICS[name]


def publish_info(vllm_config: Any, settings: KvopsSettings | None) -> None:
    """kvops_info{...}=1 and kvops_feature_enabled{feature}=0|1."""
    import vllm

    features = settings.features() if settings else ()
    info = gauge(
        "kvops_info",
        "kvops plugin build and configuration (value is always 1)",
        ("version", "vllm_version", "configured", "features", "config_file"),
    )
    info.labels(
        version=__version__,
        vllm_version=vllm.__version__,
        configured="true" if settings else "false",
        features=",".join(features) or "none",
        config_file=(settings.config if settings and settings.config else ""),
    ).set(1)
    enabled = gauge(
        "kvops_feature_enabled", "Whether a kvops feature is switched on (1) or not (0)",
        ("feature",),
    )
    for feature in FEATURE_FIELDS:
        enabled.labels(feature=feature).set(1 if feature in features else 0)
    publish_scheduler_limits(vllm_config)


def publish_scheduler_limits(vllm_config: Any) -> None:
    """kvops_scheduler_max_num_seqs / _max_num_batched_tokens as the server runs them: vLLM's
    /metrics has no scheduler limits, so a load test cannot tell a server pinned at
    --max-num-seqs from one starved by its token budget without them."""
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is None:
        return
    gauge("kvops_scheduler_max_num_seqs",
          "vLLM's max_num_seqs (requests running at once) as this server runs it"
          ).set(int(sched.max_num_seqs))
    gauge("kvops_scheduler_max_num_batched_tokens",
          "vLLM's max_num_batched_tokens (tokens per engine step) as this server runs it"
          ).set(int(sched.max_num_batched_tokens))


def reset_for_tests() -> None:
    for metric in _METRICS.values():
        try:
            _registry().unregister(metric)
        except KeyError:
            pass
    _METRICS.clear()
