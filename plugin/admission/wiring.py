"""Switching KV-budget admission on, from the front-end config hook (kvops.plugin.hooks).

Decision on ``--scheduler-cls``: when the user gave none, we set ours (the sync or async variant
matching ``scheduler_config.async_scheduling``, which is final here: this runs after the
platform's ``check_and_update_config``, vllm/config/vllm.py:1991, and the CPU platform forces
async off there, vllm/platforms/cpu.py:329-331). When the user gave another class we refuse to
start: silently replacing a custom scheduler, or running admission without its gate, would both
be wrong. The front door (kvops.plugin.admission.http) is installed in this process, which is
the API server for ``vllm serve``.
"""

from __future__ import annotations

from typing import Any

from kvops.core.admission.settings import SCHEDULER_CLASSES, AdmissionSettings
from kvops.core.errors import KvopsPluginError

_WRAPPED_MARK = "_kvops_admission_wrapped"


def configure(vllm_config: Any, settings: AdmissionSettings) -> None:
    if not settings.enabled:
        return
    scheduler_config = vllm_config.scheduler_config
    wanted = SCHEDULER_CLASSES[bool(scheduler_config.async_scheduling)]
    given = scheduler_config.scheduler_cls
    given_name = given if isinstance(given, str) or given is None else f"{given.__module__}.{given.__qualname__}"
    if given_name is None:
        scheduler_config.scheduler_cls = wanted
    elif given_name != wanted:
        mode = "on" if scheduler_config.async_scheduling else "off"
        raise KvopsPluginError(
            f"kvops admission needs --scheduler-cls {wanted} (async scheduling is {mode}), "
            f"got {given_name}: drop --scheduler-cls to let kvops set it, or set "
            '{"kvops": {"admission": {"policy": "off"}}}'
        )
    warning = api_servers_warning(api_process_count(vllm_config))
    if warning is not None:
        from kvops.plugin._compat import plugin_logger

        plugin_logger().warning(warning)
    from kvops.plugin.admission import http as admission_http

    admission_http.install(settings)
    install_front_door_hooks()


def api_process_count(vllm_config: Any) -> int:
    """``--api-server-count`` as vLLM hands it to the config (vllm/entrypoints/cli/serve.py:309
    sets ``engine_args._api_process_count`` before create_engine_config; no public accessor)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "_api_process_count", 1) or 1)


def api_servers_warning(count: int) -> str | None:
    """What goes wrong with more than one API-server process: each one has its own front door
    (the request bookkeeping it reads is per process, vllm/v1/engine/output_processor.py), so
    the 429 budgets hold per process. The engine's KV gate and the never-fits 400 are exact."""
    if count <= 1:
        return None
    return (
        f"kvops admission with --api-server-count {count}: each API-server process counts only "
        f"its own requests, so the 429 budgets (max_queued_requests, max_queued_kv_fraction, "
        f"max_queue_wait_s, tenant max_in_flight) hold per process, up to {count}x in total, and "
        f"Retry-After sees 1/{count} of the drain; the KV gate in the engine and the never-fits "
        f"400 stay exact. Divide those budgets by {count}, or run --api-server-count 1"
    )


def install_front_door_hooks() -> None:
    """Wrap vLLM's render step of completions, chat and responses, and add the Retry-After
    middleware."""
    from vllm.entrypoints.launchers import app as app_module
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    # vllm/entrypoints/openai/completion/serving.py:88 returns list[EngineInput] | ErrorResponse.
    _wrap_render(OpenAIServingCompletion, "render_completion_request", lambda result: result)
    # vllm/entrypoints/openai/chat_completion/serving.py:258 returns (conversation, inputs).
    _wrap_render(OpenAIServingChat, "render_chat_request", lambda result: result[1])
    # vllm/entrypoints/openai/responses/serving.py:285 returns one ResponsesRenderResult (later
    # turns of a tool-calling response render elsewhere: they continue an admitted request).
    _wrap_render(
        OpenAIServingResponses, "_render_resolved_response_inputs",
        lambda result: [result.engine_input],
    )
    # The outer create_* calls see the raw request (tenant header) and span the whole response
    # (vllm/entrypoints/openai/completion/serving.py:109, chat_completion/serving.py:281).
    _wrap_create(OpenAIServingCompletion, "create_completion")
    _wrap_create(OpenAIServingChat, "create_chat_completion")
    _wrap_create(OpenAIServingResponses, "create_responses")
    _wrap_other_generation_routes()
    # vllm/entrypoints/launchers/app.py:54: build_app looks this name up in its module at call
    # time, after attach_endpoint_plugins, so what we add here is the outermost middleware.
    original = app_module.init_entrypoints_middleware
    if getattr(original, _WRAPPED_MARK, False):
        return

    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
        from kvops.plugin.admission.http import RetryAfterMiddleware

        result = original(args, app, *rest, **kwargs)
        app.add_middleware(RetryAfterMiddleware)
        from kvops.plugin._compat import plugin_logger
        from kvops.plugin.admission.routes import audit_app

        audit_app(app, plugin_logger())  # routes are all attached by now (app.py:45-54)
        return result

    setattr(init_entrypoints_middleware, _WRAPPED_MARK, True)
    app_module.init_entrypoints_middleware = init_entrypoints_middleware


