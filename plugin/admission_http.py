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
from typing import Any

from kvops.plugin import metrics
from kvops.plugin.admission_policy import (
    AdmissionPolicy,
    DrainRate,
    KVBudget,
    QueueState,
    RequestShape,
    headroom_blocks,
    queue_decision,
    retry_after_s,
    spec_decode_lookahead_tokens,
)
from kvops.plugin.admission_settings import AdmissionSettings

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
        state = self.queue_state(policy, request_states.values())
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
        _tenant_gauge(tenant, self.in_flight[tenant])
        return None

    def leave_tenant(self, tenant: str) -> None:
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
        _tenant_gauge(tenant, max(left, 0))

    def queue_state(self, policy: AdmissionPolicy, states: Iterable[Any]) -> QueueState:
        """Requests held back by the KV budget (not merely in prefill), their worst-case KV,
        and the drain rate; also publishes the gauges."""
        started: list[RequestShape] = []
        pending: list[RequestShape] = []
        for st in states:  # dict order = arrival order
            shape = RequestShape(st.prompt_len, st.max_tokens_param)
            (pending if st.is_prefilling else started).append(shape)
        waiting = policy.waiting_behind_budget(started, pending)
        queued_tokens = sum(policy.request_kv_tokens(s) for s in waiting)
        reserved = sum(policy.reserve_blocks(s) for s in started)
        metrics.gauge(
            "kvops_admission_queued_requests", "Requests accepted and held back by the KV budget"
        ).set(len(waiting))
        metrics.gauge(
            "kvops_admission_queued_kv_tokens", "Worst-case KV tokens of queued requests"
        ).set(queued_tokens)
        metrics.gauge(
            "kvops_admission_reserved_blocks", "KV blocks reserved by started requests (policy)"
        ).set(reserved)
        return QueueState(len(waiting), queued_tokens, self.drain.rate(self._clock()))

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
            # The queue gauges walk every unfinished request: once per refresh interval, not per
            # step (at 256 in flight that walk costs ~0.3 ms, kvops bench admission).
            if self._request_states is not None and now - self._gauges_at >= GAUGE_REFRESH_S:
                self._gauges_at = now
                self.queue_state(self._policy, list(self._request_states.values()))
        metrics.gauge("kvops_admission_drain_rps", "Requests finishing per second (30 s window)").set(
            self.drain.rate(self._clock())
        )


def _tenant_gauge(tenant: str, in_flight: int) -> None:
    metrics.gauge(
        "kvops_admission_tenant_in_flight", "Requests of a tenant queued or running", ("tenant",)
    ).labels(tenant=tenant).set(in_flight)


def _count(decision: str, reason: str) -> None:
    metrics.counter(
        "kvops_admission_decisions", "Front-door admission decisions", ("decision", "reason")
    ).labels(decision=decision, reason=reason).inc()


def _publish_settings(settings: AdmissionSettings, budget: KVBudget) -> None:
    labels = {k: str(v) for k, v in settings.model_dump().items()}
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
    front = _DOOR
    if front is None:
        return None
    field = max_tokens_field(request)
    max_tokens = getattr(request, field, None)
    shapes = [RequestShape(serving._extract_prompt_len(ei), max_tokens) for ei in engine_inputs]
    engine = serving.engine_client
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    n = int(getattr(request, "n", None) or 1)  # the responses API has no n
    rejection = front.check(engine.vllm_config, shapes, n, states, field, hasattr(request, "n"))
    if rejection is None:
        return None
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError, VLLMValidationError

    exc: Exception
    if rejection.status == 400:
        exc = VLLMValidationError(rejection.message, parameter=field)
    else:
        exc = GracefulHTTPError(rejection.message, HTTPStatus(rejection.status))
    return serving.create_error_response(exc)


def tenant_of(raw_request: Any) -> str | None:
    """The tenant a request counts against, or None when no per-tenant budget applies."""
    front = _DOOR
    if front is None or (not front.settings.tenants and front.settings.default_tenant is None):
        return None
    headers = getattr(raw_request, "headers", None)
    tenant = headers.get(front.settings.tenant_header, "") if headers is not None else ""
    return tenant if front.settings.tenant_budget(tenant) is not None else None


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
