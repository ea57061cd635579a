"""The HTTP front door of KV-budget admission, in the API-server process.

Every completion/chat request gets a real status before any response byte is sent: 400 with the
limit when its worst-case KV could never be reserved, 429 with ``Retry-After`` when the work
accepted but not yet started is over budget, otherwise it goes on to vLLM (where the scheduler
gate, kvops.plugin.admission, starts it only when its KV reservation fits).

Why this mechanism (checked in vLLM 0.32's source):
- The decision runs right after vLLM renders the request (``render_completion_request`` /
  ``render_chat_request``, vllm/entrypoints/openai/completion/serving.py:88,
  chat_completion/serving.py:258): the prompt is tokenized there, ``n`` and ``max_tokens`` are
  known, and it is still before the streaming generator starts (a 200 is sent as soon as the
  generator is returned, serving.py:105 and api_router.py:69). Both callers return an
  ``ErrorResponse`` as-is, with its ``code`` as the HTTP status.
- ``AsyncLLM.check_admission`` (vllm/v1/engine/async_llm.py:316) only sees ``n``: no prompt, so no
  never-fits check and no KV-token budget.
- ``GracefulHTTPError``/``ErrorResponse`` carry no headers (exception_handling/error_response.py),
  so ``Retry-After`` is added by a small ASGI middleware appended to vLLM's own middlewares
  (vllm/entrypoints/launchers/app.py:54, init_entrypoints_middleware): it only rewrites the start
  message of 429 responses, so streams pass through untouched.
The queue is read from vLLM's own bookkeeping of unfinished requests
(``output_processor.request_states``, ``is_prefilling`` until the first token,
vllm/v1/engine/output_processor.py:180,743) and drained at the rate requests finish (stat-logger
``IterationStats.finished_requests``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, get_args

from kvops.core.admission.policy import (
    AdmissionPolicy,
    DrainRate,
    KVBudget,
    QueueReason,
    QueueState,
    RequestShape,
    headroom_blocks,
    queue_decision,
    retry_after_s,
    spec_decode_lookahead_tokens,
)
from kvops.core.admission.settings import AdmissionSettings
from kvops.plugin import metrics
from kvops.plugin.admission.ledger import QueueLedger, TrackedStates, track_prefill_flips

# FinishReason values that mean "ended normally" (vllm/v1/engine/__init__.py:48-66).
_NORMAL_FINISH = ("stop", "length")
GAUGE_REFRESH_S = 0.5


@dataclass(frozen=True)
class Rejection:
    status: int
    reason: str
    message: str
    retry_after_s: int = 0


class FrontDoor:
    """Admission state of one API-server process: settings, a policy copy, the drain rate."""

    def __init__(
        self, settings: AdmissionSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.drain = DrainRate()
        self.last_retry_after_s = 1
        self._clock = clock
        self._policy: AdmissionPolicy | None = None
        self._request_states: Any = None
        self._gauges_at = float("-inf")
        self.in_flight: dict[str, int] = {}
        self.by_label: dict[str, int] = {}

    def policy_for(self, vllm_config: Any) -> AdmissionPolicy:
        """Built on first use: ``num_gpu_blocks`` reaches the front end only after the engine
        handshake (vllm/v1/engine/core_client.py:850-853)."""
        if self._policy is None:
            usable = int(vllm_config.cache_config.num_gpu_blocks) - 1
            budget = KVBudget(
                usable_blocks=usable,
                block_size=int(vllm_config.cache_config.block_size),
                max_model_len=int(vllm_config.model_config.max_model_len),
                headroom_blocks=headroom_blocks(usable, self.settings.headroom_fraction),
                lookahead_tokens=spec_decode_lookahead_tokens(
                    int(getattr(vllm_config, "num_lookahead_tokens", 0))
                ),
            )
            s = self.settings
            self._policy = AdmissionPolicy(budget, s.policy, s.quantile, s.min_samples)
            _publish_settings(s, budget)
        return self._policy

    def check(
        self, vllm_config: Any, shapes: list[RequestShape], n: int, request_states: Any,
        field: str = "max_tokens", has_n: bool = True,
    ) -> Rejection | None:
        """The decision for one HTTP request (one or more prompts, each with n samples);
        ``field``/``has_n`` word the 400 in the terms of the request's API."""
        policy = self.policy_for(vllm_config)
        for shape in shapes:
            why = policy.never_fits(shape, n, self.settings.max_request_fraction, field, has_n)
            if why is not None:
                _count("rejected", "never_fits")
                return Rejection(400, "never_fits", why)
        if request_states is None:
            _count("admitted", "ok")
            return None
        self._request_states = request_states
        state = self.current_queue(policy, request_states)
        budget = self.settings.queue_budget(policy.budget.usable_tokens)
        kv_tokens = sum(policy.request_kv_tokens(s, n) for s in shapes)
        decision = queue_decision(budget, state, n * len(shapes), kv_tokens)
        metrics.gauge(
            "kvops_admission_predicted_wait_seconds",
            "Predicted wait of a request arriving now: queue ahead / drain rate (inf: no drain)",
        ).set(decision.predicted_wait_s)
        if decision.admit:
            _count("admitted", "ok")
            return None
        _count("rejected", decision.reason)
        self.last_retry_after_s = decision.retry_after_s
        return Rejection(
            429, decision.reason,
            f"KV admission: server over its {decision.reason.replace('_', ' ')} budget "
            f"({state.queued_requests} requests / {state.queued_kv_tokens} worst-case KV tokens "
            f"waiting, draining {state.drain_rps:.2f} req/s); retry after "
            f"{decision.retry_after_s} s",
            decision.retry_after_s,
        )

    def enter_tenant(self, tenant: str) -> Rejection | None:
        """Count a request of ``tenant`` in flight, or refuse it when the tenant is at its limit.
        Every admitted request must be paired with ``leave_tenant``."""
        budget = self.settings.tenant_budget(tenant)
        if budget is None:
            return None
        if self.in_flight.get(tenant, 0) >= budget.max_in_flight:
            _count("rejected", "tenant_in_flight")
            wait = retry_after_s(1.0, self.drain.rate(self._clock()), self.settings.queue_budget(0))
            self.last_retry_after_s = wait
            return Rejection(
                429, "tenant_in_flight",
                f"KV admission: tenant {tenant!r} already has {budget.max_in_flight} requests "
                f"in flight (its limit); retry after {wait} s",
                wait,
            )
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        self._label_in_flight(tenant, +1)
        return None

    def leave_tenant(self, tenant: str) -> None:
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
        self._label_in_flight(tenant, -1)

    def _label_in_flight(self, tenant: str, change: int) -> None:
        """The gauge per label (listed tenants, ``other`` for the rest): a bounded series set."""
        label = self.settings.tenant_label(tenant)
        count = max(self.by_label.get(label, 0) + change, 0)
        self.by_label[label] = count
        _tenant_gauge(label, count)

    def track(self, vllm_config: Any, owner: Any) -> Any:
        """``owner.request_states`` (vLLM's OutputProcessor), swapped once for a TrackedStates
        that keeps the ledger current, so a decision costs O(1) however many are in flight."""
        states = getattr(owner, "request_states", None)
        if states is None or isinstance(states, TrackedStates):
            return states
        from vllm.v1.engine.output_processor import RequestState

        track_prefill_flips(RequestState)
        tracked = TrackedStates(QueueLedger(self.policy_for(vllm_config)), states)
        owner.request_states = tracked
        return tracked

    def current_queue(self, policy: AdmissionPolicy, request_states: Any) -> QueueState:
        """The queue from the ledger when the states are tracked, else by walking them."""
        if isinstance(request_states, TrackedStates):
            ledger = request_states.ledger
            return self._publish(ledger.queued_requests, ledger.queued_kv_tokens,
                                 ledger.reserved_blocks)
        return self.queue_state(policy, list(request_states.values()))

    def queue_state(self, policy: AdmissionPolicy, states: Iterable[Any]) -> QueueState:
        """Requests held back by the KV budget (not merely in prefill), their worst-case KV,
        and the drain rate, by walking every state (O(in flight): the untracked fallback and
        the ledger's oracle in tests); also publishes the gauges."""
        started: list[RequestShape] = []
        pending: list[RequestShape] = []
        for st in states:  # dict order = arrival order
            shape = RequestShape(st.prompt_len, st.max_tokens_param)
            (pending if st.is_prefilling else started).append(shape)
        waiting = policy.waiting_behind_budget(started, pending)
        queued_tokens = sum(policy.request_kv_tokens(s) for s in waiting)
        reserved = sum(policy.reserve_blocks(s) for s in started)
        return self._publish(len(waiting), queued_tokens, reserved)

    def _publish(self, waiting: int, queued_tokens: int, reserved: int) -> QueueState:
        metrics.gauge(
            "kvops_admission_queued_requests", "Requests accepted and held back by the KV budget"
        ).set(waiting)
        metrics.gauge(
            "kvops_admission_queued_kv_tokens", "Worst-case KV tokens of queued requests"
        ).set(queued_tokens)
        metrics.gauge(
            "kvops_admission_reserved_blocks", "KV blocks reserved by started requests (policy)"
        ).set(reserved)
        return QueueState(waiting, queued_tokens, self.drain.rate(self._clock()))

    def on_step(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Per engine step (stat-logger ``record``): drain rate, learning, used blocks."""
        finished = getattr(iteration_stats, "finished_requests", None) or []
        if finished:
            self.drain.record(self._clock(), len(finished))
            if self._policy is not None:
                for req in finished:
                    if str(req.finish_reason) in _NORMAL_FINISH:
                        self._policy.record_finished(req.num_generation_tokens)
        if scheduler_stats is not None and self._policy is not None:
            used = scheduler_stats.kv_cache_usage * self._policy.budget.usable_blocks
            metrics.gauge("kvops_admission_used_blocks", "KV blocks in use (vLLM's usage x usable)").set(used)
            now = self._clock()
            # Untracked states are walked: once per refresh interval, not per step (at 256 in
            # flight that walk costs ~0.3 ms, kvops bench admission); the ledger is O(1).
            if self._request_states is not None and now - self._gauges_at >= GAUGE_REFRESH_S:
                self._gauges_at = now
                self.current_queue(self._policy, self._request_states)
        metrics.gauge("kvops_admission_drain_rps", "Requests finishing per second (30 s window)").set(
            self.drain.rate(self._clock())
        )


def _tenant_gauge(tenant: str, in_flight: int) -> None:
    metrics.gauge(
        "kvops_admission_tenant_in_flight", "Requests of a tenant queued or running", ("tenant",)
    ).labels(tenant=tenant).set(in_flight)


# Every (decision, reason) the front door can count. Published at 0 as soon as admission is
# configured: a rate() over a series that does not exist yet is an empty result, not 0, so the
# runbook's and KvopsAdmissionRejecting's rejected/total ratio had no value under load until the
# first 429 (staging fleet, CI of stop 20: the query was empty while KV alerts fired).
# The queue's refusals are QueueReason's (besides "ok"); the front door adds its own two.
DECISIONS: tuple[tuple[str, str], ...] = (
    ("admitted", "ok"),
    ("rejected", "never_fits"),
    *(("rejected", reason) for reason in get_args(QueueReason) if reason != "ok"),
    ("rejected", "tenant_in_flight"),
)


def publish_decisions() -> None:
    """Every DECISIONS series at 0, from the API server's start (wiring.install_in_api_server,
    after the model name is bound): published only on the first request, a replica too busy to
    answer its scrapes under load had no two samples of them, and the rejected/total rate stayed
    empty for the whole incident (staging fleet, CI of 2026-12-04)."""
    for decision, reason in DECISIONS:
        _decisions().labels(decision=decision, reason=reason)  # the series, at 0


def _decisions() -> Any:
    return metrics.counter(
        "kvops_admission_decisions", "Front-door admission decisions", ("decision", "reason")
    )


def _count(decision: str, reason: str) -> None:
    _decisions().labels(decision=decision, reason=reason).inc()


# Label names Prometheus reserves or gives a meaning (`promtool check metrics` refuses a gauge
# carrying `quantile`, the summary label): the setting is published under another name.
_RESERVED_LABELS = {"quantile": "output_quantile", "le": "output_le"}


# Settings that are secrets: /metrics publishes how many there are, never their values.
_SECRET_SETTINGS = ("tenant_api_keys",)


def settings_labels(settings: AdmissionSettings) -> dict[str, str]:
    """The settings as label values; secrets (API keys bound to tenants) as their count."""
    dump = settings.model_dump()
    for name in _SECRET_SETTINGS:
        value = dump.get(name)
        dump[name] = "none" if value is None else f"{len(value)} keys"
    return {_RESERVED_LABELS.get(k, k): str(v) for k, v in dump.items()}


def _publish_settings(settings: AdmissionSettings, budget: KVBudget) -> None:
    labels = settings_labels(settings)
    publish_decisions()
    metrics.gauge(
        "kvops_admission_settings_info", "KV admission settings in use (value is always 1)",
        tuple(labels),
    ).labels(**labels).set(1)
    metrics.gauge("kvops_admission_usable_blocks", "KV blocks admission budgets with").set(
        budget.usable_blocks
    )
    metrics.gauge("kvops_admission_headroom_blocks", "KV blocks kept free beyond reservations").set(
        budget.headroom_blocks
    )


# -- the per-process singleton -----------------------------------------------------------------

_DOOR: FrontDoor | None = None


def install(settings: AdmissionSettings) -> FrontDoor:
    global _DOOR
    if _DOOR is None or _DOOR.settings != settings:
        _DOOR = FrontDoor(settings)
    return _DOOR


def door() -> FrontDoor | None:
    return _DOOR


def reset_for_tests() -> None:
    global _DOOR
    _DOOR = None


# -- the vLLM-facing edges (installed by kvops.plugin._compat) ---------------------------------


# Where each API takes its output limit: chat prefers max_completion_tokens over the deprecated
# max_tokens (chat protocol.py:658); responses has max_output_tokens (responses/protocol.py:238).
_MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")


def max_tokens_field(request: Any) -> str:
    """The field that limits this request's output: its value is the limit, its name goes in the 400."""
    return next((f for f in _MAX_TOKENS_FIELDS if getattr(request, f, None) is not None),
                "max_output_tokens" if hasattr(request, "max_output_tokens") else "max_tokens")


