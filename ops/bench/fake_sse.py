"""A minimal OpenAI-style SSE server, for measuring the load generator rather than vLLM.

``python -m kvops.ops.bench.fake_sse PORT [EVENTS] [PACE_MS]``: every completion streams EVENTS
token events of ~230 bytes (the size of a vLLM completion event) PACE_MS apart, so each event
arrives in its own read, as from a real server (research/loadgen_bench.md used the same idea).
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EVENT = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
         "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None,
                      "stop_reason": None, "token_ids": None, "prompt_logprobs": None}]}


def handler(events: int, pace_s: float) -> type[BaseHTTPRequestHandler]:
    token = b"data: " + json.dumps(EVENT).encode() + b"\n\n"
    usage = b"data: " + json.dumps({"id": "cmpl-fake", "choices": [], "usage": {
        "prompt_tokens": 8, "completion_tokens": events, "total_tokens": 8 + events}}).encode() + b"\n\n"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_GET(self) -> None:
            payload = json.dumps({"data": [{"id": "fake"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(events):
                self._chunk(token)
                time.sleep(pace_s)
            self._chunk(usage + b"data: [DONE]\n\n")
            self._chunk(b"")

    return Handler


def main(argv: list[str]) -> None:
    port = int(argv[0])
    events = int(argv[1]) if len(argv) > 1 else 16
    pace_ms = float(argv[2]) if len(argv) > 2 else 5.0
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(events, pace_ms / 1000.0))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
