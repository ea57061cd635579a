"""HTTP exchanges that end on time, however the peer behaves.

``requests``' timeout bounds each socket read, not the exchange: a peer that sends one byte
every two seconds, or headers that never end, holds a command forever. Here the whole exchange
(connect, headers, body) runs in a daemon thread that the caller stops waiting for at the
deadline; a command wraps its work in ``deadline(seconds)`` so that all its exchanges together
end within its ``--timeout``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import requests

from kvops.core.errors import BadInputError

_END: ContextVar[float | None] = ContextVar("kvops_http_deadline", default=None)


def check_timeout(seconds: float, option: str = "--timeout") -> float:
    """A finite, positive number of seconds, or a one-line refusal (NaN fails too)."""
    if not 0 < seconds < math.inf:
        raise BadInputError(f"{option} {seconds}: give a number of seconds > 0, e.g. 30")
    return seconds


@contextlib.contextmanager
def deadline(seconds: float, option: str = "--timeout") -> Iterator[None]:
    """Every ``request`` inside ends by ``seconds`` from now (an inner deadline may be shorter)."""
    end = time.monotonic() + check_timeout(seconds, option)
    outer = _END.get()
    token = _END.set(end if outer is None else min(end, outer))
    try:
        yield
    finally:
        _END.reset(token)


def remaining(default_s: float) -> float:
    """Seconds left before the deadline (``default_s`` when none is set); at most ``default_s``."""
    end = _END.get()
    return default_s if end is None else min(default_s, end - time.monotonic())


def request(method: str, url: str, timeout_s: float, **kwargs: Any) -> requests.Response:
    """``requests.request`` with its body read, all within ``timeout_s`` and the deadline.
    Raises ``requests.Timeout`` when the peer has not finished by then, and whatever
    ``requests`` raised otherwise, so callers keep their ``except requests.RequestException``."""
    budget = remaining(timeout_s)
    if budget <= 0:
        raise requests.Timeout(f"the --timeout ran out before {method} {url}")
    outcome: list[requests.Response | BaseException] = []

    def exchange() -> None:
        try:
            response = requests.request(method, url, timeout=budget, **kwargs)
            _ = response.content  # the body is part of the exchange
            outcome.append(response)
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=exchange, name="kvops-http", daemon=True)
    worker.start()
    worker.join(budget)
    if not outcome:
        raise requests.Timeout(f"no complete answer from {url} within {budget:.3g} s")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def get(url: str, timeout_s: float, **kwargs: Any) -> requests.Response:
    return request("GET", url, timeout_s, **kwargs)
