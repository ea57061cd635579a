"""`kvops offload check --url`: exit 0 for a working load path, 3 when loads do not happen, 1 when
the server fails or has no canary; against a real local HTTP server answering like the plugin."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from kvops.core.proc import free_port
from kvops.ops.cli.main import app

runner = CliRunner()


def serve(status: int, body: str) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            data = body.encode() if self.path == "/kvops/offload/check" else b"{}"
            self.send_response(status if self.path == "/kvops/offload/check" else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def peer(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from serve(*request.param)


OK = json.dumps({"ok": True, "reason": "loaded 127 tokens through the connector; checksums match",
                 "loaded_tokens": 127, "checked_at": 1.0})
NO_LOADS = json.dumps({"ok": False, "reason": "loads do not happen: ...", "loaded_tokens": 0,
                       "checked_at": 1.0})


@pytest.mark.parametrize(("peer", "code", "words"), [
    ((200, OK), 0, "load path ok"),
    ((200, NO_LOADS), 3, "loads do not happen"),
    ((500, "boom"), 1, "answered HTTP 500"),
    ((200, "not json"), 1, "did not answer JSON"),
], indirect=["peer"])
def test_exit_code_follows_the_verdict(peer, code, words):
    result = runner.invoke(app, ["offload", "check", "--url", peer])
    assert result.exit_code == code, result.output
    assert words in result.output
    assert "Traceback" not in result.output


def test_a_server_without_the_canary_is_named():
    for url in serve(200, OK):
        result = runner.invoke(app, ["offload", "check", "--url", url + "/other"])
    assert result.exit_code == 1
    assert "kvops offload configured" in result.output


def test_nobody_listening_is_exit_1():
    result = runner.invoke(app, ["offload", "check", "--url", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 1
    assert "not reachable" in result.output
