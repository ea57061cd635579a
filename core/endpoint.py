"""How to reach a server that is not ours: its URL, an API key, and the extra headers a proxy
in front of it wants. One value for the load test's requests, /v1/models, the tokenizer calls
and the /metrics scraper, so none of them can forget the key.

vLLM checks ``Authorization: Bearer <key>`` on /v1, /v2, /inference and /cohere only
(vllm/entrypoints/serve/middleware/authenticate.py, ``GUARDED_PREFIX``); /metrics and /tokenize
are open there, but a proxy may guard them too, so every call carries the same headers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvops.core.errors import BadInputError

API_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class Endpoint:
    url: str
    headers: tuple[tuple[str, str], ...] = ()
    """Sent with every request, ``Authorization`` included when an API key was given."""

    def header_dict(self) -> dict[str, str]:
        return dict(self.headers)

    def __repr__(self) -> str:  # never print a key into a log
        return f"Endpoint({self.url!r}, headers={[name for name, _ in self.headers]})"


def check_url(url: str, option: str = "--url") -> str:
    """An http(s) base URL without a trailing slash, or a one-line refusal naming ``option``."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as exc:
        raise BadInputError(f"{option} {url!r}: {exc}; give the server's base URL, e.g. "
                            "http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.netloc or any(c.isspace() or not c.isprintable() for c in url):
        raise BadInputError(f"{option} {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000 "
                            "or https://staging.example.com")
    return url.rstrip("/")


def parse_header(text: str) -> tuple[str, str]:
    """``Name: value`` (curl's form) into a pair; a value may itself contain colons."""
    name, sep, value = text.partition(":")
    name = name.strip()
    if not sep or not name or any(c.isspace() for c in name):
        raise BadInputError(f"--header {text!r}: write it as 'Name: value', "
                            "e.g. --header 'X-Team: search'")
    return name, value.strip()


def header_lines(values: Iterable[str] | str | None) -> list[str]:
    """Header lines from a repeated option, or from one string of newline-separated lines
    (an environment variable, Locust's web UI)."""
    if values is None:
        return []
    items = [values] if isinstance(values, str) else list(values)
    return [line for item in items for line in str(item).splitlines() if line.strip()]


def endpoint(url: str, *, api_key: str | None = None,
             headers: Iterable[str] | str | None = None) -> Endpoint:
    pairs = [parse_header(line) for line in header_lines(headers)]
    if api_key:
        pairs = [(n, v) for n, v in pairs if n.lower() != "authorization"]
        pairs.append(("Authorization", f"Bearer {api_key}"))
    return Endpoint(check_url(url), tuple(pairs))
