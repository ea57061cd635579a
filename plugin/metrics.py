"""The plugin's Prometheus metrics, in the registry vLLM serves on /metrics.

Metric objects are created on first use (no import-time side effects) and kept in one
per-process table; ``reset_for_tests`` drops them.

Every series carries ``model_name`` with the value vLLM gives its own ``vllm:*`` series, so one
PromQL ``by (job, instance, model_name)`` joins ours with theirs and an alert names the model.
The config hook binds it (``bind_model_name``) when vLLM builds its config, before any metric.
"""

from __future__ import annotations

from typing import Any

from kvops import __version__
from kvops.core.settings import FEATURE_FIELDS, KvopsSettings

MODEL_LABEL = "model_name"
_METRICS: dict[str, Any] = {}
_MODEL_NAME: list[str] = []  # the bound value, once bound


def served_model_name(vllm_config: Any) -> str:
    """The ``model_name`` vLLM labels its series with (vllm/v1/metrics/loggers.py reads
    ``model_config.served_model_name``): the first ``--served-model-name``, else ``--model``."""
    from vllm.config.model import get_served_model_name

    model_config = vllm_config.model_config
    return str(get_served_model_name(model_config.model, model_config.served_model_name))


def bind_model_name(vllm_config: Any) -> None:
    """Label this process's kvops series with the model vLLM is configured to serve."""
    if getattr(vllm_config, "model_config", None) is not None:
        _MODEL_NAME[:] = [served_model_name(vllm_config)]


def bound_model_name() -> str:
    """The bound name; unbound (a process whose config hook did not run, e.g. a scheduler built
    by `kvops bench admission`), vLLM's current config's, else "" with one warning. Never an
    exception: metrics are created inside vLLM's step and error paths, where raising would stop
    the engine (issue 15)."""
    if not _MODEL_NAME:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None and getattr(config, "model_config", None) is not None:
            bind_model_name(config)
        else:
            import logging

            logging.getLogger("kvops").warning(
                "kvops metrics: no vLLM config in this process to take model_name from; kvops "
                "series here carry model_name=\"\"")
            _MODEL_NAME[:] = [""]
    return _MODEL_NAME[0]


class ModelSeries:
    """A metric whose series all carry this process's ``model_name``: callers name only their
    own labels (``.labels(tenant=...)``) or none (``.set(1)``), as with prometheus_client."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self.metric = metric
        self.model_name = model_name

    def labels(self, *values: str, **labels: str) -> Any:
        if values:
            return self.metric.labels(self.model_name, *values)
        return self.metric.labels(**{MODEL_LABEL: self.model_name}, **labels)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)


def _registry() -> Any:
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


def gauge(name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> ModelSeries:
    """One Gauge per name per process, registered where vLLM's /metrics reads."""
    model_name = bound_model_name()
    if name not in _METRICS:
        from prometheus_client import Gauge

        _METRICS[name] = Gauge(
            name, documentation, labelnames=(MODEL_LABEL, *labelnames), registry=_registry(),
            multiprocess_mode="mostrecent",
        )
    return ModelSeries(_METRICS[name], model_name)


def counter(name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> ModelSeries:
    """One Counter per name per process (exposed as ``<name>_total``), like ``gauge()``."""
    model_name = bound_model_name()
    if name not in _METRICS:
        from prometheus_client import Counter

        _METRICS[name] = Counter(name, documentation, labelnames=(MODEL_LABEL, *labelnames),
                                 registry=_registry())
    return ModelSeries(_METRICS[name], model_name)


def publish_info(vllm_config: Any, settings: KvopsSettings | None) -> None:
    """kvops_info{...}=1 and kvops_feature_enabled{feature}=0|1."""
    import vllm

    bind_model_name(vllm_config)  # the stat logger's config is the final one
    features = settings.features() if settings else ()
    info = gauge(
        "kvops_info",
        "kvops plugin build and configuration (value is always 1)",
        ("version", "vllm_version", "configured", "features", "config_file",
         "offload_transfer_mode", "offload_l1_transfer"),
    )
    info.labels(
        version=__version__,
        vllm_version=vllm.__version__,
        configured="true" if settings else "false",
        features=",".join(features) or "none",
        config_file=(settings.config if settings and settings.config else ""),
        offload_transfer_mode=offload_transfer_mode(vllm_config),
        offload_l1_transfer=offload_l1_transfer(vllm_config),
    ).set(1)
    enabled = gauge(
        "kvops_feature_enabled", "Whether a kvops feature is switched on (1) or not (0)",
        ("feature",),
    )
    for feature in FEATURE_FIELDS:
        enabled.labels(feature=feature).set(1 if feature in features else 0)
    publish_scheduler_limits(vllm_config)


def offload_transfer_mode(vllm_config: Any) -> str:
    """The transfer mode the offload connector runs (transfer_mode auto resolved by the
    preflight, kvops.plugin.offload.wiring), or "" without kvops offload."""
    return _offload_extra(vllm_config, "lmcache.mp.mp_transfer_mode")


def offload_l1_transfer(vllm_config: Any) -> str:
    """How engine_driven loads leave LMCache's L1: "shm" (the worker copies from the server's
    /dev/shm segment) or "pickled" (through ZMQ); "" in lmcache_driven or without kvops offload
    (kvops.plugin.offload.wiring.with_l1_transfer, whose log line says why)."""
    return _offload_extra(vllm_config, "kvops.offload.l1_transfer")


def _offload_extra(vllm_config: Any, key: str) -> str:
    """A value the offload preflight wrote into the connector's extra config ("" without kvops offload)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    return str(extra.get(key, "")) if "kvops.offload" in extra else ""


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
    """Drop every kvops metric (the model_name binding stays)."""
    for metric in _METRICS.values():
        try:
            _registry().unregister(metric)
        except KeyError:
            pass
    _METRICS.clear()
