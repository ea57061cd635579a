"""Which POST routes of vLLM 0.32's API server create engine requests, and which of them the
admission front door guards: checked against the app's own route list at start-up, so a route
vLLM adds (or an endpoint plugin brings) cannot bypass the 400/429/tenant limits unnoticed.

Checked in vLLM 0.32's routers (vllm/entrypoints/**/api_router.py): /v1/messages renders and
generates through OpenAIServingChat.create_chat_completion, and /invocations (SageMaker)
dispatches to the other handlers, so both pass the hooks of the routes they reach.
"""

from __future__ import annotations

from typing import Any

GUARDED = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
    "/v1/messages", "/invocations", "/generative_scoring", "/inference/v1/generate",
})
"""KV check (400/429) and tenant budget on each."""
TENANT_ONLY = frozenset({"/v1/systemone"})
"""Structured decisions render their prompts inside vLLM's strategy objects (several reads per
request, max_tokens 1-2): the tenant budget applies, the KV check does not."""
NOT_GENERATING = frozenset({
    "/tokenize", "/detokenize", "/ping", "/v1/messages/count_tokens",
    "/v1/responses/{response_id}/cancel", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc",
    "/sleep", "/wake_up", "/release_kv_cache_memory", "/start_profile", "/stop_profile",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume", "/abort_requests",
    "/inference/v1/abort_requests", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_checker",
    "/fault_tolerance/apply", "/v1/chat/completions/render", "/v1/completions/render",
    "/v1/messages/render", "/v1/responses/render", "/v1/chat/completions/derender",
    "/v1/completions/derender",
    # Pooling models: prompt-only requests (no decode), not what KV admission budgets.
    "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
    "/v1/embeddings", "/v2/embed",
})
"""Every other POST route vLLM 0.32 registers (all its api_router modules, listed)."""
KVOPS_OWN = frozenset({"/kvops/offload/check"})
"""kvops's own routes: the offload load-path canary sends two one-token requests of one chunk."""
GENERATING_UNGUARDED = frozenset({
    "/v1/audio/transcriptions", "/v1/audio/translations",  # speech-to-text models
})
"""Generation routes vLLM 0.32 can serve that the front door does not wrap yet: logged like an
unknown route when the app serves them."""


def post_paths(app: Any) -> list[str]:
    """The app's POST route paths, in registration order."""
    return [route.path for route in getattr(app, "routes", ())
            if "POST" in (getattr(route, "methods", None) or ())]


def unguarded(paths: list[str]) -> list[str]:
    """POST routes kvops does not know: they may create requests outside the front door."""
    known = GUARDED | TENANT_ONLY | NOT_GENERATING | KVOPS_OWN  # GENERATING_UNGUARDED is not "known"
    return [path for path in paths if path not in known]


def audit_app(app: Any, log: Any) -> list[str]:
    """Log loudly (ERROR) each POST route that may bypass admission; returns them."""
    unknown = unguarded(post_paths(app))
    for path in unknown:
        log.error("kvops admission: POST %s is a route kvops does not know; requests it creates "
                  "bypass the KV front door (no 400/429, no tenant limit). Report it, or put "
                  "the route behind a gateway limit", path)
    return unknown
