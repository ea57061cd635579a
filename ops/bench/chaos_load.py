"""The chaos bench's client side: steady greedy load, and health probes after a fault clears.

The load cycles through one fault's prompts with a few concurrent clients. vLLM's own KV cache
is sized to hold about half of them (chaos.KV_BLOCKS), so each prompt has left it by the time it
comes round again and is served through the offload connector (loads from LMCache), the path
where a fault could turn into wrong KV. (Resetting the prefix cache instead does not work under
load: vLLM refuses while requests run.) Every request becomes a ``Sent`` record; nothing is
retried, so a failure the client sees is counted as lost.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Sequence

import requests

from kvops.core.errors import KvopsError
from kvops.core.prom import samples_by_name, selector_sum
from kvops.ops.bench import greedy
from kvops.ops.bench.chaos_report import Sent

REQUEST_TIMEOUT_S = 120.0
"""Longer than the connector's own timeout (offload timeout_s, 10 s): a request the connector
gives up on still comes back, recomputed, before the client would call it lost."""
OUTPUT_TOKENS = 8
PROMPT_TOKENS = 600  # two full 256-token LMCache chunks + a tail vLLM computes
DEGRADED_GAUGES = ("kvops_offload_degraded", "kvops_offload_disk_degraded", "kvops_offload_digest_degraded")


def token_prompt(seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)]


def complete(url: str, model: str, prompt: list[int], max_tokens: int = OUTPUT_TOKENS,
             timeout_s: float = REQUEST_TIMEOUT_S) -> str:
    """The greedy completion's text; raises requests' errors and HTTPError on a non-200."""
    return greedy.complete(url, model, prompt, max_tokens, timeout_s).text


class Load:
    """``workers`` clients sending the prompts round-robin until stop()."""

    def __init__(self, url: str, model: str, prompts: Sequence[tuple[int, tuple[str, ...]]], workers: int = 4) -> None:
        self.url, self.model, self.prompts = url, model, prompts
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._next = itertools.count()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True, name=f"chaos-load-{i}")
                         for i in range(workers)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[Sent]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_TIMEOUT_S + 10)
        with self._lock:
            return list(self.sent)

    def _client(self) -> None:
        while not self._stop.is_set():
            seed, expected = self.prompts[next(self._next) % len(self.prompts)]
            started = time.monotonic()
            try:
                out = greedy.complete(self.url, self.model, token_prompt(seed), OUTPUT_TOKENS, REQUEST_TIMEOUT_S)
                record = Sent(started, out.text, expected, prompt=seed, token_ids=out.token_ids)
            except requests.HTTPError as exc:
                record = Sent(started, None, expected, f"HTTP {exc.response.status_code}", seed)
            except (requests.RequestException, ValueError, KeyError) as exc:
                record = Sent(started, None, expected, type(exc).__name__, seed)
                time.sleep(0.5)  # a server that is down refuses at once: do not spin
            with self._lock:
                self.sent.append(record)


def healthy(url: str, model: str, seed: int) -> bool:
    """vLLM answers /health and a fresh prompt (whose store lets the digest store retry), and
    the offload gauges say nothing is degraded and LMCache answered the plugin's last poll."""
    try:
        if requests.get(url + "/health", timeout=5).status_code != 200:
            return False
        complete(url, model, token_prompt(seed), max_tokens=1, timeout_s=30)
        page = samples_by_name(requests.get(url + "/metrics", timeout=10).text)
    except (requests.RequestException, KvopsError, ValueError, KeyError):
        return False
    degraded = sum(selector_sum(page, name) for name in DEGRADED_GAUGES)
    up = [value for _, value in page.get("kvops_offload_server_up", [])]
    return degraded == 0 and all(value >= 1 for value in up)
