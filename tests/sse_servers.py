"""Loopback OpenAI-style SSE servers for the load generator's own tests: each answers
GET /v1/models with one model ("fake") and nothing else (no /metrics: a run goes on without),
and streams chunked SSE events as its subclass's ``do_POST`` decides."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar


def event(text: str, usage: dict[str, int] | None = None) -> bytes:
    """One completion event with ``text``, or the usage event when ``usage`` is given."""
    body: dict[str, object] = {"id": "cmpl-1", "object": "text_completion", "model": "fake",
                               "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if usage is not None:
        body = {"id": "cmpl-1", "object": "text_completion", "model": "fake", "choices": [],
                "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class SseHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "fake"}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def start_stream(self) -> None:
        """Read the request body and send the stream's headers."""
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


Server = TypeVar("Server", bound=ThreadingHTTPServer)


@contextmanager
def serving(server: Server) -> Iterator[Server]:
    """Serve on a daemon thread (one daemon thread per request) until the block ends."""
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


def url_of(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"
