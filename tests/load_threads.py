"""Closed-loop load the runbook states and the staging fleet put on real servers: each user
posts streamed completions, one after another, until stopped."""

from __future__ import annotations

import threading
import time
from typing import Any

import requests
from runbooks.states import Load


class LoadThreads:
    """Closed-loop users posting completions until stopped (``headers``: an API key, say)."""

    def __init__(self, url: str, model: str, load: Load, headers: dict[str, str] | None = None) -> None:
        self._headers = headers or {}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._user, args=(url, model, load, i), daemon=True)
            for i in range(load.users)
        ]
        for t in self._threads:
            t.start()

    def _user(self, url: str, model: str, load: Load, index: int) -> None:
        words = " ".join(f"w{(k * 7 + (0 if load.shared_prompt else index)) % 97}"
                         for k in range(load.prompt_words))
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = words if load.shared_prompt else f"user {index} request {n} {words}"
            body = {"model": model, "prompt": prompt, "max_tokens": load.max_tokens,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            try:
                status = self._stream(url, body)
            except requests.RequestException:
                status = 0
            if status != 200:  # a 429/503 comes back at once: don't spin on it
                time.sleep(0.5)

    def _stream(self, url: str, body: dict[str, Any]) -> int:
        """Streamed, so that stop() hangs up mid-request (vLLM aborts a request whose client has
        gone) instead of waiting for 800 tokens on a preempting server."""
        with requests.post(url + "/v1/completions", json=body, headers=self._headers, timeout=300,
                           stream=True) as resp:
            for _ in resp.iter_lines():
                if self._stop.is_set():
                    break
            return resp.status_code

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=310)