def _wrap_other_generation_routes() -> None:
    """/v1/chat/completions/batch (on by default for generate models), /inference/v1/generate,
    /generative_scoring and /v1/systemone: each creates engine requests without passing the
    chat/completion hooks."""
    from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch

    # batch_serving.py render_batch_chat_request returns (requests, conversations, inputs).
    _wrap_render(OpenAIServingChatBatch, "render_batch_chat_request", lambda result: result[2])
    _wrap_create(OpenAIServingChatBatch, "create_batch_chat_completion")
    try:
        from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    except ImportError:
        pass
    else:
        _wrap_token_route(ServingTokens)
    try:
        from vllm.entrypoints.generate.generative_scoring.serving import ServingGenerativeScoring
        from vllm.entrypoints.generate.structured_decisions.serving import (
            ServingStructuredDecisions,
        )
    except ImportError:  # optional features of this vLLM build
        return
    _wrap_scoring_prompts(ServingGenerativeScoring)
    _wrap_create(ServingGenerativeScoring, "create_generative_scoring")
    _wrap_create(ServingStructuredDecisions, "create_decision")


def _wrap_token_route(cls: type) -> None:
    """/inference/v1/generate (scale_out/token_in_token_out/serving.py ``serve_tokens``): the
    prompt arrives as token ids, so the decision runs before vLLM's own work, inside the
    tenant's slot."""
    original = cls.serve_tokens  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED_MARK, False):
        return

    async def serve_tokens(self: Any, request: Any, raw_request: Any = None, *args: Any,
                           **kwargs: Any) -> Any:
        from kvops.plugin.admission.http import token_ids_error, with_tenant

        async def checked() -> Any:
            exc = token_ids_error(self, request)
            if exc is not None:
                return self.create_error_response(exc)
            return await original(self, request, raw_request, *args, **kwargs)

        return await with_tenant(self, raw_request, checked)

    setattr(serve_tokens, _WRAPPED_MARK, True)
    cls.serve_tokens = serve_tokens  # type: ignore[attr-defined]


def _wrap_scoring_prompts(cls: type) -> None:
    """generative_scoring/serving.py ``_build_prompts`` returns (engine inputs, token counts)
    and its caller wants exactly that, so a refusal is raised: the app's VLLMError handler
    answers it with its status (exception_handling/register.py), 400 or 429."""
    original = cls._build_prompts  # type: ignore[attr-defined]
    if getattr(original, _WRAPPED_MARK, False):
        return

    async def build_prompts(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from kvops.plugin.admission.http import rejection_error

        result = await original(self, request, *args, **kwargs)
        exc = rejection_error(self, request, list(result[0]), max_tokens=1)
        if exc is not None:
            raise exc
        return result

    setattr(build_prompts, _WRAPPED_MARK, True)
    cls._build_prompts = build_prompts  # type: ignore[attr-defined]


def _wrap_create(cls: type, name: str) -> None:
    original = getattr(cls, name)
    if getattr(original, _WRAPPED_MARK, False):
        return

    async def create(self: Any, request: Any, raw_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        from kvops.plugin.admission.http import with_tenant

        return await with_tenant(
            self, raw_request, lambda: original(self, request, raw_request, *args, **kwargs)
        )

    setattr(create, _WRAPPED_MARK, True)
    setattr(cls, name, create)


def _wrap_render(cls: type, name: str, inputs_of: Any) -> None:
    original = getattr(cls, name)
    if getattr(original, _WRAPPED_MARK, False):
        return

    async def render(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from kvops.plugin.admission.http import decide

        result = await original(self, request, *args, **kwargs)
        if isinstance(result, ErrorResponse):
            return result
        rejection = decide(self, request, list(inputs_of(result)))
        return result if rejection is None else rejection

    setattr(render, _WRAPPED_MARK, True)
    setattr(cls, name, render)


def install_in_api_server(vllm_config: Any, settings: AdmissionSettings | None) -> None:
    """From the stat logger (built by AsyncLLM in every API-server process, also with
    --api-server-count > 1 where the config hook ran elsewhere): make sure the door is here."""
    if settings is None or not settings.enabled:
        return
    from kvops.plugin.admission import http as admission_http

    admission_http.install(settings)
    admission_http.publish_decisions()
    install_front_door_hooks()
