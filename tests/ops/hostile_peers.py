"""Helpers of the hostile-input suite: run ``kvops`` in-process as its console script does, and
small misbehaving peers on loopback (real sockets, real bytes: the faults are produced, not mocked).
"""

from __future__ import annotations

import contextlib
import io
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvops.ops.cli.main import main

HANG_S = 10
"""A command still running after this is a hang (every --timeout in the suite is far shorter)."""


class Hang(BaseException):  # past the CLI's own `except Exception`
    pass


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


def kvops(*args: str) -> Run:
    """``kvops ARGS`` through the console-script entry (so usage errors are its one line too)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv

    def hang(*_: object) -> None:
        raise Hang(f"kvops {' '.join(args)} still running after {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    sys.argv = ["kvops", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.argv = argv
    return Run(code, out.getvalue(), err.getvalue())


def assert_refused(run: Run, codes: tuple[int, ...] = (2,)) -> None:
    """Exit code in ``codes``, and the error is one line of ours: no traceback, no internal error."""
    assert run.code in codes, (run.code, run.err, run.out[:300])
    assert "Traceback" not in run.err + run.out, run.err
    assert "internal error" not in run.err, run.err
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("kvops: "), run.err


# --- peers ----------------------------------------------------------------------------------


def _garbage(conn: socket.socket) -> None:
    conn.sendall(b"\x00\xff\x13 not http at all \r\n\r\n\xde\xad\xbe\xef" * 64)


def _nothing(conn: socket.socket) -> None:
    """Accepts and closes: the client reads an empty answer."""


def _silent(conn: socket.socket) -> None:
    """Accepts, reads the request, and never answers."""
    time.sleep(HANG_S)


def _drip(conn: socket.socket) -> None:
    """A valid start of an answer, one byte every 0.2 s, forever: no single read ever times out."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Slow: " + b"a" * 10_000:
        conn.sendall(bytes([byte]))
        time.sleep(0.2)


def _http(body: bytes, status: str = "200 OK", ctype: str = "text/plain") -> object:
    def answer(conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
    return answer


BEHAVIOURS = {
    "garbage": _garbage,
    "nothing": _nothing,
    "silent": _silent,
    "one-byte-at-a-time": _drip,
    "empty-200": _http(b""),
    "garbage-200": _http(b"\x00\xff{[ not metrics \xde\xad\n" * 50),
    "nan-metrics": _http(b"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n"
                         b"vllm:kv_cache_usage_perc NaN\nvllm:num_preemptions_total -5\n"),
    "html-500": _http(b"<html>oops</html>", "500 Internal Server Error", "text/html"),
    "json-garbage": _http(b'{"status": "success", "data": 7, "version": [], "ok": "yes"}', ctype="application/json"),
}


@contextlib.contextmanager
def peer(behaviour: str) -> Iterator[str]:
    """A loopback server that treats every connection with ``behaviour``; yields its base URL."""
    handle = BEHAVIOURS[behaviour]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.1)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request line and headers (enough for these GETs/POSTs)
                handle(conn)  # type: ignore[operator]

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        server.close()
