"""Fixtures for load-test unit tests.

``pausing_server``: a tiny OpenAI-style SSE server on loopback that sends the first token event, then pauses.

Each event is ~150 bytes, far below the 1 KiB that Locust's iter_content()/iter_lines() wait
for, so a client that batches reads sees the first token only after the pause.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

PAUSE_S = 1.0
TOKENS = 12


def _event(text: str, usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, object] = {"id": "cmpl-1", "object": "text_completion", "model": "fake",
                               "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if usage is not None:
        body = {"id": "cmpl-1", "object": "text_completion", "model": "fake", "choices": [],
                "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_GET(self) -> None:  # /v1/models
        payload = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(_event("é"))  # a 2-byte UTF-8 character in the first event
        time.sleep(PAUSE_S)
        for _ in range(TOKENS - 1):
            self._chunk(_event(" tok"))
        self._chunk(_event("", usage={"prompt_tokens": 5, "completion_tokens": TOKENS,
                                      "total_tokens": 5 + TOKENS}))
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


@dataclass(frozen=True)
class PausingServer:
    url: str
    pause_s: float = PAUSE_S
    tokens: int = TOKENS


@pytest.fixture
def pausing_server() -> Iterator[PausingServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield PausingServer(f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
