"""The offload bench's streaming client: its TTFT is when vLLM's first event arrives, read in
O(lines) Python calls. With ``return_token_ids`` vLLM's first event carries every prompt id (a
2,048-token prompt: ~14 KB in one line), and reading it one byte per call added 45-225 ms to
each hit's TTFT on the 2-core box (issue 43's timeline: the first token left vLLM's output
processor that long before the client had parsed it)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from kvops.ops.bench import offload

PROMPT_IDS = list(range(30_000, 32_048))


def _event(text: str, ids: list[int], prompt_ids: list[int] | None = None) -> bytes:
    body: dict[str, object] = {"choices": [{"text": text, "token_ids": ids}]}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _Server:
    """Chunked SSE like vLLM's: the first event (with the prompt ids), then a pause until
    ``release`` is set (at most 10 s), then the rest."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.paused_out = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._chunk(_event(" a", [7], PROMPT_IDS))
                server.paused_out = not server.release.wait(10)
                self._chunk(_event(" b", [8]) + b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def sse() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.httpd.shutdown()
    server.httpd.server_close()


def test_the_first_event_with_every_prompt_id_is_read_in_a_few_chunks_not_byte_by_byte(sse, monkeypatch):
    sse.release.set()
    chunks = []
    iter_content = requests.Response.iter_content

    def counted(self: requests.Response, *args: object, **kwargs: object) -> Iterator[bytes]:
        for chunk in iter_content(self, *args, **kwargs):
            chunks.append(len(chunk))
            yield chunk

    monkeypatch.setattr(requests.Response, "iter_content", counted)
    first, text, ids = offload.stream(sse.url, Path("m"), [1, 2, 3])
    assert (text, ids) == (" a b", (7, 8))
    assert sum(chunks) > 14_000  # the first event alone
    assert len(chunks) <= 10


def test_the_first_token_is_stamped_when_its_event_arrives_not_when_more_data_does(sse, monkeypatch):
    """The server holds back the rest until the client has stamped the first token: a client
    that waits for more bytes than the first event before parsing it stamps it only after the
    server's 10 s pause (``paused_out``)."""
    perf_counter = offload.time.perf_counter
    calls = []

    def stamping() -> float:
        calls.append(1)
        if len(calls) == 2:  # the first token's stamp (the first call starts the clock)
            sse.release.set()
        return perf_counter()

    monkeypatch.setattr(offload.time, "perf_counter", stamping)
    _, text, _ = offload.stream(sse.url, Path("m"), [1, 2, 3])
    assert text == " a b"
    assert not sse.paused_out
