"""An OpenAI-compatible streaming Locust user that measures TTFT and ITL correctly.

Measuring traps it avoids (research/loadgen_bench.md):

* FastHttpUser's ``iter_lines``/``iter_content`` wait for 1 KiB before returning, so TTFT
  would be "time to the ~5th token". We read the raw geventhttpclient response with
  ``readline(b"\\n")`` instead, one SSE line per read (``_response`` is private API of
  locust/contrib/fasthttp.py ``FastResponse``; pinned by the test with a pausing server).
* Locust's ``stream=True`` response time is time-to-headers; we overwrite it with the full
  request time before the request event fires.
* SSE is asked for uncompressed (``Accept-Encoding: identity``): gzip buffers events.
* TTFT is stamped at the first event with content/reasoning, not the role chunk.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from gevent import GreenletExit
from locust import FastHttpUser

from kvops.loadtest.hooks.endpoint import endpoint_of
from kvops.loadtest.hooks.store import store_of
from kvops.loadtest.records import RequestRecord
from kvops.loadtest.sse import parse_line, usage_counts

STREAM_HEADERS = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
_ids = itertools.count()


TEMPLATE_KEYS = ("tools", "chat_template", "chat_template_kwargs", "documents",
                 "add_generation_prompt", "continue_final_message")
"""Chat body fields vLLM's chat template renders into the prompt beside the messages (and its
/tokenize takes the same: vllm/entrypoints/serve/tokenize/protocol.py TokenizeChatRequest)."""


def template_inputs(body: dict[str, Any]) -> dict[str, Any] | None:
    found = {k: body[k] for k in TEMPLATE_KEYS if body.get(k) is not None}
    return found or None


class OpenAIStreamUser(FastHttpUser):
    """Base user: subclasses build request bodies and call ``stream()``."""

    abstract = True
    connection_timeout = 30.0
    network_timeout = 600.0

    def stream(self, body: dict[str, Any], *, phase: str = "measure", group: str | None = None,
               scheduled_at: float | None = None, shared_text: str | None = None) -> RequestRecord:
        """Send one streaming request, record it, and report it to Locust; returns the record."""
        kind = "chat" if "messages" in body else "completions"
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        store = store_of(self.environment)
        record = RequestRecord(
            request_id=f"{os.getpid()}-{next(_ids)}", kind=kind, sent_at=time.time(),
            worker=store.worker, scenario=store.scenario, phase=phase, group=group,
            users=self.environment.runner.user_count if self.environment.runner else 0,
            scheduled_at=scheduled_at, prompt=body.get("prompt", body.get("messages")),
            shared_text=shared_text, template=template_inputs(body) if kind == "chat" else None,
        )
        if scheduled_at is not None:
            record.lateness_s = max(0.0, record.sent_at - scheduled_at)
        start = time.perf_counter()
        try:
            self._send(payload, kind, record, start)
        except GreenletExit:
            # the run ended with this request in flight: keep it, marked, then let the user die
            record.stopped = True
            record.e2e_s = time.perf_counter() - start
            record.error = "stopped by the load generator while in flight"
            store.add(record)
            raise
        if record.ttft_s is not None:
            self.environment.events.request.fire(
                request_type="TTFT", name=kind, response_time=record.ttft_s * 1000.0,
                response_length=0, exception=None, context={},
            )
        store.add(record)
        return record

    def _send(self, payload: dict[str, Any], kind: str, record: RequestRecord, start: float) -> None:
        with self.client.post(f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}",
                              json=payload, stream=True, catch_response=True,
                              headers=self._headers(), name=kind) as resp:
            record.headers_s = time.perf_counter() - start
            record.status = resp.status_code or 0
            if record.status == 200:
                self._read_events(resp, record, start)
            else:
                record.error = f"HTTP {record.status}: {(resp.text or '')[:200]}"
            record.e2e_s = time.perf_counter() - start
            resp.request_meta["response_time"] = record.e2e_s * 1000.0
            resp.request_meta["response_length"] = record.completion_tokens or 0
            # a stream that ended with tokens but no visible text (the detokenizer held partial
            # UTF-8 back to the end) succeeded; it just has no first-text time
            produced = record.ttft_s is not None or (
                record.first_event_s is not None and bool(record.completion_tokens))
            record.ok = record.error is None and produced
            if record.ok:
                resp.success()
            else:
                resp.failure(record.error or "no token in the stream")

    def _headers(self) -> dict[str, str]:
        """The stream's own headers after the server's (API key, proxy): ours must win."""
        return {**endpoint_of(self.environment).header_dict(), **STREAM_HEADERS}

    @staticmethod
    def _read_events(resp: Any, record: RequestRecord, start: float) -> None:
        raw = resp._response  # geventhttpclient response: readline(sep) reads no further than sep
        last: float | None = None
        while True:
            try:
                line = raw.readline(b"\n")
            except Exception as exc:  # noqa: BLE001 - any socket failure ends this request
                record.error = f"stream broken: {type(exc).__name__}: {exc}"
                return
            if not line:
                break
            now = time.perf_counter()
            event = parse_line(line)
            if event is None:
                continue
            if event.error:
                record.error = event.error
                continue
            if event.has_choices and record.first_event_s is None:
                record.first_event_s = now - start
            if event.has_output:
                record.content_events += 1
                if record.ttft_s is None:
                    record.ttft_s = now - start
                elif last is not None:
                    record.itl_s.append(now - last)
                last = now
            if event.usage:
                record.prompt_tokens, record.completion_tokens, record.cached_tokens = (
                    usage_counts(event.usage))
