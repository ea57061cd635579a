"""Prompt tokens as the server itself sees them, via vLLM's /tokenize and /detokenize.

Asking the server (not a local tokenizer) means the chat template, BOS handling and tokenizer
version are exactly the ones the prefix cache hashes.
"""

from __future__ import annotations

from typing import Any

import requests

from kvops.core import http
from kvops.core.errors import BadInputError, KvopsError


class ServerTokenizer:
    def __init__(self, url: str, model: str, timeout_s: float = 30.0,
                 headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self._cache: dict[str, list[int]] = {}

    def tokens(self, prompt: Any, *, add_generation_prompt: bool | None = None,
               template: dict[str, Any] | None = None) -> list[int]:
        """Tokens of a completions prompt (str or ids) or a chat messages list, rendered with the
        chat body's other template inputs (``template``: tools, chat_template_kwargs...).

        ``add_generation_prompt`` given (the shared part of a conversation is rendered without
        one) wins over the body's; left out, the body's own value counts, else vLLM's default."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        key = repr((prompt, add_generation_prompt, template))
        if key not in self._cache:
            body: dict[str, Any] = {"model": self.model}
            if isinstance(prompt, list):
                body.update(template or {})
                body["messages"] = prompt
                if add_generation_prompt is not None:
                    body["add_generation_prompt"] = add_generation_prompt
                body.setdefault("add_generation_prompt", True)
                if body.get("continue_final_message"):
                    body["add_generation_prompt"] = False  # vLLM refuses both at once
            else:
                body["prompt"] = str(prompt)
            self._cache[key] = list(self._post("/tokenize", body)["tokens"])
        return self._cache[key]

    def text(self, tokens: list[int]) -> str:
        return str(self._post("/detokenize", {"model": self.model, "tokens": tokens})["prompt"])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = requests.post(self.url + path, json=body, timeout=self.timeout_s,
                                 headers=self.headers)
            _raise_for_status(resp)
            data: dict[str, Any] = resp.json()
        except (requests.RequestException, ValueError) as exc:
            raise KvopsError(f"{self.url}{path} failed: {exc}") from exc
        return data


def served_model(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None,
                 wanted: str | None = None) -> str:
    """``wanted`` if the server serves it (a --served-model-name), else the first model id
    it lists (OpenAI /v1/models)."""
    try:
        resp = http.get(url.rstrip("/") + "/v1/models", timeout_s, headers=headers)
        _raise_for_status(resp)
        ids = [str(m["id"]) for m in resp.json()["data"]]
        first = ids[0]
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as exc:
        raise KvopsError(f"cannot list models at {url}/v1/models: {exc}") from exc
    if wanted and wanted not in ids:
        raise BadInputError(f"--model {wanted!r}: {url} serves {', '.join(ids)} "
                            "(the names given to vllm serve --served-model-name)")
    return wanted or first


def _raise_for_status(resp: requests.Response) -> None:
    """401/403 say what to pass; anything else as requests words it."""
    if resp.status_code in (401, 403):
        sent = "the key sent was refused" if "Authorization" in resp.request.headers else "no key sent"
        raise BadInputError(f"{resp.url} answered {resp.status_code} ({sent}): pass the server's key "
                            "with --api-key KEY or OPENAI_API_KEY=KEY (and --header 'Name: value' "
                            "for what a proxy in front of it wants)")
    resp.raise_for_status()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
