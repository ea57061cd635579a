"""Prompt tokens as the server itself sees them, via vLLM's /tokenize and /detokenize.

Asking the server (not a local tokenizer) means the chat template, BOS handling and tokenizer
version are exactly the ones the prefix cache hashes.
"""

from __future__ import annotations

from typing import Any

import requests

from kvops.ops.errors import KvopsError


class ServerTokenizer:
    def __init__(self, url: str, model: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self._cache: dict[str, list[int]] = {}

    def tokens(self, prompt: Any, *, add_generation_prompt: bool = True) -> list[int]:
        """Tokens of a completions prompt (str or ids) or a chat messages list."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        key = repr((prompt, add_generation_prompt))
        if key not in self._cache:
            body: dict[str, Any] = {"model": self.model}
            if isinstance(prompt, list):
                body.update(messages=prompt, add_generation_prompt=add_generation_prompt)
            else:
                body["prompt"] = str(prompt)
            self._cache[key] = list(self._post("/tokenize", body)["tokens"])
        return self._cache[key]

    def text(self, tokens: list[int]) -> str:
        return str(self._post("/detokenize", {"model": self.model, "tokens": tokens})["prompt"])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = requests.post(self.url + path, json=body, timeout=self.timeout_s)
            resp.raise_for_status()
            data: dict[str, Any] = resp.json()
        except (requests.RequestException, ValueError) as exc:
            raise KvopsError(f"{self.url}{path} failed: {exc}") from exc
        return data


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server serves (OpenAI /v1/models)."""
    try:
        resp = requests.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise KvopsError(f"cannot list models at {url}/v1/models: {exc}") from exc


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
