"""Fixtures for load-test unit tests.

``pausing_server``: a tiny OpenAI-style SSE server on loopback that sends the first token event, then pauses.

Each event is ~150 bytes, far below the 1 KiB that Locust's iter_content()/iter_lines() wait
for, so a client that batches reads sees the first token only after the pause.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import pytest
from sse_servers import SseHandler, event, serving, url_of

PAUSE_S = 1.0
TOKENS = 12


class Handler(SseHandler):
    def do_POST(self) -> None:
        self.start_stream()
        self.chunk(event("é"))  # a 2-byte UTF-8 character in the first event
        time.sleep(PAUSE_S)
        for _ in range(TOKENS - 1):
            self.chunk(event(" tok"))
        self.chunk(event("", usage={"prompt_tokens": 5, "completion_tokens": TOKENS,
                                    "total_tokens": 5 + TOKENS}))
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")


@dataclass(frozen=True)
class PausingServer:
    url: str
    pause_s: float = PAUSE_S
    tokens: int = TOKENS


@pytest.fixture
def pausing_server() -> Iterator[PausingServer]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as server:
        yield PausingServer(url_of(server))
