"""The receiving end of Alertmanager's webhook: records every notification it is sent.

What a pager would get; the tests read ``notifications`` and ``make staging`` prints each one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvops.core.proc import free_port

Notification = dict[str, Any]


class Webhook:
    """An HTTP server on a loopback port that keeps each JSON body POSTed to it."""

    def __init__(self, on_notification: Callable[[Notification], None] | None = None) -> None:
        self.port = free_port()
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        self._on = on_notification
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                hook.record(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def record(self, body: Notification) -> None:
        with self._lock:
            self.notifications.append(body)
        if self._on is not None:
            self._on(body)

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert of every notification so far, in arrival order (status, labels, ...)."""
        with self._lock:
            return [a for n in self.notifications for a in n.get("alerts", [])]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
