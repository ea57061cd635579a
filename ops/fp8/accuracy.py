"""How far a server's outputs drift from a reference server's, token by token.

Both servers score the same token sequence (teacher forcing: ``echo`` + ``logprobs`` with
``max_tokens=1`` on the completions API, temperature 0), so every position compares like with
like; generation would diverge after the first different token and compare nothing. On vLLM's
CPU backend the prefill attention reads K/V back from the cache
(vllm/v1/attention/backends/cpu_attn.py ``cpu_attention_with_kv_cache``), so the scored
positions see the quantized KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import requests

from kvops.core.errors import KvopsError

EVAL_PROMPTS: tuple[str, ...] = (
    "the scheduler admits requests while blocks are free and preempts the newest one when "
    "decode growth runs out of memory so the cache holds keys and values for every token",
    "prefix caching reuses blocks whose hashes match an earlier prompt system prompts "
    "documents and earlier turns of a conversation are shared between requests",
    "offload moves blocks to host memory and disk time to first token is queueing plus "
    "prefill plus the first decode step and quantised fp8 values halve the bytes per token",
    "hello world you are a helpful assistant answer the question briefly and cite the "
    "document 0 1 2 3 4 5 6 7 8 9 the cache holds keys and values for every token",
)
"""Held out from calibration (kvops.ops.fp8.calibrate's synthetic prompts are word salad)."""


@dataclass(frozen=True)
class ScoredSequence:
    """Per-position logprob of the actual next token, and the model's top-1 token there."""

    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    top1: tuple[str, ...]


@dataclass(frozen=True)
class Drift:
    mean_abs_logprob_delta: float
    max_abs_logprob_delta: float
    top1_agreement: float
    positions: int


def score(url: str, model: str, prompts: Sequence[str] = EVAL_PROMPTS) -> list[ScoredSequence]:
    """Teacher-forced logprobs of each prompt's own tokens (the first has none)."""
    scored = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "echo": True, "logprobs": 1}
        resp = requests.post(url + "/v1/completions", json=body, timeout=300)
        if resp.status_code != 200:
            raise KvopsError(f"{url} refused a scoring request: {resp.status_code} {resp.text[:200]}")
        lp = resp.json()["choices"][0]["logprobs"]
        tokens, values, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
        rows = [(t, v, top) for t, v, top in zip(tokens, values, tops, strict=True) if v is not None]
        rows = rows[:-1]  # the generated token: greedy, its own argmax, nothing to compare
        scored.append(ScoredSequence(
            tokens=tuple(r[0] for r in rows),
            logprobs=tuple(float(r[1]) for r in rows),
            top1=tuple(max(r[2], key=r[2].get) for r in rows),
        ))
    return scored


def drift(reference: Sequence[ScoredSequence], other: Sequence[ScoredSequence]) -> Drift:
    """Mean/max |Δ logprob| per token and the share of positions with the same top-1 token."""
    deltas: list[float] = []
    agree = 0
    for ref, oth in zip(reference, other, strict=True):
        if ref.tokens != oth.tokens:
            raise KvopsError("the two servers tokenized a prompt differently: not the same model?")
        deltas += [abs(a - b) for a, b in zip(ref.logprobs, oth.logprobs, strict=True)]
        agree += sum(a == b for a, b in zip(ref.top1, oth.top1, strict=True))
    if not deltas:
        raise KvopsError("no positions to compare: the prompts are too short")
    return Drift(
        mean_abs_logprob_delta=sum(deltas) / len(deltas),
        max_abs_logprob_delta=max(deltas),
        top1_agreement=agree / len(deltas),
        positions=len(deltas),
    )
