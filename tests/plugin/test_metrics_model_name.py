"""Every kvops series carries ``model_name`` with the value vLLM gives its own series: built here
from the plugin's real publishers into vLLM's registry, read back as Prometheus text."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from vllm.config.model import get_served_model_name

from kvops.core.admission.policy import KVBudget
from kvops.core.admission.settings import AdmissionSettings
from kvops.core.offload.canary import CanaryResult
from kvops.core.prom import samples_by_name
from kvops.core.settings import load_settings
from kvops.plugin import metrics
from kvops.plugin.admission import http as admission_http
from kvops.plugin.fp8.metrics import publish_fp8
from kvops.plugin.loops import count_internal_error
from kvops.plugin.offload import canary


def _config(model: str, served: Any) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, served_model_name=served, use_mla=False),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=512),
        cache_config=SimpleNamespace(cache_dtype="fp8"),
        kv_transfer_config=None, additional_config={"kvops": {"admission": {}}},
    )


@pytest.fixture(autouse=True)
def _fresh_metrics() -> Iterator[None]:
    metrics.reset_for_tests()
    yield
    metrics.reset_for_tests()


@pytest.mark.parametrize(("served", "expected"), [
    (None, "/models/tiny"), ("", "/models/tiny"), ("staging-tiny", "staging-tiny"),
    (["staging-tiny", "alias"], "staging-tiny"),
])
def test_the_label_value_is_the_one_vllm_picks(served, expected):
    config = _config("/models/tiny", served)
    assert metrics.served_model_name(config) == expected
    assert expected == get_served_model_name("/models/tiny", served)  # vLLM's own rule


def _publish_everything(config: Any) -> None:
    settings = load_settings(config.additional_config)
    metrics.publish_info(config, settings)
    publish_fp8(config, None)  # fp8 KV without scales: the default source, scale 1.0
    admission_http._publish_settings(AdmissionSettings(), KVBudget(usable_blocks=100, block_size=16, max_model_len=512))
    admission_http._count("rejected", "queued_kv_tokens")
    admission_http._tenant_gauge("other", 3)
    count_internal_error("offload_poller")
    canary.publish(CanaryResult(ok=True, reason="ok", loaded_tokens=16, checked_at=1.0))


def test_every_kvops_series_carries_the_served_model_name():
    config = _config("/models/tiny", ["staging-tiny", "alias"])
    _publish_everything(config)
    by_name = samples_by_name(generate_latest(metrics._registry()).decode())
    ours = {name: rows for name, rows in by_name.items() if name.startswith("kvops_")}
    assert {"kvops_info", "kvops_fp8_scale_source", "kvops_admission_settings_info",
            "kvops_admission_decisions_total", "kvops_internal_errors_total",
            "kvops_offload_load_path_ok"} <= set(ours)
    labels = {row_labels.get("model_name") for rows in ours.values() for row_labels, _ in rows}
    assert labels == {"staging-tiny"}


def test_unbound_takes_vllms_current_config_and_never_raises(monkeypatch, caplog):
    """A process whose config hook did not run (a worker, `kvops bench admission`) names the model
    from vLLM's current config; without one it labels "" and warns: raising would stop the engine."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(metrics, "_MODEL_NAME", [])
    current = SimpleNamespace(model_config=SimpleNamespace(model="/m", served_model_name="current-llm"),
                              compilation_config=SimpleNamespace())
    with set_current_vllm_config(current):  # type: ignore[arg-type]
        assert metrics.bound_model_name() == "current-llm"
    monkeypatch.setattr(metrics, "_MODEL_NAME", [])
    series = metrics.gauge("kvops_unbound", "registered with an empty model_name")
    assert series.model_name == ""
    assert "no vLLM config" in caplog.text


def test_every_decision_series_exists_at_zero_before_the_first_decision():
    """A PromQL rate() over a series that does not exist yet is empty, not 0: the rejected/total
    ratio of admission-rejections.md and KvopsAdmissionRejecting had no value on a loaded replica
    until its first 429. The reasons are the ones the policy returns (its Literal), read from
    core, not from the list under test."""
    from typing import get_args, get_type_hints

    from kvops.core.admission.policy import QueueDecision

    metrics.publish_info(_config("/models/tiny", None), None)
    admission_http._publish_settings(AdmissionSettings(), KVBudget(usable_blocks=100, block_size=16, max_model_len=512))
    rows = samples_by_name(generate_latest(metrics._registry()).decode())["kvops_admission_decisions_total"]
    seen = {(labels["decision"], labels["reason"]): value for labels, value in rows}
    queue_reasons = set(get_args(get_type_hints(QueueDecision)["reason"])) - {"ok"}
    assert len(queue_reasons) == 3
    assert {("rejected", r) for r in queue_reasons} | {("admitted", "ok"), ("rejected", "never_fits")} <= set(seen)
    assert set(seen.values()) == {0.0}