def decide(serving: Any, request: Any, engine_inputs: list[Any]) -> Any | None:
    """An ErrorResponse for vLLM to return as-is, or None to let the request through."""
    exc = rejection_error(serving, request, engine_inputs)
    return None if exc is None else serving.create_error_response(exc)


def rejection_error(serving: Any, request: Any, engine_inputs: list[Any],
                    max_tokens: int | None = None) -> Exception | None:
    """vLLM's own exception for a refusal (VLLMValidationError: 400, GracefulHTTPError: its
    status), or None. ``max_tokens`` stands in for routes whose request has no output limit
    field (generative scoring generates exactly one token)."""
    field = max_tokens_field(request)
    if max_tokens is None:
        max_tokens = getattr(request, field, None)
    prompt_lens = [serving._extract_prompt_len(ei) for ei in engine_inputs]
    n = int(getattr(request, "n", None) or 1)  # the responses API has no n
    return _refusal(serving, prompt_lens, max_tokens, n, field, hasattr(request, "n"))


def token_ids_error(serving: Any, request: Any) -> Exception | None:
    """The same decision for /inference/v1/generate, whose request carries its prompt as token
    ids and its limits in ``sampling_params`` (scale_out/token_in_token_out/protocol.py)."""
    params = request.sampling_params
    provided = request.is_sampling_param_provided("max_tokens")
    return _refusal(serving, [len(request.token_ids)], params.max_tokens if provided else None,
                    int(params.n or 1), "sampling_params.max_tokens", True)


