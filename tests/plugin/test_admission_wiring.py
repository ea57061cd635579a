"""Which scheduler class admission asks vLLM for, on real vLLM SchedulerConfig objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import SchedulerConfig

from kvops.core.admission.settings import AdmissionSettings
from kvops.core.errors import KvopsPluginError
from kvops.plugin.admission import http as admission_http
from kvops.plugin.admission.wiring import configure


def _config(async_scheduling: bool, scheduler_cls: object = None) -> SimpleNamespace:
    scheduler = SchedulerConfig(
        max_model_len=1024, is_encoder_decoder=False, async_scheduling=async_scheduling,
        scheduler_cls=scheduler_cls,
    )
    return SimpleNamespace(scheduler_config=scheduler)


@pytest.fixture(autouse=True)
def _fresh_door():
    yield
    admission_http.reset_for_tests()


@pytest.mark.parametrize(
    ("async_scheduling", "expected"),
    [(False, "kvops.plugin.admission.KVBudgetScheduler"), (True, "kvops.plugin.admission.KVBudgetAsyncScheduler")],
)
def test_unset_scheduler_is_set_to_the_matching_variant(async_scheduling, expected):
    config = _config(async_scheduling)
    configure(config, AdmissionSettings())
    assert config.scheduler_config.scheduler_cls == expected
    # vLLM resolves it to a class of the right family (vllm/config/scheduler.py:228).
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    resolved = config.scheduler_config.get_scheduler_cls()
    assert issubclass(resolved, AsyncScheduler) == async_scheduling
    assert admission_http.door() is not None


def test_a_foreign_or_mismatched_scheduler_is_refused_with_the_fix():
    with pytest.raises(KvopsPluginError) as err:
        configure(_config(False, "vllm.v1.core.sched.scheduler.Scheduler"), AdmissionSettings())
    assert "--scheduler-cls kvops.plugin.admission.KVBudgetScheduler" in str(err.value)
    with pytest.raises(KvopsPluginError) as err:
        configure(_config(True, "kvops.plugin.admission.KVBudgetScheduler"), AdmissionSettings())
    assert "KVBudgetAsyncScheduler (async scheduling is on)" in str(err.value)


def test_policy_off_changes_nothing():
    config = _config(False, "vllm.v1.core.sched.scheduler.Scheduler")
    configure(config, AdmissionSettings(policy="off"))
    assert config.scheduler_config.scheduler_cls == "vllm.v1.core.sched.scheduler.Scheduler"
    assert admission_http.door() is None


def test_more_than_one_api_server_is_warned_about_loudly(monkeypatch):
    from vllm.config import ParallelConfig

    from kvops.plugin import _compat

    warnings: list[str] = []
    monkeypatch.setattr(_compat, "plugin_logger", lambda: SimpleNamespace(warning=warnings.append))
    single = _config(False)
    single.parallel_config = ParallelConfig()
    configure(single, AdmissionSettings())
    assert warnings == []

    # vLLM's own ParallelConfig, as `vllm serve --api-server-count 3` fills it in
    # (vllm/entrypoints/cli/serve.py:309 -> EngineArgs -> ParallelConfig).
    several = _config(False)
    several.parallel_config = ParallelConfig(_api_process_count=3)
    configure(several, AdmissionSettings())
    assert len(warnings) == 1
    assert "--api-server-count 3" in warnings[0]
    assert "up to 3x in total" in warnings[0]
    assert "run --api-server-count 1" in warnings[0]
