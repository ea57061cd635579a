"""A minimal OpenAI-style SSE server, for measuring the load generator rather than vLLM.

``python -m kvops.ops.bench.fake_sse PORT [EVENTS] [PACE_MS] [TEXT]``: every completion streams
EVENTS token events (each with TEXT, default " tok") of ~230 bytes (the size of a vLLM completion event) PACE_MS apart, so each event
arrives in its own read, as from a real server (research/loadgen_bench.md used the same idea).
It runs on gevent's WSGI server (one greenlet per connection, no thread per request), so that
on a shared machine the load generator, not this server, is what runs out first.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

EVENT = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
         "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None,
                      "stop_reason": None, "token_ids": None, "prompt_logprobs": None}]}


def app(events: int, pace_s: float, text: str = " tok") -> Callable[..., Any]:
    import gevent

    event = {**EVENT, "choices": [{**EVENT["choices"][0], "text": text}]}  # type: ignore[index]
    token = b"data: " + json.dumps(event).encode() + b"\n\n"
    usage = b"data: " + json.dumps({"id": "cmpl-fake", "choices": [], "usage": {
        "prompt_tokens": 8, "completion_tokens": events, "total_tokens": 8 + events}}).encode() + b"\n\n"
    models = json.dumps({"data": [{"id": "fake"}]}).encode()

    def stream() -> Iterator[bytes]:
        for _ in range(events):
            yield token  # no Content-Length: pywsgi sends each yield as its own HTTP chunk
            gevent.sleep(pace_s)
        yield usage + b"data: [DONE]\n\n"

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        if environ["REQUEST_METHOD"] == "GET":
            found = environ["PATH_INFO"] == "/v1/models"
            start_response("200 OK" if found else "404 Not Found",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(models)))])
            return iter([models])
        environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return stream()

    return wsgi


def main(argv: list[str]) -> None:
    from gevent.pywsgi import WSGIServer

    port = int(argv[0])
    events = int(argv[1]) if len(argv) > 1 else 16
    pace_ms = float(argv[2]) if len(argv) > 2 else 5.0
    text = argv[3] if len(argv) > 3 else " tok"
    WSGIServer(("127.0.0.1", port), app(events, pace_ms / 1000.0, text), log=None).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