def _refusal(serving: Any, prompt_lens: list[int], max_tokens: int | None, n: int, field: str,
             has_n: bool) -> Exception | None:
    front = _DOOR
    if front is None:
        return None
    shapes = [RequestShape(length, max_tokens) for length in prompt_lens]
    engine = serving.engine_client
    states = front.track(engine.vllm_config, getattr(engine, "output_processor", None))
    rejection = front.check(engine.vllm_config, shapes, n, states, field, has_n)
    if rejection is None:
        return None
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError, VLLMValidationError

    exc: Exception
    if rejection.status == 400:
        exc = VLLMValidationError(rejection.message, parameter=field)
    else:
        exc = GracefulHTTPError(rejection.message, HTTPStatus(rejection.status))
    return exc


def tenant_of(raw_request: Any) -> str | None:
    """The tenant a request counts against, or None when no per-tenant budget applies."""
    front = _DOOR
    if front is None or (not front.settings.tenants and front.settings.default_tenant is None):
        return None
    headers = getattr(raw_request, "headers", None)
    settings = front.settings
    if settings.tenant_api_keys is not None:
        tenant = settings.tenant_for_key(_bearer(headers))
    else:
        tenant = headers.get(settings.tenant_header, "") if headers is not None else ""
    return tenant if settings.tenant_budget(tenant) is not None else None


