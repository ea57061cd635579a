"""``kvops offload check``: run a vLLM server's load-path canary now and read its verdict.

The canary itself lives in the plugin (kvops.plugin.offload.canary, ``POST /kvops/offload/check``):
it stores a one-chunk synthetic prefix, reads it back through the connector and checks its
checksums. This side only asks for it and says what came back.
"""

from __future__ import annotations

from typing import Any

import requests

from kvops.core import http
from kvops.core.errors import KvopsError

CHECK_PATH = "/kvops/offload/check"


def run_check(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The canary's verdict ``{ok, reason, loaded_tokens, checked_at}`` from the server at url.
    A server that does not answer, or has no canary (no kvops offload), is a KvopsError."""
    base = url.rstrip("/")
    try:
        resp = http.request("POST", base + CHECK_PATH, timeout_s)
    except requests.RequestException as exc:
        raise KvopsError(f"vLLM server not reachable at {base}: {type(exc).__name__}") from None
    if resp.status_code == 404:
        raise KvopsError(f"{base} has no {CHECK_PATH}: is it a vLLM server with kvops offload "
                         "configured (an 'offload' section in its kvops settings)?")
    if resp.status_code != 200:
        raise KvopsError(f"{base}{CHECK_PATH} answered HTTP {resp.status_code}: "
                         f"{' '.join(resp.text.split())[:200]}")
    try:
        body = resp.json()
    except ValueError:
        raise KvopsError(f"{base}{CHECK_PATH} did not answer JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        raise KvopsError(f"{base}{CHECK_PATH} answered without an 'ok' verdict")
    return body
