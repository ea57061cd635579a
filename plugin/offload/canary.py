"""The load-path canary in the front end: two one-token requests through vLLM's own engine
client, judged by kvops.core.offload.canary, published as gauges and on ``POST /kvops/offload/check``.

It runs on the API server's event loop (the engine client's outputs are delivered there): the
first canary when the app's lifespan starts (after ``init_app_state``, so the engine is up, and
before the server accepts requests), then a periodic task, and the route for
``kvops offload check``. One canary at a time (a lock); the worker's
reports for canary loads reach this process through the connector stats (prom.py feeds TALLY).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

from kvops.core.offload.canary import (
    CANARY_REQUEST_PREFIX,
    REPORT_KEYS,
    CanaryOutcome,
    CanaryResult,
    canary_length,
    canary_tokens,
    judge,
    local_share,
)
from kvops.core.offload.settings import OffloadSettings

try:  # FastAPI resolves the route's annotations from this module's globals
    from fastapi import Request
except ImportError:  # pragma: no cover - vLLM's API server always has FastAPI
    Request = Any  # type: ignore[misc, assignment]

logger = logging.getLogger("vllm.plugins.kvops.offload")

CHECK_PATH = "/kvops/offload/check"
STORE_WAIT_S = 20.0
"""How long the canary reads the prefix again while LMCache's asynchronous store lands."""
READ_EVERY_S = 0.5
REPORT_WAIT_S = 10.0
"""How long it waits for the worker's report of the canary's load (stats flow every step)."""


class _Tally:
    """Worker reports for canary loads, summed since the last reset (thread-safe: vLLM records
    stats from its output handler)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reports: dict[str, int]) -> None:
        with self._lock:
            for key, count in reports.items():
                self._counts[key] = self._counts.get(key, 0) + count

    def reset(self) -> None:
        with self._lock:
            self._counts = {}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


TALLY = _Tally()


class Canary:
    """Runs canaries against one engine client and publishes the last verdict."""

    def __init__(self, settings: OffloadSettings) -> None:
        self.settings = settings
        self.lock = asyncio.Lock()
        self.last: CanaryResult | None = None

    async def check(self, engine: Any) -> CanaryResult:
        async with self.lock:
            TALLY.reset()
            outcome = await self._run(engine)
            result = judge(outcome, time.time())
            publish(result)
            self.last = result
            log = logger.info if result.ok else logger.error
            log("kvops offload load-path canary %s: %s", "ok" if result.ok else "FAILED",
                result.reason)
            return result

    async def _run(self, engine: Any) -> CanaryOutcome:
        config = engine.vllm_config
        block = int(config.cache_config.block_size)
        length = canary_length(self.settings.chunk_size, block)
        prompt = {"prompt_token_ids": canary_tokens(length, config.model_config.get_vocab_size())}
        stored_tokens, stored_cached = await _generate(engine, prompt)
        share = local_share(length, block)
        deadline = time.monotonic() + STORE_WAIT_S
        while True:
            tokens, cached = await _generate(engine, prompt)
            if cached > share or time.monotonic() > deadline:
                break
            await asyncio.sleep(READ_EVERY_S)
        stats = bool(getattr(engine, "log_stats", True))
        if cached > share and stats:
            await _wait_for_report()
        return CanaryOutcome(length, block, stored_cached, cached, tokens == stored_tokens,
                             {key: n for key, n in TALLY.snapshot().items() if key in REPORT_KEYS},
                             stats)


async def _generate(engine: Any, prompt: dict[str, Any]) -> tuple[list[int], int]:
    """(greedy output token ids, cached prompt tokens) of one canary request."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    final = None
    async for output in engine.generate(prompt, params, CANARY_REQUEST_PREFIX + uuid.uuid4().hex):
        final = output
    if final is None:
        raise RuntimeError("the engine returned no output for a canary request")
    return list(final.outputs[0].token_ids), int(final.num_cached_tokens or 0)


async def _wait_for_report() -> None:
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline and not TALLY.snapshot():
        await asyncio.sleep(0.1)


def publish(result: CanaryResult) -> None:
    from kvops.plugin.metrics import gauge

    gauge("kvops_offload_load_path_ok",
          "1 when the last load-path canary loaded its prefix back through the connector intact"
          ).set(1 if result.ok else 0)
    gauge("kvops_offload_load_path_last_check_timestamp_seconds",
          "Unix time of the last load-path canary").set(result.checked_at)


STARTUP_LIMIT_S = 60.0
"""The start-up canary never holds the server back longer than this (a stuck engine)."""


async def check_guarded(canary: Canary, app: Any, limit_s: float | None = None) -> None:
    """One canary that never raises: a fault is counted and logged, the server goes on."""
    from kvops.plugin.loops import count_internal_error

    engine = getattr(app.state, "engine_client", None)
    if engine is None:
        return
    try:
        await asyncio.wait_for(canary.check(engine), limit_s)
    except Exception as exc:  # noqa: BLE001 - the server outlives a failing canary
        count_internal_error("offload_canary")
        logger.error("kvops offload load-path canary could not run (%s: %s)",
                     type(exc).__name__, exc)


async def periodic(canary: Canary, app: Any) -> None:
    """A canary every canary_interval_s after the start-up one."""
    while True:
        await asyncio.sleep(canary.settings.canary_interval_s)
        await check_guarded(canary, app)


class CanaryMiddleware:
    """Runs the first canary when the app's lifespan starts, before the server accepts requests
    (so it never lands among user requests a start-up test counts), then starts the periodic one.
    Pure ASGI: every other scope passes through untouched."""

    def __init__(self, app: Any, canary: Canary) -> None:
        self.app = app
        self.canary = canary
        self.task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan" or self.canary.settings.canary_interval_s <= 0:
            await self.app(scope, receive, send)
            return
        app = scope["app"]

        async def receive_after_canary() -> Any:
            message = await receive()
            if message.get("type") == "lifespan.startup" and self.task is None:
                await check_guarded(self.canary, app, STARTUP_LIMIT_S)
                self.task = asyncio.get_running_loop().create_task(periodic(self.canary, app))
            return message

        await self.app(scope, receive_after_canary, send)


_INSTALLED: list[OffloadSettings] = []


def install(settings: OffloadSettings) -> None:
    """Add the check route and the periodic canary to the API server vLLM is about to build
    (wraps the module-level name build_app calls, vllm/entrypoints/launchers/app.py:54)."""
    if _INSTALLED:
        _INSTALLED[0] = settings
        return
    _INSTALLED.append(settings)
    from vllm.entrypoints.launchers import app as app_module

    original = app_module.init_entrypoints_middleware

    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
        result = original(args, app, *rest, **kwargs)
        add_to_app(app, Canary(_INSTALLED[0]))
        return result

    app_module.init_entrypoints_middleware = init_entrypoints_middleware


def add_to_app(app: Any, canary: Canary) -> None:
    from fastapi.responses import JSONResponse

    async def check(request: Request) -> JSONResponse:
        engine = getattr(request.app.state, "engine_client", None)
        if engine is None:
            return JSONResponse({"error": "no engine behind this server"}, status_code=503)
        result = await canary.check(engine)
        return JSONResponse(result.as_json())

    app.add_api_route(CHECK_PATH, check, methods=["POST"])
    app.add_middleware(CanaryMiddleware, canary=canary)
