"""The ``admission`` settings section and the Retry-After middleware (a real Starlette app)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvops.core.admission.policy import recommended_settings
from kvops.core.admission.settings import AdmissionSettings
from kvops.core.errors import KvopsPluginError
from kvops.core.settings import load_settings
from kvops.plugin.admission import http as admission_http


def _load(admission: object) -> AdmissionSettings:
    settings = load_settings({"kvops": {"admission": admission}})
    assert settings is not None
    assert settings.admission is not None
    return settings.admission


def test_an_empty_section_switches_strict_admission_on():
    admission = _load({})
    assert admission.policy == "strict"
    assert admission.enabled
    assert "admission" in load_settings({"kvops": {"admission": {}}}).features()
    assert not _load({"policy": "off"}).enabled


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"polcy": "strict"}, "admission.polcy"),
        ({"policy": "greedy"}, "admission.policy"),
        ({"headroom_fraction": 1.5}, "admission.headroom_fraction"),
        ({"quantile": 0.5}, "quantile applies only to policy 'expected'"),
        ({"max_queued_requests": 0}, "admission.max_queued_requests"),
        ({"retry_after_max_s": 0}, "admission.retry_after_max_s"),
    ],
)
def test_bad_admission_settings_name_the_field(section, expected):
    with pytest.raises(KvopsPluginError) as err:
        _load(section)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_queue_budget_scales_with_the_cache():
    budget = _load({"max_queued_kv_fraction": 0.5, "max_queue_wait_s": 3}).queue_budget(2048)
    assert budget.max_queued_kv_tokens == 1024
    assert budget.max_queue_wait_s == 3
    assert _load({"max_queued_kv_fraction": None}).queue_budget(2048).max_queued_kv_tokens is None


def test_recommended_settings_validate_and_follow_the_plan():
    # 100 usable blocks of 16 tokens; 200 + 300 tokens = 32 blocks per request -> 3 fit at once
    rec = recommended_settings(num_blocks=101, block_size=16, max_num_seqs=256,
                               typical_prompt_tokens=200, typical_output_tokens=300, headroom_fraction=0.0)
    assert AdmissionSettings.model_validate(rec).max_queued_requests == 3
    capped = recommended_settings(101, 16, max_num_seqs=2, typical_prompt_tokens=1, typical_output_tokens=1)
    assert capped["max_queued_requests"] == 2


@pytest.fixture
def client():
    async def busy(request):
        return JSONResponse({"error": "busy"}, status_code=429)

    async def busy_with_header(request):
        return JSONResponse({"error": "busy"}, status_code=429, headers={"Retry-After": "42"})

    async def stream(request):
        async def body():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/busy", busy), Route("/busy42", busy_with_header), Route("/stream", stream)])
    app.add_middleware(admission_http.RetryAfterMiddleware)
    front = admission_http.install(AdmissionSettings())
    front.last_retry_after_s = 7
    yield TestClient(app)
    admission_http.reset_for_tests()


def test_retry_after_is_added_to_429_only(client):
    assert client.get("/busy").headers["retry-after"] == "7"
    assert client.get("/busy42").headers["retry-after"] == "42"
    resp = client.get("/stream")
    assert resp.status_code == 200
    assert "retry-after" not in resp.headers
    assert resp.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_tenant_budgets_count_in_flight_requests_per_tenant():
    settings = _load({"tenants": {"batch": {"max_in_flight": 2}}, "default_tenant": {"max_in_flight": 1}})
    door = admission_http.FrontDoor(settings)
    assert door.enter_tenant("batch") is None
    assert door.enter_tenant("batch") is None
    refused = door.enter_tenant("batch")
    assert refused is not None
    assert refused.status == 429
    assert "'batch'" in refused.message
    assert refused.retry_after_s >= 1
    assert door.enter_tenant("someone-else") is None  # unlisted: the default budget, its own count
    assert door.enter_tenant("someone-else") is not None
    door.leave_tenant("batch")
    assert door.enter_tenant("batch") is None
    assert door.in_flight == {"batch": 2, "someone-else": 1}


def test_without_tenant_budgets_no_request_is_counted():
    admission_http.install(AdmissionSettings())
    try:
        assert admission_http.tenant_of(None) is None
    finally:
        admission_http.reset_for_tests()


def test_bad_tenant_budget_names_the_field():
    with pytest.raises(KvopsPluginError) as err:
        _load({"tenants": {"a": {"max_in_flight": 0}}})
    assert "admission.tenants.a.max_in_flight" in str(err.value)


def test_queue_gauges_are_refreshed_once_per_interval_not_per_step(monkeypatch):
    from types import SimpleNamespace

    from kvops.core.admission.policy import RequestShape

    now = [100.0]
    door = admission_http.FrontDoor(AdmissionSettings(), clock=lambda: now[0])
    config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=17, block_size=128),
        model_config=SimpleNamespace(max_model_len=1024),
    )
    states = {"r0": SimpleNamespace(prompt_len=10, max_tokens_param=10, is_prefilling=False)}
    door.check(config, [RequestShape(10, 10)], 1, states)
    walks = []
    monkeypatch.setattr(door, "queue_state", lambda policy, st: walks.append(now[0]))
    step = (SimpleNamespace(kv_cache_usage=0.1), SimpleNamespace(finished_requests=[]))
    for _ in range(50):  # 50 steps of 10 ms
        door.on_step(*step)
        now[0] += 0.01
    assert walks == [100.0]
    now[0] += admission_http.GAUGE_REFRESH_S
    door.on_step(*step)
    assert len(walks) == 2


def test_front_door_reserves_the_spec_decode_lookahead():
    from types import SimpleNamespace

    from kvops.core.admission.policy import RequestShape

    def config(lookahead: int) -> SimpleNamespace:
        return SimpleNamespace(
            cache_config=SimpleNamespace(num_gpu_blocks=17, block_size=16),
            model_config=SimpleNamespace(max_model_len=1024),
            num_lookahead_tokens=lookahead,
        )

    # 16 usable blocks of 16 tokens = 256 KV tokens; a request of 100 + 150 tokens fits exactly
    # without speculation, and not with 4 speculative tokens (+8 slots: 17 blocks).
    shape = RequestShape(100, 150)
    plain = admission_http.FrontDoor(AdmissionSettings()).check(config(0), [shape], 1, None)
    assert plain is None
    speculating = admission_http.FrontDoor(AdmissionSettings())
    refused = speculating.check(config(4), [shape], 1, None)
    assert speculating.policy_for(config(4)).budget.lookahead_tokens == 8
    assert refused is not None
    assert refused.status == 400


def test_tenant_series_stay_bounded_however_many_tenants_arrive():
    from kvops.plugin import metrics

    metrics.reset_for_tests()
    settings = _load({"tenants": {"batch": {"max_in_flight": 5}}, "tenant_labels": ["web"],
                      "default_tenant": {"max_in_flight": 1}})
    door = admission_http.FrontDoor(settings)
    for i in range(2000):
        assert door.enter_tenant(f"rotating-{i}") is None  # each its own budget, one label
    assert door.enter_tenant("web") is None
    assert door.enter_tenant("batch") is None
    registry = metrics._registry()
    series = [s for family in registry.collect() if family.name == "kvops_admission_tenant_in_flight"
              for s in family.samples]
    assert {s.labels["tenant"]: s.value for s in series} == {"other": 2000, "web": 1, "batch": 1}
    assert {s.labels["model_name"] for s in series} == {metrics.bound_model_name()}
    for i in range(2000):
        door.leave_tenant(f"rotating-{i}")
    assert registry.get_sample_value("kvops_admission_tenant_in_flight",
                                     {"model_name": metrics.bound_model_name(), "tenant": "other"}) == 0
    assert door.in_flight == {"web": 1, "batch": 1}
    metrics.reset_for_tests()


def test_a_tenant_bound_to_an_api_key_ignores_the_header():
    import hashlib

    hashed = "sha256:" + hashlib.sha256(b"key-b").hexdigest()
    settings = _load({"tenants": {"a": {"max_in_flight": 1}, "b": {"max_in_flight": 1}},
                      "default_tenant": {"max_in_flight": 1},
                      "tenant_api_keys": {"key-a": "a", hashed: "b"}})
    admission_http.install(settings)
    try:
        def request(key: str | None, header: str | None) -> object:
            headers = {}
            if key is not None:
                headers["authorization"] = f"Bearer {key}"
            if header is not None:
                headers["x-kvops-tenant"] = header
            return SimpleNamespace(headers=headers)

        assert admission_http.tenant_of(request("key-a", "b")) == "a"  # cannot spend b's budget
        assert admission_http.tenant_of(request("key-b", None)) == "b"  # hashed key
        assert admission_http.tenant_of(request("unknown", "a")) == ""  # the default pool
        assert admission_http.tenant_of(request(None, "a")) == ""
    finally:
        admission_http.reset_for_tests()


def test_settings_info_never_publishes_the_api_keys():
    """kvops_admission_settings_info's labels are every setting: the API keys bound to tenants
    appear as a count (a raw key there would be readable by anyone who can scrape /metrics)."""
    from kvops.plugin.admission.http import settings_labels

    secret = "sk-live-0123456789abcdef"
    settings = AdmissionSettings(policy="strict", tenant_api_keys={secret: "a", "sha256:" + "0" * 64: "b"})
    labels = settings_labels(settings)
    assert labels["tenant_api_keys"] == "2 keys"
    assert not any(secret in v or "0" * 64 in v for v in labels.values())
    assert settings_labels(AdmissionSettings(policy="strict"))["tenant_api_keys"] == "none"