def _bearer(headers: Any) -> str | None:
    value = headers.get("authorization", "") if headers is not None else ""
    scheme, _, key = value.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


async def with_tenant(serving: Any, raw_request: Any, call: Callable[[], Awaitable[Any]]) -> Any:
    """Run one create_* call of vLLM's serving classes inside the tenant's in-flight budget.

    The slot is held until the response is complete: for a stream, until its generator is
    exhausted or closed (a client that hangs up closes it, vllm/entrypoints/utils.py
    with_cancellation)."""
    tenant = tenant_of(raw_request)
    front = _DOOR
    if tenant is None or front is None:
        return await call()
    rejection = front.enter_tenant(tenant)
    if rejection is not None:
        from http import HTTPStatus

        from vllm.exceptions import GracefulHTTPError

        return serving.create_error_response(
            GracefulHTTPError(rejection.message, HTTPStatus.TOO_MANY_REQUESTS)
        )
    try:
        result = await call()
    except BaseException:
        front.leave_tenant(tenant)
        raise
    if hasattr(result, "__aiter__"):
        return _leave_when_done(result, front, tenant)
    front.leave_tenant(tenant)
    return result


async def _leave_when_done(stream: Any, front: FrontDoor, tenant: str) -> Any:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        front.leave_tenant(tenant)


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class RetryAfterMiddleware:
    """Adds ``Retry-After`` to 429 responses that lack one (pure ASGI: streams are untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry_after(message: Any) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 429:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    seconds = _DOOR.last_retry_after_s if _DOOR is not None else 1
                    headers.append((b"retry-after", str(seconds).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)
